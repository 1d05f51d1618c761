"""Triton kernels that route every changed element of a payload to its place in a shard's
local tensors, and move values along those routes, one launch each for all entries.

The flat space is the payload's sparse entries back to back, each on whole blocks (entry
``e`` owns the blocks from ``first_block[e]`` on; its element ``r`` is element
``indices[e][r]`` of its source tensor), so a program reads its entry from a block ->
entry table (``fields.block_segments``: one load, no search, no compile-time entry count).
Per entry the ``entries`` table holds the address and item size of its index tensor, the
item size of its values, its source tensor's element count and two inner sizes (its shape
right-aligned to three dimensions; the outer coordinate follows from them) and its run of
transfers in the ``transfers`` table; per transfer: its target tensor, its source box per
dimension and the affine map to the target's flat index (``remap.affine_map``). An entry
whose transfers split its tensor along one dimension has a lookup (``routes.Routes``): its
element reads its transfer there; the others compare the element with each of their boxes.
``_route`` writes per element the byte address of its target element (0: no local piece
holds it) and reads the value there into the entry's value buffer (0 where unrouted: the
+0.0 base), and counts indices outside their tensor and elements that two transfers reach
(the caller falls back to the reference for both). ``_move`` writes values at those
addresses.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_bits import column, load_uniform, owned_block, rows_of, store_uniform
from .routes import SOURCE_COLUMNS

BLOCK = 512
"""Elements per program (``tools/gpu/tune_receive.py``: 512 edged out 1,024 for ``_route``
in three runs, ``_move`` alike)."""
WARPS = 4
ENTRY_COLUMNS = ("first_block", "index_at", "index_size", "itemsize", *SOURCE_COLUMNS,
                 "elements", "blocks")
"""The per-entry table's rows (``routes._Moves.of``): the payload's, the source tensor's
(``routes.Routes.source_columns``), the payload's again."""
(FIRST_BLOCK, INDEX_AT, INDEX_SIZE, ITEMSIZE, NUMEL, FIRST, COUNT, LOOKUP_AT, LOOKUP_DIM, MIDDLE,
 INNER, ELEMENTS) = rows_of(ENTRY_COLUMNS, "first_block", "index_at", "index_size", "itemsize",
                           "numel", "first", "count", "lookup_at", "lookup_dim", "middle",
                           "inner", "elements")
# columns of the per-transfer table (then per dimension its weight, low and high bound)
TENSOR, SHIFT, AFFINE = (tl.constexpr(c) for c in range(3))
DIMS = tl.constexpr(3)
"""Source dimensions a route reads (shapes right-aligned to three)."""
BLOCKS = ENTRY_COLUMNS.index("blocks")  # host-only
# the flags ``_route`` counts
OUT_OF_RANGE, TWICE = (tl.constexpr(c) for c in range(2))


@triton.jit
def _entry(entries, c, segments, seg):
    return column(entries, c, segments, seg)


@triton.jit
def _coordinates(entries, segments, seg, index, NARROW: tl.constexpr):
    """The element's coordinates in its source shape, contiguous and right-aligned to three
    dimensions: two divisions, where a stride and a size per dimension took six (32-bit,
    and int32 results, where every source tensor has fewer than 2**31 elements). Only
    an index inside its tensor gets its coordinates; the callers mask the others."""
    middle = _entry(entries, MIDDLE, segments, seg)
    inner = _entry(entries, INNER, segments, seg)
    if NARROW:
        index, middle, inner = index.to(tl.int32), middle.to(tl.int32), inner.to(tl.int32)
    rows = index // inner
    outer = rows // middle
    return outer, rows - outer * middle, index - rows * inner


@triton.jit
def _affine_at(table, transfers, row, c0, c1, c2, mask):
    """The target flat index of coordinates ``c`` through transfer ``row`` (one per element,
    or one for the block with a scalar ``mask``)."""
    weights = table + AFFINE * transfers + row
    return (tl.load(table + SHIFT * transfers + row, mask=mask, other=0)
            + c0 * tl.load(weights, mask=mask, other=0)
            + c1 * tl.load(weights + 3 * transfers, mask=mask, other=0)
            + c2 * tl.load(weights + 6 * transfers, mask=mask, other=0))


@triton.jit
def _inside(table, transfers, box, d: tl.constexpr, coord):
    """Whether ``coord`` lies in dimension ``d`` of transfer ``box``'s source box."""
    base = table + (AFFINE + 3 * d) * transfers + box
    return (coord >= tl.load(base + transfers)) & (coord < tl.load(base + 2 * transfers))


@triton.jit
def _entry_block(entries, block_seg, segments, BLOCK: tl.constexpr):
    """``owned_block``'s entry, the ranks, the block's flat positions, and which of them
    hold an element."""
    block, seg, rank = owned_block(entries, block_seg, segments, FIRST_BLOCK, BLOCK)
    k = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return seg, rank, k, rank < _entry(entries, ELEMENTS, segments, seg)


