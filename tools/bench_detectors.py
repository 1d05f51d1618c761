"""Change detectors on real AdamW trajectories: changed fraction, misses, over-report, time.

fp32 masters with Qwen3-like magnitudes (~N(0, 0.02)), split into ``--tensors`` equal
tensors, are stepped by a real ``torch.optim.AdamW`` with fresh random gradients each
step (per tensor a log-uniform scale; Adam is invariant to it up to eps). The payload is
the bf16 cast of the masters, as in a Megatron bf16 model. For every step and every
setting (lr, weight decay) the three detectors of ``dte_detector`` run on the same state:

* snapshot: ``diff`` of the bf16 payload before and after the step (the reference);
* adamw: ``invert_adamw`` from the post-step AdamW state, default guard band: its
  missed count (must be 0; the script exits with status 1 otherwise) and its
  over-reported fraction (reported but unchanged, over all elements); the same inversion
  with ``guard_ulps=0`` is run untimed to show what the guard band prevents;
* cast: ``CastDetector.record`` before ``model.copy_(master)`` and ``changes``: missed
  and extra (both must be 0).

``--masters midpoints`` is the adversarial variant: before every step each master is
moved onto a bf16 rounding midpoint, or 1-2 fp32 ulps beside it (the optimizer state
carries on), where the fp32 round-off of the inversion decides the cast.

Timing, per step: ``--timing-warmup`` untimed runs then ``--reps`` timed runs of each
detector over all tensors (device synchronised), median and p90; each detector's median
is divided by the snapshot diff's median of the same step, and the table shows the
median and p90 of those ratios over the steps. Detection only: the snapshot's own cost
of keeping a copy (a clone per step) is not in its time.

Output: a per-step table per setting, then one Markdown row per setting for
``docs/benchmarks.md`` (date, sha, machine, command, ...).

    uv run python tools/bench_detectors.py                 # CPU, 20M elements, ~2 min on 2 cores
    uv run python tools/bench_detectors.py --quick         # smoke run
    uv run python tools/bench_detectors.py --device cuda --numel 1e9
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
from provenance import git_sha, machine

from dte_detector import CastDetector, diff, invert_adamw, torch_adamw_states

DTYPE = torch.bfloat16
WEIGHT_STD = 0.02
"""Qwen3-like projection weights."""
ADAMW_IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True},
               "fused": {"fused": True}}
DEFAULT_SETTINGS = "3e-6:0.003,1e-5:0.1"
QUICK = {"numel": 2e5, "tensors": 2, "steps": 3, "reps": 1, "timing_warmup": 0}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--numel", type=float, default=2e7, help="elements in all tensors")
    p.add_argument("--tensors", type=int, default=8, help="equal tensors the elements form")
    p.add_argument("--steps", type=int, default=6, help="measured optimizer steps")
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help="comma-separated lr:weight_decay pairs, one trajectory each")
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--adamw-impl", choices=sorted(ADAMW_IMPLS), default="fused")
    p.add_argument("--masters", choices=["normal", "midpoints"], default="normal",
                   help="midpoints: move every master next to a bf16 rounding midpoint "
                        "before each step (adversarial)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3, help="timed runs per detector and step")
    p.add_argument("--timing-warmup", type=int, default=1, help="untimed runs first")
    p.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    p.add_argument("--sha", default=None, help="git sha for the row (default: git rev-parse)")
    args = p.parse_args(argv)
    if args.quick:  # quick sizes, but flags given explicitly still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.steps < 1 or args.reps < 1 or args.tensors < 1 or args.numel < args.tensors:
        p.error("--steps, --reps and --tensors must be >= 1 and --numel >= --tensors")
    try:
        args.pairs = [tuple(float(x) for x in s.split(":")) for s in args.settings.split(",")]
    except ValueError:
        p.error(f"--settings: expected lr:weight_decay[,lr:weight_decay...], got {args.settings!r}")
    return args


def _near_midpoints(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each value moved onto the midpoint above its bf16 cast, then 0-2 fp32 ulps off it."""
    low = x.to(DTYPE)
    high = torch.nextafter(low, torch.full_like(low, float("inf")))
    mid = (low.float() + high.float()) / 2
    offsets = torch.randint(-2, 3, x.shape, generator=gen, device=x.device, dtype=torch.int32)
    return (mid.view(torch.int32) + offsets).view(torch.float32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], a: argparse.Namespace, device: torch.device) -> list[float]:
    for _ in range(a.timing_warmup):
        fn()
    times = []
    for _ in range(a.reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def _missed(reference, found) -> int:
    return int((~torch.isin(reference.indices, found.indices)).sum())


def _step_row(params, optimizer, models, a, device) -> dict:
    """Detect one step's changes three ways; check them; time them."""
    states = {id(s.param): s for s in torch_adamw_states(optimizer)}
    new = [p.detach().to(DTYPE) for p in params]
    refs = [diff(old, cur) for old, cur in zip(models, new)]

    def invert(guard: float | None = None):
        kw = {} if guard is None else {"guard_ulps": guard}
        return [invert_adamw(f"t{i}", s.param, s.exp_avg, s.exp_avg_sq, s.hyper,
                             previous_step=s.hyper.step - 1, dtype=DTYPE, **kw)
                for i, s in enumerate(states[id(p)] for p in params)]

    def cast():
        detector = CastDetector()
        for i, (p, model) in enumerate(zip(params, models)):
            detector.record(f"t{i}", p.detach(), model)
        return [detector.changes(f"t{i}", model) for i, model in enumerate(models)]

    found, unguarded, dirty = invert(), invert(0.0), cast()
    changed = sum(len(r) for r in refs)
    row = {
        "changed": changed,
        "missed": sum(_missed(r, f) for r, f in zip(refs, found)),
        "over": sum(len(f) for f in found) - changed + sum(_missed(r, f)
                                                         for r, f in zip(refs, found)),
        "unguarded_missed": sum(_missed(r, f) for r, f in zip(refs, unguarded)),
        "cast_missed": sum(_missed(r, d) for r, d in zip(refs, dirty)),
        "cast_extra": sum(_missed(d, r) for r, d in zip(refs, dirty)),
    }
    row["t_snapshot"] = _timed(lambda: [diff(o, c) for o, c in zip(models, new)], a, device)
    row["t_adamw"] = _timed(invert, a, device)
    row["t_cast"] = _timed(cast, a, device)
    return row


def trajectory(lr: float, wd: float, a: argparse.Namespace) -> tuple[list[dict], int]:
    device = torch.device(a.device)
    gen = torch.Generator(device=device).manual_seed(a.seed)
    size = int(a.numel) // a.tensors
    params = [torch.nn.Parameter(torch.randn(size, generator=gen, device=device) * WEIGHT_STD)
              for _ in range(a.tensors)]
    scales = [10 ** (torch.rand((), generator=gen, device=device).item() * 6 - 4)
              for _ in params]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=tuple(a.betas),
                                  eps=a.eps, **ADAMW_IMPLS[a.adamw_impl])
    models = [p.detach().to(DTYPE) for p in params]
    rows = []
    for _ in range(a.steps):
        if a.masters == "midpoints":
            with torch.no_grad():
                for p, model in zip(params, models):
                    p.copy_(_near_midpoints(p.detach(), gen))
                    model.copy_(p)
        for p, scale in zip(params, scales):
            p.grad = torch.randn(size, generator=gen, device=device) * scale
        optimizer.step()
        rows.append(_step_row(params, optimizer, models, a, device))
        for p, model in zip(params, models):
            model.copy_(p.detach())
    return rows, size * a.tensors


