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

Every input is checked before a worker starts (`inputs.py`). Exit codes: 0 done; 1 a sync
failed its digest check or the deterministic rollout diagnostics found a difference; 2 an
input was refused (config, files, data lines, model, ``--out``), one line on stderr naming
the input, what was wrong and the fix; 3 the job failed otherwise (a worker died), one
line; 130 interrupted (Ctrl-C or SIGTERM), after writing ``metrics.jsonl`` and ``sync.png``
for the finished syncs. ``--debug`` (or ``GSM8K_DEBUG=1``) adds the traceback. Torch is
imported only once a job starts, so ``--help`` and refusals answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from dte_config import ConfigError, ConfigFileError
from omegaconf import OmegaConf
from tqdm import tqdm

from .experiment import DEFAULT_PROFILE, load_profile
from .inputs import InputError, check_data, check_model, check_out, claim_out
from .metrics import METRICS_FILE, PLOT_FILE
from .worker import Interrupted

log = logging.getLogger(__name__)

DEBUG_ENV = "GSM8K_DEBUG"
"""Set to 1 for tracebacks, as with ``--debug``."""
FAILED = 3
"""Exit code of a job that failed for another reason than its inputs or a check."""
INTERRUPTED = 130
"""Exit code after Ctrl-C or SIGTERM (128 + SIGINT, the shell's convention)."""


