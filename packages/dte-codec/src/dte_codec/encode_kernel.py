"""The batched delta encoder's device work as three Triton kernels (``flat_encode``).

The same statistics and body words as the torch ops of ``flat_encode.TorchFlat``, with no
per-element temporaries: every kernel reads each changed element's index, previous index,
new value and bounds straight from the change sets and tensors (their addresses in one
table), and recomputes what it needs.

1. ``_stats``: per tensor, gaps over a byte, invalid indices and the histogram of residue
   widths, added per block with a handful of atomic adds (host sync 1 of the encoder).
2. ``_escape_counts``: per block, how many GAP8 gaps and how many residues it escapes,
   once the host has chosen the encodings; a prefix sum over the blocks then gives every
   escape its rank without a pass over the elements.
3. ``_write``: every field of every winning encoding, added into the zeroed body words
   (``kernel_bits.put_fields``), five field streams per element; each element also
   recomputes the next one's positions, to know where its word's run ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .dispatch import on_device
from .fields import host_table
from .header import RESIDUE_DTYPES, Header, IndexEncoding, ValueEncoding
from .kernel_bits import (bit_length, block_positions, column, flags_before, load_int,
                          order_key, put_fields, segment_of, width_mask)

if TYPE_CHECKING:
    from .flat_encode import Layout

BLOCK = 1024
HIST_BINS = 64
"""Histogram bins per tensor; a residue needs at most 33 bits."""
_INT64 = torch.int64

# columns of the items table (one row per column, one entry per tensor)
_START = tl.constexpr(0)
_NUMEL = tl.constexpr(1)
_BITS = tl.constexpr(2)
_RESIDUE = tl.constexpr(3)
_INDEX_AT = tl.constexpr(4)
_INDEX_SIZE = tl.constexpr(5)
_VALUE_AT = tl.constexpr(6)
_SIZE = tl.constexpr(7)
_LOW_AT = tl.constexpr(8)
_HIGH_AT = tl.constexpr(9)
# columns of the layout table: flat_encode.Layout.COLUMNS, then per tensor the escapes
# (GAP8 gaps, residues) of the tensors before it
_ENC = tl.constexpr(0)
_FIRST = tl.constexpr(1)
_STRIDE = tl.constexpr(2)
_WIDTH = tl.constexpr(3)
_SECOND = tl.constexpr(4)
_ESCAPE_BITS = tl.constexpr(5)
_LOW_WIDTH = tl.constexpr(6)
_VENC = tl.constexpr(7)
_VWIDTH = tl.constexpr(8)
_FIELDS = tl.constexpr(9)
_POSITIONS = tl.constexpr(10)
_POSITION_BITS = tl.constexpr(11)
_RAW = tl.constexpr(12)
_GAP_BASE = tl.constexpr(13)
_VALUE_BASE = tl.constexpr(14)
_E_GAP8 = tl.constexpr(IndexEncoding.GAP8.value)
_E_BITMAP = tl.constexpr(IndexEncoding.BITMAP.value)
_E_ELIAS_FANO = tl.constexpr(IndexEncoding.ELIAS_FANO.value)
_V_RAW = tl.constexpr(ValueEncoding.RAW.value)
_V_RESIDUE = tl.constexpr(ValueEncoding.RESIDUE.value)


@triton.jit
def _element(items, segments, k, valid, LOG: tl.constexpr):
    """Per flat position: segment, rank, index, gap, the value's bit pattern, its order
    key and the residue width it needs (0 for dtypes without residues)."""
    seg = segment_of(items, segments, k, LOG)
    rank = k - column(items, _START, segments, seg)
    numel = column(items, _NUMEL, segments, seg)
    bits = column(items, _BITS, segments, seg)
    at, size = column(items, _INDEX_AT, segments, seg), column(items, _INDEX_SIZE, segments, seg)
    idx = load_int(at, rank, size, valid)
    prev = tl.where(rank > 0, load_int(at, rank - 1, size, valid & (rank > 0)), -1)
    # clamped: an invalid index is reported by the statistics, never read out of bounds
    safe = tl.minimum(tl.maximum(idx, 0), numel - 1)
    size = column(items, _SIZE, segments, seg)
    mask = width_mask(bits)
    pattern = load_int(column(items, _VALUE_AT, segments, seg), safe, size, valid) & mask
    low = load_int(column(items, _LOW_AT, segments, seg), rank, size, valid) & mask
    high = load_int(column(items, _HIGH_AT, segments, seg), rank, size, valid) & mask
    residue = column(items, _RESIDUE, segments, seg) != 0
    key_bits = tl.where(residue, bits, 16)
    key = order_key(pattern, key_bits)
    above = key - order_key(low, key_bits) + 1
    below = order_key(high, key_bits) - key
    span = tl.maximum(tl.maximum(above, below), 1)
    need = tl.where(residue, 1 + bit_length(span - 1), 0)
    gap = idx - prev
    return seg, rank, idx, numel, gap, bits, pattern, key, need


@triton.jit(do_not_specialize=["segments", "total"])
def _stats(items, segments, total, out, LOG: tl.constexpr, BLOCK: tl.constexpr,
           BINS: tl.constexpr):
    _, k, valid = block_positions(total, BLOCK)
    seg, _, idx, numel, gap, _, _, _, need = _element(items, segments, k, valid, LOG)
    wide = valid & (gap > 255)
    bad = valid & ((idx < 0) | (idx >= numel) | (gap <= 0))
    bins = tl.arange(0, BINS)
    for s in range(tl.min(tl.where(valid, seg, segments)), tl.max(tl.where(valid, seg, 0)) + 1):
        here = seg == s
        row = out + s * (2 + BINS)
        wides = tl.sum((here & wide).to(tl.int64))
        bads = tl.sum((here & bad).to(tl.int64))
        tl.atomic_add(row, wides, mask=wides > 0)
        tl.atomic_add(row + 1, bads, mask=bads > 0)
        hist = tl.histogram(tl.where(valid & here, need, BINS - 1).to(tl.int32), BINS)
        tl.atomic_add(row + 2 + bins, hist.to(tl.int64), mask=(hist > 0) & (bins < BINS - 1))


@triton.jit
def _escapes(items, layout, segments, k, valid, LOG: tl.constexpr):
    seg, rank, idx, _, gap, bits, pattern, key, need = _element(items, segments, k, valid, LOG)
    enc = column(layout, _ENC, segments, seg)
    venc = column(layout, _VENC, segments, seg)
    vwidth = column(layout, _VWIDTH, segments, seg)
    gap_escaped = valid & (enc == _E_GAP8) & (gap > 255)
    value_escaped = valid & (venc == _V_RESIDUE) & (need > vwidth)
    return (seg, rank, idx, gap, bits, pattern, key, enc, venc, vwidth, gap_escaped,
            value_escaped)


@triton.jit(do_not_specialize=["segments", "total", "blocks"])
def _escape_counts(items, layout, segments, total, counts, blocks, LOG: tl.constexpr,
                   BLOCK: tl.constexpr):
    block, k, valid = block_positions(total, BLOCK)
    out = _escapes(items, layout, segments, k, valid, LOG)
    tl.store(counts + block, tl.sum(out[10].to(tl.int64)))
    tl.store(counts + blocks + block, tl.sum(out[11].to(tl.int64)))


@triton.jit
def _fields(layout, segments, element, gap_before, value_before):
    """An element's five fields (bit position, value, width), one per field stream; an
    element with nothing in a stream gives width 0 at the stream's next position."""
    (seg, rank, idx, gap, bits, pattern, key, enc, venc, vwidth, gap_escaped,
     value_escaped) = element
    gap_before -= column(layout, _GAP_BASE, segments, seg)
    value_before -= column(layout, _VALUE_BASE, segments, seg)
    is_gap = enc == _E_GAP8
    is_bitmap = enc == _E_BITMAP
    is_ef = enc == _E_ELIAS_FANO
    # first index section: raw index, gap byte, Elias-Fano low bits or bitmap bit
    pos1 = column(layout, _FIRST, segments, seg) + tl.where(
        is_bitmap, idx, rank * column(layout, _STRIDE, segments, seg))
    value1 = tl.where(is_gap, tl.where(gap > 255, 0, gap), tl.where(is_bitmap, 1, idx))
    width1 = column(layout, _WIDTH, segments, seg)
    # second index section: escaped gaps, or the Elias-Fano upper bits
    second = column(layout, _SECOND, segments, seg)
    escape_bits = column(layout, _ESCAPE_BITS, segments, seg)
    low_width = column(layout, _LOW_WIDTH, segments, seg)
    pos2 = tl.where(is_gap, second + gap_before * escape_bits,
                    tl.where(is_ef, second + (idx >> low_width) + rank, second))
    width2 = tl.where(gap_escaped, escape_bits, is_ef.to(tl.int64))
    # residue fields of the values not escaped, then escape positions
    pos3 = column(layout, _FIELDS, segments, seg) + (rank - value_before) * vwidth
    width3 = tl.where(value_escaped, 0, vwidth)
    position_bits = column(layout, _POSITION_BITS, segments, seg)
    pos4 = column(layout, _POSITIONS, segments, seg) + value_before * position_bits
    width4 = tl.where(value_escaped, position_bits, 0)
    # raw values: every value of a RAW entry, the escaped ones of a RESIDUE entry
    residue = venc == _V_RESIDUE
    item_bits = tl.where(venc >= 0, bits, 0)
    pos5 = column(layout, _RAW, segments, seg) + tl.where(residue, value_before, rank) * item_bits
    width5 = tl.where((venc == _V_RAW) | value_escaped, item_bits, 0)
    return (pos1, value1, width1, pos2, tl.where(is_gap, gap, 1), width2, pos3, key, width3,
            pos4, rank, width4, pos5, pattern, width5)


