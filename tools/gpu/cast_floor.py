"""What a compare-and-copy costs before it stages anything: the cast detector's floor (GPU).

The cast detector's kernel (``dte_detector.cast_kernel``) reads the fp32 master and the
16-bit model, ORs the flips into the dirty bits, copies ``cast(master)`` into the model and
stages every first-seen flip's (index, old value) for the sorted outputs. This script times
bare Triton kernels that do only parts of that work, in place over the trajectory of
``bench_kernels.py`` (two fused AdamW steps at --lr; --numel elements in tensors of
--tensor-numel), beside the detector itself and a bf16 copy measured in the same run. Each
row gives the device time (median of --reps, each call profiled alone after the model is
reset to its old bits) and its bandwidth over the cast's 6 minimal bytes per element as a
fraction of the copy's (issue 11's target 1 asks 60 %):

* ``compare``: read both, count the flips of each block;
* ``+ copy flips`` / ``rows`` / ``sectors`` / ``all``: and write ``cast(master)`` into the
  model where an element flipped, on rows of 8 elements (16 bytes, the detector's choice)
  or 32-byte sectors that hold a flip, or everywhere (same bits: no flip means equal bits);
* ``+ dirty``: and OR the flips into packed dirty bits;
* ``+ stage``: and stage the block's flips in its slab as the detector does
  (``staging.stage``: a block-wide scan for the slots, one int32 word per flip holding
  its offset and old bits, a quarter of the block's elements at most), without the
  detector's later ``_gather`` into sorted outputs: the staging's share of the cast.

    PYTHONPATH=packages/dte-detector/src:tools:tools/gpu python3 tools/gpu/cast_floor.py
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from bench_kernels import (CAST_BYTES, CastRun, case_parser, copy_bandwidth, device_ms,
                           row_prefix, split, trajectory)
from dte_detector.cast_kernel import SLAB_FRACTION
from dte_detector.staging import stage

BLOCK = 1024
WARPS = 4
SLAB = BLOCK // SLAB_FRACTION
ALL = tl.constexpr(-1)
VARIANTS = {  # name: (copy granule in elements, 0 none, ALL everywhere; dirty bits; stage)
    "compare": (0, False, False), "+ copy flips": (1, False, False),
    "+ copy rows": (8, False, False), "+ copy sectors": (16, False, False),
    "+ copy all": (ALL.value, False, False), "+ copy rows + dirty": (8, True, False),
    "+ copy all + dirty": (ALL.value, True, False), "+ copy rows + dirty + stage": (8, True, True),
}


@triton.jit
def _floor(master_ptr, model_ptr, dirty_ptr, counts_ptr, slab_ptr, numel, BLOCK: tl.constexpr,
           GRANULE: tl.constexpr, DIRTY: tl.constexpr, STAGE: tl.constexpr,
           SLAB: tl.constexpr):
    block = tl.program_id(0)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    master = tl.load(master_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    old = tl.load(model_ptr + offsets, mask=inside, other=0)
    cast = master.to(tl.bfloat16).to(tl.int16, bitcast=True)
    flips = (cast != old) & inside
    if DIRTY:
        bits = tl.sum(tl.reshape(flips.to(tl.int32), (BLOCK // 8, 8))
                      << tl.arange(0, 8)[None, :], axis=1)
        rows = block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        in_map = rows < (numel + 7) // 8
        before = tl.load(dirty_ptr + rows, mask=in_map, other=0)
        tl.store(dirty_ptr + rows, (before.to(tl.int32) | bits).to(tl.uint8), mask=in_map)
    if GRANULE == ALL:
        tl.store(model_ptr + offsets, cast, mask=inside)
    elif GRANULE == 1:
        tl.store(model_ptr + offsets, cast, mask=flips)
    elif GRANULE > 1:
        hit = tl.max(tl.reshape(flips.to(tl.int32), (BLOCK // GRANULE, GRANULE)), axis=1)
        spread = tl.reshape(tl.broadcast_to(hit[:, None], (BLOCK // GRANULE, GRANULE)), (BLOCK,))
        tl.store(model_ptr + offsets, cast, mask=(spread != 0) & inside)
    count = tl.sum(flips.to(tl.int32), axis=0)
    if STAGE:
        if count <= SLAB:
            old_rows = tl.reshape(old, (BLOCK // 8, 8))
            stage(slab_ptr, block, tl.reshape(flips.to(tl.int32), (BLOCK // 8, 8)),
                  tl.reshape(tl.arange(0, BLOCK), (BLOCK // 8, 8)), old_rows, old_rows, SLAB)
    tl.store(counts_ptr + block, count)


def main() -> int:
    args = case_parser(__doc__.splitlines()[0]).parse_args()
    numel = int(args.numel)
    bandwidth = copy_bandwidth(numel, args)
    states, old, truth = trajectory(split(numel, args), args)
    changed = sum(t.indices.numel() for t in truth) / numel
    run = CastRun(states, old, batched=True)
    masters = [s.param.detach().reshape(-1) for s in states]
    dirty = [torch.zeros((m.numel() + 7) // 8, dtype=torch.uint8, device="cuda") for m in masters]
    counts = [torch.empty(triton.cdiv(m.numel(), BLOCK), dtype=torch.int32, device="cuda")
              for m in masters]
    slabs = [torch.empty(c.numel() * SLAB, dtype=torch.int32, device="cuda") for c in counts]
    meta = row_prefix(args, "tools/gpu/cast_floor.py")
    print("| date | sha | machine | command | kernel | numel | changed % | device ms "
          "| TB/s over 6 B | of copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def row(name: str, ms: float) -> None:
        rate = CAST_BYTES * numel / ms  # bytes per ms
        print(f"{meta}| {name} | {numel:.3g} | {changed:.2%} | {ms:.2f} | {rate / 1e9:.2f} "
              f"| {rate / bandwidth:.0%} |", flush=True)

    for name, (granule, with_dirty, staged) in VARIANTS.items():
        def floor(granule=granule, with_dirty=with_dirty, staged=staged) -> None:
            for master, model, bits, count, slab in zip(masters, run.models, dirty, counts,
                                                        slabs):
                _floor[(count.numel(),)](master, model.view(torch.int16), bits, count, slab,
                                         master.numel(), BLOCK=BLOCK, GRANULE=granule,
                                         DIRTY=with_dirty, STAGE=staged, SLAB=SLAB,
                                         num_warps=WARPS)
        floor()  # compiled outside the timing
        row(name, device_ms(floor, reps=args.reps, reset=run.reset))
    run()
    row("cast detector (`record_and_copy_all`)", device_ms(run, reps=args.reps, reset=run.reset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
