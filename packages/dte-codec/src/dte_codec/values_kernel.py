"""``flat_values.resolve_residues`` as three Triton launches over every residue entry.

Entry ``e`` owns the flat positions ``start[e] ..`` of its carried values; its sections
and base values are reached through their addresses. ``_escaped`` walks the escape lists
(their own flat space): it marks each escaped element and writes its raw value.
``_resolve`` walks the elements: an element's residue field is number ``rank - before``
of its entry, ``before`` being the escapes ahead of it in the entry, which a per-block
count of the marks and its prefix sum give without another pass. The new values go to
one byte buffer, entry by entry, each entry at an 8-byte boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .dispatch import on_device
from .fields import host_table
from .header import Entry, index_itemsize
from .kernel_bits import (block_positions, column, flags_before, from_order_key, get_fields,
                          load_int, order_key, segment_of, store_int, width_mask)

BLOCK = 1024
_INT64 = torch.int64
_START = tl.constexpr(0)
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


@triton.jit(do_not_specialize=["segments", "escapes"])
def _escaped(table, segments, escapes, marks, LOG: tl.constexpr, BLOCK: tl.constexpr):
    _, j, valid = block_positions(escapes, BLOCK)
    # segments by their escape lists: column _ESCAPE_START holds each list's flat start
    seg = segment_of(table + _ESCAPE_START * segments, segments, j, LOG)
    rank = j - column(table, _ESCAPE_START, segments, seg)
    count = column(table, _START, segments, seg + 1) - column(table, _START, segments, seg)
    position = load_int(column(table, _POSITIONS_AT, segments, seg), rank,
                        column(table, _POSITION_SIZE, segments, seg), valid)
    # decode validated the positions; clamping keeps a forged payload off device faults
    position = tl.minimum(tl.maximum(position, 0), count - 1)
    tl.store(marks + column(table, _START, segments, seg) + position, 1, mask=valid)
    size = column(table, _SIZE, segments, seg)
    raw = load_int(column(table, _RAW_AT, segments, seg), rank, size, valid)
    store_int(column(table, _OUT_AT, segments, seg), position, raw, size, valid)


@triton.jit(do_not_specialize=["segments", "total"])
def _resolve(table, segments, total, marks, before, failures, LOG: tl.constexpr,
             BLOCK: tl.constexpr):
    block, k, valid = block_positions(total, BLOCK)
    seg = segment_of(table, segments, k, LOG)
    rank = k - column(table, _START, segments, seg)
    escaped = tl.load(marks + k, mask=valid, other=0).to(tl.int64)
    ahead = flags_before(before, block, escaped) - column(table, _ESCAPE_START, segments, seg)
    width = column(table, _WIDTH, segments, seg)
    size = column(table, _SIZE, segments, seg)
    bits = size * 8
    sent = valid & (escaped == 0)
    fields = column(table, _FIELDS_AT, segments, seg).to(tl.pointer_type(tl.int64))
    residue = get_fields(fields, (rank - ahead) * width, tl.where(sent, width, 0),
                         column(table, _FIELDS_LAST, segments, seg))
    base = load_int(column(table, _BASE_AT, segments, seg), rank, size, sent) & width_mask(bits)
    base_key = order_key(base, bits)
    diff = (residue - base_key) & width_mask(width)
    half = (width * 0 + 1) << (width - 1)
    key = base_key + tl.where(diff >= half, diff - 2 * half, diff)
    wrong = sent & ((key < 0) | (key > width_mask(bits)))
    tl.store(failures + block, tl.sum(wrong.to(tl.int64)))
    new = from_order_key(key & width_mask(bits), bits)
    store_int(column(table, _OUT_AT, segments, seg), rank, new, size, sent)


def resolve(entries: Sequence[Entry], sections: Sequence[tuple[torch.Tensor, ...]],
            bases: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``flat_values.resolve_residues`` on the kernels; sections 8-byte aligned, on the
    bases' device."""
    with on_device(bases[0].device):
        return _resolve_all(entries, sections, bases)


def _resolve_all(entries: Sequence[Entry], sections: Sequence[tuple[torch.Tensor, ...]],
                 bases: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    device = bases[0].device
    starts, offsets, escape_starts, at, nbytes, escapes = [], [], [], 0, 0, 0
    for entry in entries:
        starts.append(at)
        offsets.append(nbytes)
        escape_starts.append(escapes)
        at += entry.count
        nbytes += -(-entry.count * entry.itemsize // 8) * 8
        escapes += entry.value_escapes
    total = at
    out = torch.empty(max(nbytes, 8), dtype=torch.uint8, device=device)
    fields, positions, raw = ([s[k] for s in sections] for k in range(3))
    bases = [b.contiguous() for b in bases]
    table = host_table([
        starts + [total], escape_starts + [escapes],
        [f.data_ptr() for f in fields] + [0], [max(-(-f.numel() // 8) - 1, 0) for f in fields] + [0],
        [e.value_width for e in entries] + [1], [p.data_ptr() for p in positions] + [0],
        [index_itemsize(e.count) for e in entries] + [4], [r.data_ptr() for r in raw] + [0],
        [e.itemsize for e in entries] + [2], [b.data_ptr() for b in bases] + [0],
        [out.data_ptr() + o for o in offsets] + [0]], device)
    # one spare segment past the last marks where the last entry ends
    segments, log = len(entries), len(entries).bit_length()
    blocks = triton.cdiv(total, BLOCK)
    marks = torch.zeros(blocks * BLOCK, dtype=torch.uint8, device=device)
    if escapes:
        _escaped[(triton.cdiv(escapes, BLOCK),)](table, segments + 1, escapes, marks, LOG=log,
                                                BLOCK=BLOCK)
    counts_per_block = marks.view(blocks, BLOCK).sum(1, dtype=_INT64)
    before = torch.cumsum(counts_per_block, 0) - counts_per_block
    failures = torch.zeros(blocks, dtype=_INT64, device=device)
    _resolve[(blocks,)](table, segments + 1, total, marks, before, failures, LOG=log,
                        BLOCK=BLOCK)
    views = [out[o:o + e.count * e.itemsize].view(e.dtype) for e, o in zip(entries, offsets)]
    return views, failures.sum()
