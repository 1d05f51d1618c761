"""Tiles and staged compaction shared by the Triton detection kernels.

A program of a detection kernel walks ``[ROWS, 8]`` tiles of a flat tensor (one byte of
packed bits per row), reading the next tile while it works on the current one (a few
programs per multiprocessor, so that loads stay in flight during the arithmetic). It stages
the selected elements of a tile (their offset in the tile and one or two 16-bit values,
packed into one int32 or int64 word) in the tile's slab of ``SLAB`` slots, in index order; a cumulative sum of the per-tile
counts gives each tile's first output slot, and ``gather`` moves the slabs there: sorted
flat indices and their values, as ``torch.nonzero`` and a gather would give them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .changes import index_dtype

_GATHER_SLOTS = 4096
"""Slab slots one ``_gather`` program moves (a few tiles' worth)."""

@triton.jit
def tile_offsets(tile, ROWS: tl.constexpr):
    """Flat offsets of a ``[ROWS, 8]`` tile, its column numbers, and offsets within it."""
    local = tl.arange(0, ROWS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    return tl.cast(tile, tl.int64) * (ROWS * 8) + local, tl.arange(0, 8)[None, :], local


@triton.jit
def slots(flags):
    """Each flagged element's rank among the tile's flagged elements, in index order."""
    per_row = tl.sum(flags, axis=1)
    return (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(flags, axis=1) - flags


@triton.jit
def stage(slab_ptr, tile, flags, local, first, second, SLAB: tl.constexpr):
    """Stage the flagged elements of a tile in its slab, in index order, one word each:
    the offset in the tile in bits 0-15, ``first`` in 16-31, ``second`` in 32-47 (an
    int32 slab keeps the first two)."""
    word = (local.to(tl.int64) | (first.to(tl.int64) & 0xFFFF) << 16
            | (second.to(tl.int64) & 0xFFFF) << 32)
    tl.store(slab_ptr + tl.cast(tile, tl.int64) * SLAB + slots(flags),
             word.to(slab_ptr.dtype.element_ty), mask=flags != 0)


@triton.jit(do_not_specialize=["tiles", "total"])
def _gather(counts_ptr, starts_ptr, slab_ptr, index_ptr, values_ptr, tiles, total,
            VALUES: tl.constexpr, ROWS: tl.constexpr, SLAB: tl.constexpr,
            TILES: tl.constexpr):
    """Move the slabs of ``TILES`` tiles to their sorted place in the outputs."""
    tile = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES)[:, None]
    count = tl.load(counts_ptr + tile, mask=tile < tiles, other=0)
    slot = tl.arange(0, SLAB)[None, :]
    staged = slot < count
    at = tl.load(starts_ptr + tile, mask=tile < tiles, other=0) + slot
    word = tl.load(slab_ptr + tile * SLAB + slot, mask=staged, other=0).to(tl.int64)
    tl.store(index_ptr + at, (tile * (ROWS * 8) + (word & 0xFFFF)).to(index_ptr.dtype.element_ty),
             mask=staged)
    for row in tl.static_range(VALUES):
        tl.store(values_ptr + row * total + at, (word >> (16 * (row + 1))).to(tl.int16),
                 mask=staged)


def programs(tiles: int, device: torch.device, *, waves: int) -> int:
    """How many programs walk ``tiles`` tiles on ``device``: ``waves`` per multiprocessor,
    each taking tiles ``program, program + programs, ...``."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, sms * waves))


def gather(counts: torch.Tensor, ends: torch.Tensor, total: int, slab: torch.Tensor,
           numel: int, *, values: int, rows: int, capacity: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices and a ``[values, total]`` int16 tensor of the staged elements
    (``slab``: int32 words for one value, int64 for two).

    ``counts`` holds each tile's staged count (0 for a tile that staged nothing), ``ends``
    their cumulative sum and ``total`` its last element.
    """
    indices = torch.empty(total, dtype=index_dtype(numel), device=counts.device)
    staged = torch.empty((values, total), dtype=torch.int16, device=counts.device)
    if total:
        tiles = counts.numel()
        per_program = max(1, _GATHER_SLOTS // capacity)
        _gather[(triton.cdiv(tiles, per_program),)](
            counts, ends - counts, slab, indices, staged, tiles, total, VALUES=values,
            ROWS=rows, SLAB=capacity, TILES=per_program, num_warps=4)
    return indices, staged