@triton.jit(do_not_specialize=["segments", "transfers"])
def _route(entries, block_seg, segments, table, transfers, lookup, tensors, values_at,
           address_out, flags, NARROW: tl.constexpr, BLOCK: tl.constexpr):
    # the entry's numbers are the block's scalars: per-element copies of them took loads,
    # registers and occupancy (this kernel's time)
    seg, rank, k, valid = _entry_block(entries, block_seg, segments, BLOCK)
    index = load_uniform(_entry(entries, INDEX_AT, segments, seg), rank,
                         _entry(entries, INDEX_SIZE, segments, seg), valid)
    held = valid & (index >= 0) & (index < _entry(entries, NUMEL, segments, seg))
    # the coordinates once; the transfers then compare and add
    c0, c1, c2 = _coordinates(entries, segments, seg, index, NARROW)
    lookup_at = _entry(entries, LOOKUP_AT, segments, seg)
    target = tl.full([BLOCK], -1, tl.int32)
    flat = tl.zeros([BLOCK], tl.int64)
    hits = tl.zeros([BLOCK], tl.int32)
    if lookup_at >= 0:
        # its element reads its transfer's row
        split = _entry(entries, LOOKUP_DIM, segments, seg)
        coord = tl.where(split == 0, c0, tl.where(split == 1, c1, c2))
        found = tl.load(lookup + lookup_at + coord, mask=held, other=-1).to(tl.int64)
        hit = held & (found >= 0)
        row = tl.maximum(found, 0)
        target = tl.where(hit, tl.load(table + TENSOR * transfers + row, mask=hit,
                                       other=0).to(tl.int32), -1)
        flat = tl.where(hit, _affine_at(table, transfers, row, c0, c1, c2, hit), 0)
        hits = hit.to(tl.int32)
    else:
        # every box of the entry, each the same for the whole block
        first = _entry(entries, FIRST, segments, seg)
        for t in range(_entry(entries, COUNT, segments, seg)):
            box = first + t
            inside = (held & _inside(table, transfers, box, 0, c0)
                      & _inside(table, transfers, box, 1, c1)
                      & _inside(table, transfers, box, 2, c2))
            hits += inside.to(tl.int32)
            target = tl.where(inside, tl.load(table + TENSOR * transfers + box).to(tl.int32),
                              target)
            flat = tl.where(inside, _affine_at(table, transfers, box, c0, c1, c2, box >= 0), flat)
    # one address per element, where a tensor number and a flat index took 12 bytes and a
    # second dependent load in each later pass
    size = _entry(entries, ITEMSIZE, segments, seg)
    routed = target >= 0
    address = tl.where(routed, tl.load(tensors + tl.maximum(target, 0), mask=routed, other=0)
                       + flat * size, 0)
    tl.store(address_out + k, address, mask=valid)
    # the values there now, while the routes are in registers: the base of the residues
    # and the write's undo log
    store_uniform(tl.load(values_at + seg), rank, load_uniform(address, rank * 0, size, routed),
                  size, valid)
    # one atomic per flagged element (none in a sound payload), not two block-wide sums
    tl.atomic_add(flags + OUT_OF_RANGE + rank * 0, 1, mask=valid & ~held, sem="relaxed")
    tl.atomic_add(flags + TWICE + rank * 0, 1, mask=hits > 1, sem="relaxed")


@triton.jit(do_not_specialize=["segments"])
def _move(entries, block_seg, segments, values_at, address_of, BLOCK: tl.constexpr):
    seg, rank, k, valid = _entry_block(entries, block_seg, segments, BLOCK)
    size = _entry(entries, ITEMSIZE, segments, seg)
    address = tl.load(address_of + k, mask=valid, other=0)
    routed = valid & (address != 0)
    store_uniform(address, rank * 0, load_uniform(tl.load(values_at + seg), rank, size, routed),
                  size, routed)


def route(entries, block_seg, segments: int, table, lookup, tensors, values_at, address_out,
          flags, *, narrow: bool) -> None:
    """Launch ``_route`` over the blocks of ``block_seg`` (``segments`` entries): each
    element's target address into ``address_out``, the values there into the buffers at
    ``values_at`` (per entry)."""
    _route[(block_seg.numel(),)](entries, block_seg, segments, table, table.shape[1], lookup,
                                 tensors, values_at, address_out, flags, NARROW=narrow,
                                 BLOCK=BLOCK, num_warps=WARPS)


def move(entries, block_seg, segments: int, values_at, address_of) -> None:
    """Launch ``_move`` over the blocks of ``block_seg`` (``segments`` entries): the values
    at ``values_at`` (per entry) written at the addresses ``address_of``."""
    _move[(block_seg.numel(),)](entries, block_seg, segments, values_at, address_of,
                                BLOCK=BLOCK, num_warps=WARPS)
