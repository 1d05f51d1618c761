"""What TorchActor's loop-pattern checks cost next to the step and the sync they guard.

Before every step and sync ``areal_dte.TorchActor`` checks that every optimizer parameter
is a master, reads every master's and model copy's version counter (writes outside the
optimizer or into the copy), and, for the ``adamw`` method, probes flush-to-zero. All of
it is O(tensors), nothing per element. This script times those checks (the actor's own
private helpers, called as ``step`` and ``sync`` call them) against a real fused AdamW
step and a delta sync of the same tensors over a loopback, and prints the ratio and a
Markdown row for ``docs/benchmarks.md``.

The default is Qwen3-4B's tensor count (290, with ``--numel`` elements each instead of
its real sizes so it runs on a CPU): the checks' cost depends on the count only, so
smaller tensors make the ratio larger, never smaller, than on the real model.

    uv run python tools/bench_actor_checks.py
    uv run python tools/bench_actor_checks.py --tensors 290 --numel 1e6 --reps 20
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from areal_dte import Method, TorchActor
from dte_detector.torch_adamw import flush_to_zero
from dte_transport import Loopback, Receiver, Sender
from provenance import git_sha, machine


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=290, help="tensor count (Qwen3-4B: 290)")
    p.add_argument("--numel", type=float, default=2**16, help="elements per tensor")
    p.add_argument("--reps", type=int, default=10, help="timed steps and syncs")
    p.add_argument("--device", default="cpu")
    return p.parse_args()


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    args = _parse()
    device = torch.device(args.device)
    masters = {f"t{i}": torch.nn.Parameter(torch.randn(int(args.numel), device=device) * 0.02)
               for i in range(args.tensors)}
    optimizer = torch.optim.AdamW(masters.values(), lr=3e-6, weight_decay=0.003, fused=True)
    rollout = Receiver({n: torch.zeros_like(p, dtype=torch.bfloat16) for n, p in masters.items()},
                       device=device)
    actor = TorchActor(masters, optimizer, Sender(Loopback(rollout), anchor_interval=0),
                       method=Method.ADAMW)
    actor.sync(0)
    checks, steps, syncs = [], [], []
    for version in range(1, args.reps + 2):
        for p in masters.values():
            p.grad = torch.randn_like(p)
        sync_device = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        start = time.perf_counter()
        actor._check_parameters()  # what step() and sync() each run before their work
        actor._outside_writes()
        flush_to_zero()
        checked = time.perf_counter()
        actor.step()
        sync_device()
        stepped = time.perf_counter()
        actor.sync(version)
        sync_device()
        done = time.perf_counter()
        if version > 1:  # the first is warm-up
            checks.append(checked - start)
            steps.append(stepped - checked)
            syncs.append(done - stepped)
    check_ms, step_ms, sync_ms = (_median_ms(s) for s in (checks, steps, syncs))
    print(f"{args.tensors} tensors x {int(args.numel)} elements on {device}: checks "
          f"{check_ms * 1e3:.0f} us, step {step_ms:.1f} ms, delta sync {sync_ms:.1f} ms; "
          f"checks / step = {check_ms / step_ms:.2%}, checks / (step + sync) = "
          f"{check_ms / (step_ms + sync_ms):.2%}")
    print(f"| {datetime.date.today()} | `{git_sha()}` | {machine(args.device)} | "
          f"`uv run python tools/bench_actor_checks.py --tensors {args.tensors} --numel "
          f"{args.numel:g} --reps {args.reps}` | {check_ms * 1e3:.0f} us | {step_ms:.1f} ms | "
          f"{sync_ms:.1f} ms | {check_ms / step_ms:.2%} | {check_ms / (step_ms + sync_ms):.2%} |")


if __name__ == "__main__":
    main()
