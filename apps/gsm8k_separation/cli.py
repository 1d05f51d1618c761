"""Command line of ``uv run apps/gsm8k_separation``: the embedded GSM8K GRPO job.

    uv run apps/gsm8k_separation                       # defaults: configs/local.yaml, offline
    uv run apps/gsm8k_separation --out runs/a --steps 10 actor.optimizer.lr=3e-5
    uv run apps/gsm8k_separation --data ../shared/data/gsm8k/train.jsonl --model /path/qwen3
    uv run apps/gsm8k_separation --config apps/gsm8k_separation/configs/gsm8k_grpo_qwen3_30b_a3b.yaml --dry-run
    uv run apps/gsm8k_separation --out runs/a actor.weight_update_delta_diagnostics.recovery=true
    uv run apps/gsm8k_separation --out runs/b --resume runs/a --steps 12
    uv run --extra areal apps/gsm8k_separation --config CLUSTER.yaml scheduler.type=slurm

Positional ``dotted.key=value`` items override the profile; AReaL and delta keys are
checked by dte-config, ``embedded.*`` keys by the app (see experiment.py). A config without
an ``embedded:`` section is a cluster config: with ``scheduler.type`` set it runs through
AReaL's trainer and scheduler (cluster.py, the ``areal`` extra).

Exit codes: 0 done; 1 a sync failed its digest check or the deterministic rollout
diagnostics found a difference; 2 the configuration or the command line was refused.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from dte_config import ConfigError
from omegaconf import OmegaConf
from tqdm import tqdm

from . import checkpoint, job
from .data import load_problems
from .metrics import METRICS_FILE, PLOT_FILE
from .experiment import DEFAULT_PROFILE, load_profile

log = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    """The app's arguments."""
    p = argparse.ArgumentParser(prog="gsm8k_separation", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides of the profile, e.g. actor.optimizer.lr=3e-5")
    p.add_argument("--config", type=Path, default=DEFAULT_PROFILE,
                   help="experiment YAML (default: the embedded profile %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config, print it resolved and exit")
    p.add_argument("--out", type=Path, help="write metrics.jsonl, sync.png and the store here")
    p.add_argument("--data", help="GSM8K jsonl file (question/answer records); default: "
                                  "openai/gsm8k when datasets is installed and the hub "
                                  "answers, else built-in GSM8K-style problems")
    p.add_argument("--model", help="local Hugging Face checkpoint; default: a random tiny Qwen3")
    p.add_argument("--steps", type=int, help="optimizer steps (syncs = steps + 1); "
                                             "default: total_train_steps of the profile")
    p.add_argument("--resume", type=Path, metavar="DIR",
                   help="start from the checkpoint a run with "
                        "actor.weight_update_delta_diagnostics.recovery=true wrote (its --out "
                        "folder); the first sync after it is full")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log INFO lines")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the job and return its exit code (see the module doc)."""
    args = parser().parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        profile = load_profile(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)  # noqa: T201 - the CLI's answer
        return 2
    if args.dry_run:
        print(OmegaConf.to_yaml(profile.tree, resolve=True), end="")  # noqa: T201
        return 0
    if profile.embedded is None:
        return _cluster(profile)
    refusal = _refusal(args, profile)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)  # noqa: T201
        return 2
    say = tqdm.write
    seed = int(profile.tree.get("seed", 1))
    problems, source = load_problems(args.data, seed=seed)
    steps = args.steps if args.steps is not None else int(profile.tree.get("total_train_steps")
                                                            or 6)
    say(f"data: {len(problems)} problems from {source}; {steps} steps, {steps + 1} syncs")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    records = job.run(profile, problems, steps=steps, out=args.out, model=args.model,
                      resume=args.resume, say=say, progress=not args.no_progress)
    _summary(records, say, elapsed=time.perf_counter() - started, out=args.out)
    checks = [r[key] for r in records for key in ("verified", "rollout_identical")]
    return 1 if False in checks else 0


def _cluster(profile) -> int:
    """Run a cluster config through AReaL; 2 when it cannot start."""
    kind = profile.tree.get("scheduler", {}).get("type")
    if kind is None:
        print("config error: scheduler.type=None: a cluster config runs through AReaL's "
              "scheduler; fix: set scheduler.type=local, slurm or ray (with the areal extra: "
              "uv run --extra areal ...); --dry-run validates without it",
              file=sys.stderr)  # noqa: T201
        return 2
    from areal_dte.errors import AReaLImportError  # noqa: PLC0415

    try:
        from .cluster import prepare_cluster, run_cluster  # noqa: PLC0415 - needs AReaL

        job = prepare_cluster(profile.tree, profile.run)
    except (AReaLImportError, ConfigError) as exc:
        print(f"config error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    for line in job.plan.describe():
        tqdm.write(line)
    run_cluster(job)
    return 0


def _refusal(args: argparse.Namespace, profile) -> str | None:
    """Why the command line cannot run with this profile, or None."""
    if profile.run.delta.weight_update_delta_diagnostics.recovery and args.out is None:
        return ("actor.weight_update_delta_diagnostics.recovery=true writes a checkpoint into "
                "--out DIR; give --out")
    if args.resume is not None:
        try:
            checkpoint.locate(args.resume)
        except checkpoint.CheckpointError as exc:
            return str(exc)
    return None


def _summary(records, say, *, elapsed: float, out: Path | None) -> None:
    deltas = [r for r in records if r["kind"] == "delta"]
    kinds = {k: sum(r["kind"] == k for r in records) for k in ("full", "delta", "anchor")}
    verified = sum(r["verified"] is True for r in records)
    line = (f"{len(records)} syncs ({kinds['full']} full, {kinds['delta']} delta, "
            f"{kinds['anchor']} anchor), {verified} verified, {elapsed:.1f} s")
    if deltas:
        sent = sum(r["payload_bytes"] for r in deltas)
        dense = sum(r["dense_bytes"] for r in deltas)
        changed = sum(r["changed"] for r in deltas)
        line += (f"; deltas: {sent:,} B of {dense:,} B dense ({dense / max(sent, 1):.1f}x), "
                 f"{sent / max(changed, 1):.2f} B per changed element")
    say(line)
    if out is not None:
        say(f"wrote {out / METRICS_FILE} and {out / PLOT_FILE}")