def parser() -> argparse.ArgumentParser:
    """The app's arguments."""
    p = argparse.ArgumentParser(prog="gsm8k_separation", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides of the profile, e.g. actor.optimizer.lr=3e-5")
    p.add_argument("--config", type=Path, default=DEFAULT_PROFILE,
                   help="experiment YAML (default: the embedded profile %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and every input, print the config resolved, and "
                        "end with a verdict: what would run, or the refusal (same exit code)")
    p.add_argument("--out", type=Path, help="write metrics.jsonl, sync.png and the store here "
                                            "(refused when it holds an earlier run)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run in --out")
    p.add_argument("--data", help="GSM8K jsonl file (question/answer records); default: "
                                  "openai/gsm8k when datasets is installed and the hub "
                                  "answers, else built-in GSM8K-style problems")
    p.add_argument("--model", help="local Hugging Face checkpoint folder, or a hub id in the "
                                   "local Hugging Face cache; default: a random tiny Qwen3")
    p.add_argument("--steps", type=int, help="optimizer steps (syncs = steps + 1); "
                                             "default: total_train_steps of the profile")
    p.add_argument("--resume", type=Path, metavar="DIR",
                   help="start from the checkpoint a run with "
                        "actor.weight_update_delta_diagnostics.recovery=true wrote (its --out "
                        "folder, which may be --out itself); the first sync after it is full")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log INFO lines")
    p.add_argument("--debug", action="store_true",
                   help=f"show the traceback behind an error (also: {DEBUG_ENV}=1)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the job and return its exit code (see the module doc)."""
    args = parser().parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C
    try:
        return _run(args)
    except (Exception, KeyboardInterrupt) as exc:  # the process edge: one line, an exit code
        if debug:
            traceback.print_exc()
        code, line = _answer(exc, args.out)
        print(line, file=sys.stderr)  # noqa: T201 - the CLI's one-line answer
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _answer(exc: BaseException, out: Path | None) -> tuple[int, str]:
    """The exit code and the one line for an exception that ended the run."""
    if isinstance(exc, ConfigFileError):
        return 2, (f"config error: {exc}; fix: give an existing experiment YAML, e.g. "
                   f"{DEFAULT_PROFILE}")
    if isinstance(exc, ConfigError):
        return 2, f"config error: {exc}"
    if isinstance(exc, InputError):
        return 2, f"error: {exc}"
    if isinstance(exc, Interrupted):
        wrote = f"; wrote {out / METRICS_FILE} and {out / PLOT_FILE}" if out and exc.records \
            else ""
        return INTERRUPTED, f"interrupted after {len(exc.records)} finished syncs{wrote}"
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED, "interrupted before the first sync; nothing written"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # A worker's failure is its name, then its traceback: show the name and the last line.
    said = " ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else type(exc).__name__
    return FAILED, (f"error: {said} ({type(exc).__name__}; rerun with --debug or "
                    f"{DEBUG_ENV}=1 for the traceback)")


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    profile = load_profile(args.config, args.overrides)
    if args.dry_run:
        print(OmegaConf.to_yaml(profile.tree, resolve=True), end="")  # noqa: T201
    if profile.embedded is None:
        return _cluster(profile, dry_run=args.dry_run)
    _check_resume(args, profile)
    if args.out is not None:
        check_out(args.out, overwrite=args.overwrite, resume=args.resume)
    model = check_model(args.model)
    problems, source = check_data(args.data, seed=int(profile.tree.get("seed", 1)))
    steps = args.steps if args.steps is not None else int(profile.tree.get("total_train_steps")
                                                            or 6)
    plan = f"{len(problems)} problems from {source}; {steps} steps, {steps + 1} syncs"
    if args.dry_run:
        print(f"dry run: would run the embedded job: {plan}; model "  # noqa: T201
              f"{model or 'tiny random Qwen3'}; output {args.out or 'none (no --out)'}")
        return 0
    lock = claim_out(args.out, overwrite=args.overwrite) if args.out is not None else None
    try:
        return _embedded(args, profile, problems, model=model, steps=steps, plan=plan,
                         started=started)
    finally:
        if lock is not None:
            lock.close()


def _embedded(args: argparse.Namespace, profile: Any, problems: list, *, model: str | None,
              steps: int, plan: str, started: float) -> int:
    from . import job  # noqa: PLC0415 - imports torch; only once every input is checked

    say = tqdm.write
    say(f"data: {plan}")
    records = job.run(profile, problems, steps=steps, out=args.out, model=model,
                      resume=args.resume, say=say, progress=not args.no_progress)
    _summary(records, say, elapsed=time.perf_counter() - started, out=args.out)
    checks = [r[key] for r in records for key in ("verified", "rollout_identical")]
    return 1 if False in checks else 0


def _cluster(profile: Any, *, dry_run: bool) -> int:
    """Run (or with `dry_run` plan) a cluster config through AReaL; 2 when it cannot start."""
    kind = profile.tree.get("scheduler", {}).get("type")
    if kind is None:
        raise InputError(name="scheduler.type=None",
                         problem="a cluster config runs through AReaL's scheduler",
                         fix="set scheduler.type=local, slurm or ray (with the areal extra: "
                             "uv run --extra areal ...)")
    from areal_dte.errors import AReaLImportError, IncompatibleStackError  # noqa: PLC0415

    try:
        if dry_run:
            from areal_dte.areal.areal_job import plan_cluster  # noqa: PLC0415 - needs AReaL

            plan = plan_cluster(profile.tree, profile.run)
        else:
            from .cluster import prepare_cluster  # noqa: PLC0415 - needs AReaL

            cluster_job = prepare_cluster(profile.tree, profile.run)
            plan = cluster_job.plan
    except AReaLImportError as exc:
        raise InputError(name=f"scheduler.type={kind}", problem=str(exc),
                         fix="run it in AReaL's environment: UV_PROJECT_ENVIRONMENT="
                             "/tmp/dte-areal-venv uv run --extra areal apps/gsm8k_separation "
                             "...") from exc
    except IncompatibleStackError as exc:
        raise InputError(name=f"{exc.what} {exc.got}", problem=str(exc),
                         fix="install the cluster image's versions (packages/areal-dte/"
                             "README.md) in this environment, or set "
                             "actor.enable_delta_weight_update=false") from exc
    for line in plan.describe():
        tqdm.write(line)
    if dry_run:
        print(f"dry run: would run the cluster job through AReaL's {kind} "  # noqa: T201
              f"scheduler")
        return 0
    from .cluster import run_cluster  # noqa: PLC0415

    run_cluster(cluster_job)
    return 0


def _check_resume(args: argparse.Namespace, profile: Any) -> None:
    """Refuse recovery without ``--out`` and ``--resume`` without a checkpoint."""
    from . import checkpoint  # noqa: PLC0415

    if profile.run.delta.weight_update_delta_diagnostics.recovery and args.out is None:
        raise InputError(name="actor.weight_update_delta_diagnostics.recovery=true",
                         problem="writes a checkpoint into --out DIR", fix="give --out")
    if args.resume is not None:
        try:
            checkpoint.locate(args.resume)
        except checkpoint.CheckpointError as exc:
            raise InputError(name=f"--resume {args.resume}", problem=str(exc),
                             fix="give the --out folder of a run with "
                                 "actor.weight_update_delta_diagnostics.recovery=true") from exc


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
