"""``flat_values.resolve_residues`` as three Triton launches over every residue entry.

Entry ``e``'s carried values take whole blocks from block ``first_block[e]`` on, and its
escape list whole blocks of a second block space, so a program reads its entry from a
block -> entry table (``fields.block_segments``: one load, no search, no compile-time
entry count). Its sections and base values are reached through their addresses.
``_escaped`` walks the escape lists: it marks each escaped element and writes its raw
value. ``_resolve`` walks the elements: an element's residue field is number
``rank - before`` of its entry, ``before`` being the escapes ahead of it in the entry,
which a per-block count of the marks and its prefix sum give without another pass (the
marks of the padding past an entry's last element stay zero); a block without escapes
reads no marks. The new values go to one byte buffer, entry by entry, each entry at an
8-byte boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .dispatch import on_device
from .encodings import align, index_itemsizes
from .entry import Entry
from .fields import block_segments, host_table, starts_of
from .flat_values import Residues, Resolved
from .kernel_bits import (column, from_order_key, get_fields, load_uniform,
                          order_key, owned_block, store_uniform, width_mask)

BLOCK = 1024
WARPS = 4
_INT64 = torch.int64
_FIRST_BLOCK = tl.constexpr(0)
_ESCAPE_START = tl.constexpr(1)
_FIELDS_AT = tl.constexpr(2)
_FIELDS_LAST = tl.constexpr(3)
_WIDTH = tl.constexpr(4)
_POSITIONS_AT = tl.constexpr(5)
_POSITION_SIZE = tl.constexpr(6)
_RAW_AT = tl.constexpr(7)
_SIZE = tl.constexpr(8)
_BASE_AT = tl.constexpr(9)
_OUT_AT = tl.constexpr(10)
_COUNT = tl.constexpr(11)
_ESCAPES = tl.constexpr(12)
_ESCAPE_FIRST_BLOCK = tl.constexpr(13)
# host-only: each entry's blocks in the two block spaces
_BLOCKS = 14
_ESCAPE_BLOCKS = 15


@triton.jit
def _entry_block(table, block_seg, segments, FIRST: tl.constexpr, COUNT: tl.constexpr,
                 BLOCK: tl.constexpr):
    """``owned_block``, and which of the block's items exist (column ``COUNT``)."""
    block, seg, rank = owned_block(table, block_seg, segments, FIRST, BLOCK)
    return block, seg, rank, rank < column(table, COUNT, segments, seg)


