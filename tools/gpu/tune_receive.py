"""Program shapes of the receiver's route and value kernels, timed against each other (GPU).

For each candidate ``BLOCKxWARPS`` (elements per program, warps per program) this sets the
constants of ``dte_codec.route_kernel`` (``_route``, ``_move``) and
``dte_codec.values_kernel`` (``_escaped``, ``_resolve``), builds a fresh ``ShardStage``
from ``tools/gpu/bench_remap.py``'s case (Qwen3-4B, Megatron TP1 trainer into one SGLang
TP1 rank, ``--changed`` of the elements flipped by one ulp), and runs the delta and its
inverse (decode, stage, write) alternately: a warm-up pair, then ``--reps`` pairs, each
delta profiled alone. Per kernel its device time (median over the profiled deltas), with
the wall time of decode + stage + write under the profiler (its overhead included: a
check, not a timing). The rank's tensors must equal a full load by the
reference bit for bit after every write; the script exits 1 otherwise. Prints one
Markdown row per candidate.

Run (GPU machine, from the repository root):
    export PYTHONPATH=packages/dte-codec/src:packages/dte-detector/src:packages/areal-dte/src
    PYTHONPATH=$PYTHONPATH:tools:tools/gpu python3 tools/gpu/tune_receive.py \\
        --candidates 1024x4 256x4 --sha <sha>
"""

from __future__ import annotations

import argparse
import collections
from contextlib import nullcontext
import datetime
import statistics
import sys
import time

import torch
from bench_remap import QWEN3_4B, SMOKE, StageCase
from provenance import git_sha, machine
from torch.profiler import ProfilerActivity, profile

from dte_codec import decode, route_kernel, values_kernel

KERNELS = ("_route", "_move", "_escaped", "_resolve")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidates", nargs="+", default=["1024x4", "256x4"])
    p.add_argument("--changed", type=float, default=0.033)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sha", default=None, help="default: this checkout's")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (interpreter)")
    return p.parse_args()


def main() -> int:
    a = parse()
    device = torch.device("cpu" if a.smoke else "cuda")
    case = StageCase.of(SMOKE if a.smoke else QWEN3_4B, a.changed, device)
    meta = (f"| {datetime.date.today().isoformat()} | `{a.sha or git_sha()}` "
            f"| {machine(device.type)} | `python3 tools/gpu/tune_receive.py "
            f"{' '.join(sys.argv[1:])}` ")
    print(f"changed elements {case.changed_elements:.3g}")
    print("| date | sha | machine | command | block x warps | "
          + " | ".join(f"`{k}` ms" for k in KERNELS) + " | kernels ms | profiled wall ms | bitwise |")
    print("|---|---|---|---|---|" + "---|" * len(KERNELS) + "---|---|---|")
    bad = False
    for candidate in a.candidates:
        block, warps = (int(x) for x in candidate.split("x"))
        for module in (route_kernel, values_kernel):
            module.BLOCK, module.WARPS = block, warps
        case.fresh_stage()
        per_kernel, walls, bitwise = collections.defaultdict(list), [], True
        for rep in range(a.reps + 1):  # the first pair warms up (compiles, plans)
            for frame, after in zip(case.deltas, ("new", "old")):
                profiled = rep > 0 and after == "new"
                times, wall = _delta(case, frame, device, profiled)
                bitwise &= all(torch.equal(case.local[n].view(torch.int16),
                                           case.expected[after][n].view(torch.int16))
                               for n in case.local)
                if profiled:
                    walls.append(wall)
                    for kernel in KERNELS:
                        per_kernel[kernel].append(times.get(kernel, 0.0))
        bad |= not bitwise
        medians = [statistics.median(per_kernel[k]) for k in KERNELS]
        print(f"{meta}| {candidate} | " + " | ".join(f"{m:.2f}" for m in medians)
              + f" | {sum(medians):.2f} | {statistics.median(walls):.1f} "
              f"| {'yes' if bitwise else 'NO'} |", flush=True)
    return 1 if bad else 0


def _delta(case: StageCase, frame, device: torch.device, profiled: bool
           ) -> tuple[dict[str, float], float]:
    """Decode, stage and write one delta: device ms per kernel name (when ``profiled``)
    and the wall ms."""
    _synchronize(device)
    profiled &= device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA]) if profiled else nullcontext() as prof:
        start = time.perf_counter()
        case.stage(case.local, decode(frame, device=device)).write()
        _synchronize(device)
        wall = (time.perf_counter() - start) * 1e3
    if not profiled:
        return {}, wall
    times = collections.Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key] += event.self_device_time_total / 1e3
    return dict(times), wall


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