def _ratios(rows: list[dict], key: str) -> list[float]:
    return [statistics.median(r[key]) / statistics.median(r["t_snapshot"]) for r in rows]


def _print_steps(rows: list[dict], numel: int, lr: float, wd: float) -> None:
    print(f"\n# lr {lr:g}, weight decay {wd:g}: {numel / 1e6:.1f}M elements")
    print(f"{'step':>4} {'%chg':>6} {'missed':>6} {'over %':>8} {'unguard':>7} {'cast':>5} | "
          f"{'diff ms':>8} {'adamw x':>8} {'cast x':>7}")
    for step, r in enumerate(rows, 1):
        diff_ms = 1e3 * statistics.median(r["t_snapshot"])
        adamw = statistics.median(r["t_adamw"]) / statistics.median(r["t_snapshot"])
        cast = statistics.median(r["t_cast"]) / statistics.median(r["t_snapshot"])
        print(f"{step:>4} {100 * r['changed'] / numel:>6.2f} {r['missed']:>6} "
              f"{100 * r['over'] / numel:>8.4f} {r['unguarded_missed']:>7} "
              f"{r['cast_missed'] + r['cast_extra']:>5} | {diff_ms:>8.2f} {adamw:>8.2f} "
              f"{cast:>7.2f}")


HEADER = ["date", "sha", "machine", "command", "setting", "changed %", "adamw missed",
          "adamw over-reported % (mean / max)", "unguarded missed", "cast missed+extra",
          "snapshot diff ms", "adamw / diff (median, p90)", "cast / diff (median, p90)"]


def markdown_row(rows: list[dict], numel: int, lr: float, wd: float,
                 a: argparse.Namespace) -> str:
    chg = [100 * r["changed"] / numel for r in rows]
    over = [100 * r["over"] / numel for r in rows]
    adamw, cast = _ratios(rows, "t_adamw"), _ratios(rows, "t_cast")
    diff_ms = statistics.median(1e3 * statistics.median(r["t_snapshot"]) for r in rows)
    cmd = "uv run python tools/bench_detectors.py" + "".join(f" {x}" for x in sys.argv[1:])
    cells = [datetime.date.today().isoformat(), f"`{a.sha or git_sha()}`", machine(a.device),
             f"`{cmd}`",
             f"lr {lr:g}, wd {wd:g}, {a.adamw_impl}, {a.masters} masters; "
             f"{numel / 1e6:.1f}M x {a.steps} steps",
             f"{min(chg):.2f}-{max(chg):.2f}", str(sum(r["missed"] for r in rows)),
             f"{statistics.mean(over):.4f} / {max(over):.4f}",
             str(sum(r["unguarded_missed"] for r in rows)),
             str(sum(r["cast_missed"] + r["cast_extra"] for r in rows)),
             f"{diff_ms:.2f}",
             f"{statistics.median(adamw):.2f}x, {_p90(adamw):.2f}x",
             f"{statistics.median(cast):.2f}x, {_p90(cast):.2f}x"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    torch.manual_seed(a.seed)
    start = time.perf_counter()
    lines, failed = [], False
    for lr, wd in a.pairs:
        rows, numel = trajectory(lr, wd, a)
        _print_steps(rows, numel, lr, wd)
        lines.append(markdown_row(rows, numel, lr, wd, a))
        failed |= any(r["missed"] or r["cast_missed"] or r["cast_extra"] for r in rows)
    print(f"\nruntime {time.perf_counter() - start:.0f} s; for docs/benchmarks.md:")
    print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER))
    print("\n".join(lines))
    if failed:
        print("FAILED: a detector missed a change (or the cast detector was not exact)")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