@triton.jit(do_not_specialize=["segments"])
def _escaped(table, block_seg, segments, marks, counts, BLOCK: tl.constexpr):
    _, seg, rank, valid = _entry_block(table, block_seg, segments, _ESCAPE_FIRST_BLOCK,
                                       _ESCAPES, BLOCK)
    count = column(table, _COUNT, segments, seg)
    position = load_uniform(column(table, _POSITIONS_AT, segments, seg), rank,
                            column(table, _POSITION_SIZE, segments, seg), valid)
    # decode validated the positions; clamping keeps a forged payload off device faults
    position = tl.minimum(tl.maximum(position, 0), count - 1)
    at = column(table, _FIRST_BLOCK, segments, seg) * BLOCK + position
    tl.store(marks + at, 1, mask=valid)
    # per block of marks its count, where summing the marks afterwards reads them all (as
    # int64: 8 bytes per element); positions strictly increase (decode checks them, and a
    # payload that fails that check is refused whatever was resolved)
    tl.atomic_add(counts + at // BLOCK, 1, mask=valid, sem="relaxed")
    size = column(table, _SIZE, segments, seg)
    raw = load_uniform(column(table, _RAW_AT, segments, seg), rank, size, valid)
    store_uniform(column(table, _OUT_AT, segments, seg), position, raw, size, valid)


@triton.jit(do_not_specialize=["segments"], do_not_specialize_on_alignment=["failures"])
def _resolve(table, block_seg, segments, marks, inclusive, counts, failures,
             BLOCK: tl.constexpr):
    block, seg, rank, valid = _entry_block(table, block_seg, segments, _FIRST_BLOCK, _COUNT,
                                           BLOCK)
    count = tl.load(counts + block)
    ahead = tl.zeros([BLOCK], tl.int64) + (tl.load(inclusive + block) - count
                                           - column(table, _ESCAPE_START, segments, seg))
    escaped = tl.zeros([BLOCK], tl.int32)
    if count > 0:
        # the ranks take a scan across the block's warps: only blocks with escapes pay it
        k = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        escaped = tl.load(marks + k, mask=valid, other=0).to(tl.int32)
        ahead += (tl.cumsum(escaped, 0) - escaped).to(tl.int64)
    width = column(table, _WIDTH, segments, seg)
    size = column(table, _SIZE, segments, seg)
    bits = size * 8
    sent = valid & (escaped == 0)
    fields = column(table, _FIELDS_AT, segments, seg).to(tl.pointer_type(tl.int64))
    residue = get_fields(fields, (rank - ahead) * width, tl.where(sent, width, 0),
                         column(table, _FIELDS_LAST, segments, seg))
    base = load_uniform(column(table, _BASE_AT, segments, seg), rank, size, sent) & width_mask(bits)
    base_key = order_key(base, bits)
    diff = (residue - base_key) & width_mask(width)
    half = (width * 0 + 1) << (width - 1)
    key = base_key + tl.where(diff >= half, diff - 2 * half, diff)
    wrong = sent & ((key < 0) | (key > width_mask(bits)))
    # one atomic per wrong element (none in a sound payload), not a block-wide sum
    tl.atomic_add(failures + rank * 0, 1, mask=wrong, sem="relaxed")
    new = from_order_key(key & width_mask(bits), bits)
    store_uniform(column(table, _OUT_AT, segments, seg), rank, new, size, sent)


def resolve(entries: Sequence[Entry], sections: Sequence[tuple[torch.Tensor, ...]],
            bases: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``flat_values.resolve_residues`` on the kernels; sections 8-byte aligned, on the
    bases' device."""
    bases = [b.contiguous() for b in bases]
    resolved = resolve_columns(Residues.of(entries, sections, bases), bases[0].device)
    return resolved.views(entries), resolved.failures


def resolve_columns(residues: Residues, device: torch.device) -> Resolved:
    """The new values of ``residues`` (sections and bases on ``device``)."""
    with on_device(device):
        return _resolve_all(residues, device)


def _resolve_all(r: Residues, device: torch.device) -> Resolved:
    blocks, escape_blocks = -(-r.count // BLOCK), -(-r.escapes // BLOCK)
    sizes = align(r.count * r.itemsize)
    offsets = starts_of(sizes)
    nbytes, total_blocks, total_escape_blocks = (int(x.sum()) for x in
                                                 (sizes, blocks, escape_blocks))
    out = torch.empty(max(nbytes, 8), dtype=torch.uint8, device=device)
    table = host_table(np.stack([
        starts_of(blocks), starts_of(r.escapes), r.fields_at,
        np.maximum(-(-r.fields_bytes // 8) - 1, 0), r.width, r.positions_at,
        index_itemsizes(r.count), r.raw_at, r.itemsize, r.base_at,
        out.data_ptr() + offsets, r.count, r.escapes, starts_of(escape_blocks), blocks,
        escape_blocks]), device)
    segments = r.count.size
    marks = torch.zeros(total_blocks * BLOCK, dtype=torch.uint8, device=device)
    # per block its escapes, then the count of failures: one zeroed buffer (so the count's
    # alignment varies: ``_resolve`` does not specialise on it)
    zeroed = torch.zeros(total_blocks + 1, dtype=_INT64, device=device)
    counts_per_block, failures = zeroed[:total_blocks], zeroed[total_blocks]
    if total_escape_blocks:
        _escaped[(total_escape_blocks,)](
            table, block_segments(table[_ESCAPE_BLOCKS], total_escape_blocks), segments, marks,
            counts_per_block, BLOCK=BLOCK, num_warps=WARPS)
    _resolve[(total_blocks,)](table, block_segments(table[_BLOCKS], total_blocks), segments,
                              marks, torch.cumsum(counts_per_block, 0), counts_per_block,
                              failures, BLOCK=BLOCK, num_warps=WARPS)
    return Resolved(out, offsets, failures)
