"""Tile shapes of the batched detection kernels, timed against each other (GPU).

For each candidate ``ROWSxWARPSxWAVES`` (rows of 8 elements per tile, warps per program,
programs per multiprocessor) this sets the constants of ``inversion_kernel`` and
``cast_kernel``, and with ``/SLOTSxCHUNK[xWARPS]`` after it (or alone, the tiles' constants
left as they are) those of the shared slab gather (``staging.GATHER_SLOTS``, ``GATHER_CHUNK``,
``GATHER_WARPS``: the module's own when not given), then times the inversion as a sync
runs it (``bench_kernels.InvertBatched``: one kept ``inverter.Inverter``, whose plan
follows the tile size) and ``CastDetector.record_and_copy_all`` over the trajectory of
``tools/gpu/bench_kernels.py`` (``--numel`` elements in tensors of ``--tensor-numel``),
wall time (CUDA events) and summed device time (torch.profiler, ``bench_kernels.device_ms``),
each as a fraction of the copy bandwidth measured in the same run over the kernel's minimal
bytes. Every candidate's change sets (and the cast's model bits) must equal the first
candidate's bit for bit; the script exits 1 otherwise. Prints one Markdown row per
candidate and kernel.

Run (GPU machine, from the repository root):
    PYTHONPATH=packages/dte-detector/src:packages/dte-codec/src:tools:tools/gpu \\
        python3 tools/gpu/tune_kernels.py --candidates 128x4x16 32x1x32 /1024x64x4 --sha <sha>
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_kernels import (CAST_BYTES, INVERSION_BYTES, CastRun, InvertBatched, case_parser,
                           copy_bandwidth, device_ms, median_ms, row_prefix, same, split,
                           trajectory)

from dte_detector import cast_kernel, inversion_kernel, staging


def parse() -> argparse.Namespace:
    parser = case_parser(__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", default=["128x4x16", "32x1x32"])
    return parser.parse_args()


def main() -> int:
    args = parse()
    numel = int(args.numel)
    bandwidth = copy_bandwidth(numel, args)
    states, old, _ = trajectory(split(numel, args), args)
    meta = row_prefix(args, "tools/gpu/tune_kernels.py")
    print("| date | sha | machine | command | kernel | rows x warps x waves / gather | numel | ms "
          "| of copy | device ms | of copy (device) | == first |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    first = None
    bad = False
    invert = InvertBatched(states)  # one across candidates: its plan follows ROWS
    gather_warps = staging.GATHER_WARPS
    for candidate in args.candidates:
        tiles, _, gather = candidate.partition("/")
        if tiles:
            rows, warps, waves = (int(x) for x in tiles.split("x"))
            for module in (inversion_kernel, cast_kernel):
                module.ROWS, module.WARPS, module.WAVES = rows, warps, waves
        if gather:
            slots, chunk, *rest = (int(x) for x in gather.split("x"))
            staging.GATHER_SLOTS, staging.GATHER_CHUNK = slots, chunk
            staging.GATHER_WARPS = rest[0] if rest else gather_warps
        inverted = invert()
        inversion_ms = median_ms(invert, reps=args.reps, warmup=args.warmup)
        inversion_device = device_ms(invert, reps=args.reps)
        cast = CastRun(states, old, batched=True)
        cast_ms = median_ms(cast, reps=args.reps, warmup=args.warmup, reset=cast.reset)
        cast_device = device_ms(cast, reps=args.reps, reset=cast.reset)
        results = (inverted, cast.changes(), cast.model_bits())
        if first is None:
            first = results
        equal = (same(first[0], results[0]) and same(first[1], results[1])
                 and all(torch.equal(a, b) for a, b in zip(first[2], results[2])))
        bad |= not equal
        for kernel, ms, device, minimal in (
                ("inversion", inversion_ms, inversion_device, INVERSION_BYTES),
                ("cast", cast_ms, cast_device, CAST_BYTES)):
            print(f"{meta}| {kernel} | {candidate} | {numel:.3g} | {ms:.2f} "
                  f"| {minimal * numel / ms / bandwidth:.0%} | {device:.2f} "
                  f"| {minimal * numel / device / bandwidth:.0%} | {'yes' if equal else 'NO'} |",
                  flush=True)
        del cast, results, inverted
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
