"""``CastDetector.record`` and the master -> model copy fused into one Triton kernel.

One pass reads the fp32 master, the 16-bit model and the packed dirty bits, tile by tile
(``staging.py``), for all tensors of a call at once (``batch.py``), and writes the dirty
bits OR the flips, the first-seen (index, old value) pairs and, when copying,
``cast(master)`` into the model: the same bits as ``record`` followed by
``model.copy_(master)`` (the cast is the hardware's round-to-nearest-even ``cvt.rn`` that
torch's CUDA copy uses too; a flip is a bit difference or NaN over NaN).

The copy writes only the rows of 8 elements that hold a flip: everywhere else
``cast(master)`` has the bits the model holds already (no flip means equal bits), so
the model ends bit for bit as after a full copy, and a sparse step writes a fraction of
the model's bytes.

A tile stages its first-seen pairs in its slab of ``1 / SLAB_FRACTION`` of its elements
and ``staging.gather`` moves them into sorted outputs. A tile with more first-seen pairs
than that writes nothing in the first pass, not even the model: ``_record``'s dense
pass then does that tile again from the same inputs and writes its pairs straight into
the outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import batch, layout
from .changes import ChangeRun
from .staging import (advance, gather, locate, member_offset, narrow, on_device, place,
                      programs, read_limit, stage, store_count, tile_elements, tile_offsets)

ROWS = 128
"""Rows of 8 elements per tile; one byte of dirty bits per row."""
WARPS = 4
WAVES = 64
"""Programs per multiprocessor (``staging.programs``): more than fit at once (about five),
so that the programs' last tiles even out across the multiprocessors (measured against
16, 32 and 128 in docs/benchmarks.md)."""
REGISTERS: int | None = 72
"""A cap on registers per thread (``maxnreg``; None: the compiler's 124): 7 programs of 4
warps per multiprocessor instead of 4 (measured against 96 and 80: docs/benchmarks.md)."""
SLAB_FRACTION = 4
"""A tile stages at most a quarter of its elements as first seen (1 byte of scratch per
element); a denser tile is done again by the dense pass."""
_NAN_ABOVE = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_PAYLOAD = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_FP32_ALIGN, _HALF_ALIGN = batch.VECTOR_BYTES // 4, batch.VECTOR_BYTES // 2


@triton.jit
def _load(master_ptr, model_ptr, dirty_ptr, offsets_ptr, width, numels_ptr, starts_ptr,
          member, tile, ROWS: tl.constexpr, FP32_ALIGN: tl.constexpr,
          HALF_ALIGN: tl.constexpr, NARROW: tl.constexpr):
    """A tile's master and old model bits, its dirty bytes (read here with the rest, so
    that the tile after the current one has them in flight too: a load issued in
    ``_tile`` would stall every tile for a memory round trip), its offset in its member,
    the member's size and the member-local element offsets (int32 with ``NARROW``, as in
    the inversion)."""
    own = tile - tl.load(starts_ptr + member)
    offsets, _, _ = tile_offsets(own, ROWS, NARROW)
    own = own.to(offsets.dtype)
    numel = tl.load(numels_ptr + member).to(offsets.dtype)
    master = tl.load((master_ptr + member_offset(offsets_ptr, member, FP32_ALIGN)) + offsets,
                     mask=offsets < read_limit(numel, FP32_ALIGN), other=0.0,
                     eviction_policy="evict_first")
    old = tl.load((model_ptr + member_offset(offsets_ptr, width + member, HALF_ALIGN)) + offsets,
                  mask=offsets < read_limit(numel, HALF_ALIGN), other=0)
    rows = own * ROWS + tl.arange(0, ROWS)
    before = tl.load((dirty_ptr + member_offset(offsets_ptr, 2 * width + member, 1)) + rows,
                     mask=rows < (numel + 7) // 8, other=0)
    return master, old, before, own, numel, offsets


@triton.jit
def _tile(model_ptr, dirty_ptr, offsets_ptr, width, counts_ptr, dense_ptr, slab_ptr,
          index_ptr, old_ptr, total, tile, master, old, before, member, own, numel, offsets,
          PAYLOAD: tl.constexpr, NAN_ABOVE: tl.constexpr, COPY: tl.constexpr,
          ROWS: tl.constexpr, KEEP: tl.constexpr, DENSE: tl.constexpr,
          HALF_ALIGN: tl.constexpr):
    """One tile: stage (or with DENSE, place from its first slot: ``slab_ptr`` holds the
    tiles' ends then) its first-seen pairs, OR its flips into the dirty bits and copy its
    flipped rows, unless the first pass finds it too dense (and counts it)."""
    columns = tl.arange(0, 8)[None, :]
    local = tl.arange(0, ROWS)[:, None] * 8 + columns
    inside = offsets < numel
    old = old.to(tl.int32) & 0xFFFF
    cast = master.to(PAYLOAD).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    both_nan = ((cast & 0x7FFF) > NAN_ABOVE) & ((old & 0x7FFF) > NAN_ABOVE)
    flips = (((cast != old) | both_nan) & inside).to(tl.int32)
    dirty_at = ((dirty_ptr + member_offset(offsets_ptr, 2 * width + member, 1))
                + (own * ROWS + tl.arange(0, ROWS)))
    in_map = own * ROWS + tl.arange(0, ROWS) < (numel + 7) // 8
    before = before.to(tl.int32)
    fresh = flips & (1 - ((before[:, None] >> columns) & 1))
    count = tl.sum(tl.sum(fresh, axis=1), axis=0)
    if not DENSE:
        store_count(counts_ptr, dense_ptr, tile, count, KEEP)
    if count <= KEEP:
        if DENSE:
            place(index_ptr, old_ptr, total, tl.load(slab_ptr + tile) - count, fresh, offsets,
                  old, old, VALUES=1)
        else:
            stage(slab_ptr, tile, fresh, local, old, old, KEEP)
        row_flips = tl.sum(flips << columns, axis=1)
        tl.store(dirty_at, (before | row_flips).to(tl.uint8), mask=in_map)
        if COPY:
            at = (model_ptr + member_offset(offsets_ptr, width + member, HALF_ALIGN)) + offsets
            rows = tl.broadcast_to((row_flips != 0)[:, None], (ROWS, 8))
            if (own + 1) * (ROWS * 8) <= numel:  # a full tile: the row mask stays vectorised
                tl.store(at, cast.to(tl.int16), mask=rows)
            else:
                tl.store(at, cast.to(tl.int16), mask=rows & inside)


@triton.jit(do_not_specialize=["tiles", "width", "total"])
def _record(master_ptr, model_ptr, dirty_ptr, offsets_ptr, width, numels_ptr, starts_ptr,
            counts_ptr, dense_ptr, slab_ptr, index_ptr, old_ptr, tiles, total,
            PAYLOAD: tl.constexpr, NAN_ABOVE: tl.constexpr, COPY: tl.constexpr,
            ROWS: tl.constexpr, SLAB: tl.constexpr, FP32_ALIGN: tl.constexpr,
            HALF_ALIGN: tl.constexpr, NARROW: tl.constexpr):
    """The first pass: programs walk the tiles, reading the next tile first."""
    first, step = tl.program_id(0), tl.num_programs(0)
    member = advance(starts_ptr, first.to(tl.int64) * 0, first)
    master, old, before, own, numel, offsets = _load(
        master_ptr, model_ptr, dirty_ptr, offsets_ptr, width, numels_ptr, starts_ptr, member,
        first, ROWS, FP32_ALIGN, HALF_ALIGN, NARROW)
    for tile in range(first, tiles, step):
        member_next = advance(starts_ptr, member, tile + step)
        master_next, old_next, before_next, own_next, numel_next, offsets_next = _load(
            master_ptr, model_ptr, dirty_ptr, offsets_ptr, width, numels_ptr, starts_ptr,
            member_next, tile + step, ROWS, FP32_ALIGN, HALF_ALIGN, NARROW)
        _tile(model_ptr, dirty_ptr, offsets_ptr, width, counts_ptr, dense_ptr, slab_ptr,
              index_ptr, old_ptr, total, tile, master, old, before, member, own, numel,
              offsets, PAYLOAD, NAN_ABOVE, COPY, ROWS, SLAB, False, HALF_ALIGN)
        master, old, before, member, own = master_next, old_next, before_next, member_next, own_next
        numel, offsets = numel_next, offsets_next


@triton.jit(do_not_specialize=["tiles", "width", "total", "steps"])
def _record_dense(master_ptr, model_ptr, dirty_ptr, offsets_ptr, width, numels_ptr,
                  starts_ptr, counts_ptr, ends_ptr, index_ptr, old_ptr, tiles, total, steps,
                  PAYLOAD: tl.constexpr, NAN_ABOVE: tl.constexpr, COPY: tl.constexpr,
                  ROWS: tl.constexpr, SLAB: tl.constexpr,
                  FP32_ALIGN: tl.constexpr, HALF_ALIGN: tl.constexpr, NARROW: tl.constexpr):
    """The tiles the first pass left (more than SLAB first-seen pairs), one program each,
    their pairs written straight into the outputs from the tile's first slot (its end
    less its count)."""
    tile = tl.program_id(0)
    if tl.load(counts_ptr + tile) > SLAB:
        member = locate(starts_ptr, tile, steps)
        master, old, before, own, numel, offsets = _load(
            master_ptr, model_ptr, dirty_ptr, offsets_ptr, width, numels_ptr, starts_ptr,
            member, tile, ROWS, FP32_ALIGN, HALF_ALIGN, NARROW)
        _tile(model_ptr, dirty_ptr, offsets_ptr, width, counts_ptr, counts_ptr, ends_ptr,
              index_ptr, old_ptr, total, tile, master, old, before, member, own, numel, offsets,
              PAYLOAD, NAN_ABOVE, COPY, ROWS, ROWS * 8, True, HALF_ALIGN)


def record(members: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
           dtypes: Sequence[torch.dtype], kept: layout.Fused, *, copy: bool
           ) -> list[ChangeRun]:
    """Record (and with ``copy``, copy) the tensors of one device; dirty maps in place.

    Args:
        members: per tensor (``kept.pick``'s members of a call) its contiguous fp32
            master, its contiguous bf16 or fp16 model of the same size (any shapes: the
            kernels read them flat) and its packed dirty bits (``ceil(numel / 8)`` bytes,
            LSB first); non-empty.
        dtypes: the models' dtypes.
        kept: the plan of ``members``' groups, planned here when it does not fit
            (``ROWS`` is read at the call, ``tools/gpu/tune_kernels.py`` sets it).

    Returns:
        One run per group (members keyed by their positions in ``members``, every tensor
        in one): per tensor the sorted indices of its first-seen flips and their old
        values, as exact bounds.
    """
    tile = tile_elements(ROWS)
    groups = kept.groups(members, dtypes, tile_elements=tile)
    found: list[ChangeRun] = []
    capacity = tile // SLAB_FRACTION
    device = members[0][0].device

    def launch(group: batch.Group):
        dtype = dtypes[group.members[0]]
        master, model, dirty = members[group.members[0]]
        counts, sizes = batch.scratch(group, device)
        slab = torch.empty(group.tiles * capacity, dtype=torch.int32, device=device)
        config = {"PAYLOAD": _PAYLOAD[dtype], "NAN_ABOVE": _NAN_ABOVE[dtype], "COPY": copy,
                  "ROWS": ROWS, "SLAB": capacity, "num_warps": WARPS,
                  "FP32_ALIGN": _FP32_ALIGN if group.aligned else 1,
                  "HALF_ALIGN": _HALF_ALIGN if group.aligned else 1,
                  "NARROW": narrow(group.numel, ROWS),
                  "maxnreg": REGISTERS}
        tables = (master, model.view(torch.int16), dirty, group.offsets, group.offsets.shape[1],
                  group.numels, group.starts, counts)
        _record[(programs(group.tiles, device, waves=WAVES),)](
            *tables, sizes, slab, slab, slab, group.tiles, 0, **config)
        return tables, config, counts, batch.tile_ends(group, counts, sizes), slab, sizes

    def finish(group: batch.Group, launched, sizes: list[int]) -> None:
        tables, config, counts, ends, slab, _ = launched
        dense, *member_ends = sizes
        total = member_ends[-1]
        indices, old = gather(counts, ends, total, slab, group.starts, steps=group.steps,
                              numel=group.numel, values=1, rows=ROWS, capacity=capacity)
        if dense:
            _record_dense[(group.tiles,)](*tables, ends, indices, old, group.tiles, total,
                                          group.steps, **config)
        values = old[0].view(dtypes[group.members[0]])
        found.append(ChangeRun(group.members, tuple(batch.member_counts(member_ends)), indices,
                               values, values))

    with on_device(device):
        batch.pipelined(groups, launch, lambda launched: launched[-1], finish)
    return found