@triton.jit(do_not_specialize=["segments", "total", "blocks"])
def _write(items, layout, segments, total, before, blocks, words, LOG: tl.constexpr,
           BLOCK: tl.constexpr):
    block, k, valid = block_positions(total, BLOCK)
    # the next element, in this block, tells each element whether its word's run ends
    has_next = (k + 1 < total) & (tl.arange(0, BLOCK) < BLOCK - 1)
    here = _escapes(items, layout, segments, k, valid, LOG)
    there = _escapes(items, layout, segments, k + 1, has_next, LOG)
    gaps = flags_before(before, block, here[10])
    values = flags_before(before + blocks, block, here[11])
    a = _fields(layout, segments, here, gaps, values)
    b = _fields(layout, segments, there, gaps + here[10].to(tl.int64),
                values + here[11].to(tl.int64))
    put_fields(words, a[0], a[1], a[2], valid, b[0], has_next)
    put_fields(words, a[3], a[4], a[5], valid, b[3], has_next)
    put_fields(words, a[6], a[7], a[8], valid, b[6], has_next)
    put_fields(words, a[9], a[10], a[11], valid, b[9], has_next)
    put_fields(words, a[12], a[13], a[14], valid, b[12], has_next)


class FusedFlat:
    """``flat_encode.TorchFlat``'s interface over the kernels above."""

    def __init__(self, tensors: Sequence[torch.Tensor], changes: Sequence, device: torch.device):
        counts = [c.indices.numel() for c in changes]
        self.total, self.segments, self.device = sum(counts), len(counts), device
        self.log = max(self.segments - 1, 0).bit_length()
        # kept alive until the kernels that read them through their addresses are queued
        self._keep = [(t.detach().reshape(-1).contiguous(), _indices(c, device),
                       c.base_low.to(device).contiguous(), c.base_high.to(device).contiguous())
                      for t, c in zip(tensors, changes)]
        starts, at = [], 0
        for count in counts:
            starts.append(at)
            at += count
        rows = [starts, [t.numel() for t, *_ in self._keep],
                [t.element_size() * 8 for t, *_ in self._keep],
                [int(t.dtype in RESIDUE_DTYPES) for t, *_ in self._keep],
                [i.data_ptr() for _, i, _, _ in self._keep],
                [i.element_size() for _, i, _, _ in self._keep],
                [t.data_ptr() for t, *_ in self._keep],
                [t.element_size() for t, *_ in self._keep],
                [lo.data_ptr() for *_, lo, _ in self._keep],
                [hi.data_ptr() for *_, hi in self._keep]]
        self.items = host_table(rows, device)
        self.blocks = triton.cdiv(self.total, BLOCK)

    def stats(self, bins: int) -> torch.Tensor:
        """On the host, per tensor: gaps over a byte, invalid indices, and the histogram
        of the residue widths ``0..bins-1`` that values need (``TorchFlat.stats``)."""
        out = torch.zeros(self.segments, 2 + HIST_BINS, dtype=_INT64, device=self.device)
        if self.blocks:
            with on_device(self.device):
                _stats[(self.blocks,)](self.items, self.segments, self.total, out,
                                       LOG=self.log, BLOCK=BLOCK, BINS=HIST_BINS)
        return torch.cat([out[:, 0], out[:, 1], out[:, 2:2 + bins].reshape(-1)]).cpu()

    def write(self, header: Header, layout: Layout) -> torch.Tensor:
        """The body of ``header`` as uint8 on the device, dense entries left zero."""
        entries = header.entries
        gap_base, value_base, gaps, values = [], [], 0, 0
        for entry in entries:
            gap_base.append(gaps)
            value_base.append(values)
            gaps += entry.index_escapes
            values += entry.value_escapes
        table = torch.cat([layout.table, host_table([gap_base, value_base], self.device)])
        words = torch.zeros(header.body_size() // 8, dtype=_INT64, device=self.device)
        if not self.blocks:
            return words.view(torch.uint8)
        counts = torch.empty(2, self.blocks, dtype=_INT64, device=self.device)
        grid = (self.blocks,)
        with on_device(self.device):
            _escape_counts[grid](self.items, table, self.segments, self.total, counts,
                                 self.blocks, LOG=self.log, BLOCK=BLOCK)
            before = torch.cumsum(counts, 1) - counts
            _write[grid](self.items, table, self.segments, self.total, before, self.blocks,
                         words, LOG=self.log, BLOCK=BLOCK)
        return words.view(torch.uint8)


def _indices(change, device: torch.device) -> torch.Tensor:
    indices = change.indices.reshape(-1).to(device)
    if indices.dtype not in (torch.int32, torch.int64):
        indices = indices.to(_INT64)
    return indices.contiguous()

