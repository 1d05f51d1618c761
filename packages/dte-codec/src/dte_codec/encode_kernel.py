"""The batched delta encoder's device work as three Triton kernels (``flat_encode``).

The same statistics and body words as the torch ops of ``flat_encode.TorchFlat``. The
flat space is laid out in blocks of ``BLOCK`` elements that each lie inside one tensor
(a tensor's last block is padded), so a program finds its tensor with one load from a
block -> tensor table and reads every per-tensor number once, as a scalar: no binary
search, no per-element table reads, and no compile-time constant that depends on the
number of tensors (a sync whose tensor count crosses a power of two recompiles
nothing). Change sets and tensors are read in place through their addresses.

1. ``_stats``: per tensor, gaps over a byte, invalid indices and the histogram of residue
   widths, added per block with a handful of atomic adds (host sync 1 of the encoder);
   per element one code byte (the residue width it needs, whether its gap is over a
   byte), so the later kernels read one byte instead of the bounds.
2. ``_escape_counts``: per block, how many GAP8 gaps and how many residues it escapes,
   from the code bytes, once the host has chosen the encodings; a prefix sum over the
   blocks then gives every escape its rank without a pass over the elements.
3. ``_write``: every field of every winning encoding, added into the zeroed body words
   (``kernel_bits.put_fields``), or, for streams of consecutive fields whose width
   divides 64 (raw values, raw indices, gap bytes, Elias-Fano low bits of 1, 2, 4, ...
   bits), stored a word at a time (``kernel_bits.put_packed``). Streams a tensor's
   encodings leave empty, and escape streams of blocks without escapes, are skipped; an
   element's neighbour positions follow from its own (and the next index), never from
   recomputing the neighbour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

from .change_table import ChangeTable
from .dispatch import on_device
from .encode_plan import Choice, Escapes, Layout
from .encodings import BITMAP, ELIAS_FANO, GAP8, RESIDUE
from .fields import block_segments, host_table
from .kernel_bits import (bit_length, column, load_uniform, order_key, owned_block, packs,
                          put_fields, put_packed, rows_of, store_uniform, width_mask)

if TYPE_CHECKING:
    from .tensor_set import TensorSet

BLOCK = 256
WARPS = 4
"""Warps per program: 2 elements per thread (8 per thread made ``_write`` need 255 registers
and spill). Small programs, so that an SM holds several: their block-wide scans and
barriers overlap (one H200, the Qwen3-4B delta of ``tools/gpu/bench_codec_batched.py
--encode-only``: ``_write`` 5.6 ms with 1,024 elements and 16 warps, 4.8 with 512 and 8,
3.3 with 256 and 4, 3.2 with 128 and 2, where ``_stats`` grew; the same bytes)."""
REGISTERS: int | None = 56
"""A cap on ``_write``'s registers per thread (``maxnreg``; None: the compiler's 78): 9
programs per multiprocessor instead of 6 (docs/benchmarks.md: 56, 64 and none measured)."""
HIST_BINS = 64
"""Histogram bins per tensor; a residue needs at most 33 bits."""
_NEED_MASK = tl.constexpr(63)
_WIDE_BIT = tl.constexpr(64)
"""A code byte: the residue width an element needs (< 64), plus this bit for a wide gap."""
_MAX_GAP_BYTE = tl.constexpr(255)
_INT64 = torch.int64


_STATIC = ("numel", "bits", "residue", "value_at", "size")
"""The rows of the items table that only the tensor set decides (``_static``)."""
_ITEMS = ("count", "first_block", "blocks", *ChangeTable.COLUMNS, *_STATIC)
"""The items table (one row per column, one entry per tensor): the sync's counts and
blocks, then where its change sets lie, then what only the tensor set decides."""
(_COUNT, _FIRST_BLOCK, _INDEX_AT, _INDEX_SIZE, _LOW_AT, _HIGH_AT, _NUMEL, _BITS, _RESIDUE,
 _VALUE_AT, _SIZE) = rows_of(_ITEMS, "count", "first_block", "index_at", "index_size", "low_at",
                           "high_at", "numel", "bits", "residue", "value_at", "size")
_BLOCKS = _ITEMS.index("blocks")
(_ENC, _FIRST, _STRIDE, _WIDTH, _SECOND, _ESCAPE_BITS, _LOW_WIDTH, _VENC, _VWIDTH, _FIELDS,
 _POSITIONS, _POSITION_BITS, _RAW) = rows_of(
    Layout.COLUMNS, "index_encoding", "first", "stride", "width", "second", "escape_bits",
    "low_width", "value_encoding", "value_width", "fields", "positions", "position_bits", "raw")
_C_ENC, _C_VENC, _C_VWIDTH = rows_of(Choice.COLUMNS, "index_encoding", "value_encoding",
                                   "value_width")
_E_GAP8, _E_BITMAP, _E_ELIAS_FANO = (tl.constexpr(code) for code in (GAP8, BITMAP, ELIAS_FANO))
_V_RESIDUE = tl.constexpr(RESIDUE)


@triton.jit
def _block(items, block_seg, segments, BLOCK: tl.constexpr):
    """This program's block, its tensor, its elements' ranks in that tensor, which of
    them exist, and the tensor's element count."""
    block, seg, rank = owned_block(items, block_seg, segments, _FIRST_BLOCK, BLOCK)
    count = column(items, _COUNT, segments, seg)
    return block, seg, rank, rank < count, count


@triton.jit
def _index(items, segments, seg, rank, valid):
    return load_uniform(column(items, _INDEX_AT, segments, seg), rank,
                    column(items, _INDEX_SIZE, segments, seg), valid)


@triton.jit
def _pattern(items, segments, seg, idx, valid):
    """The new value's unsigned bit pattern at each (clamped) index; an invalid index is
    reported by the statistics, never read out of bounds."""
    numel = column(items, _NUMEL, segments, seg)
    safe = tl.minimum(tl.maximum(idx, 0), numel - 1)
    mask = width_mask(column(items, _BITS, segments, seg))
    return load_uniform(column(items, _VALUE_AT, segments, seg), safe,
                    column(items, _SIZE, segments, seg), valid) & mask


@triton.jit
def _block_at(block, BLOCK: tl.constexpr):
    """Offsets of a block's elements in the per-element scratch (codes, patterns)."""
    return block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)


@triton.jit(do_not_specialize=["segments", "patterns", "pattern_size", "kept"])
def _stats(items, block_seg, segments, codes, patterns, pattern_size, out, kept,
           BLOCK: tl.constexpr, BINS: tl.constexpr):
    block, seg, rank, valid, _ = _block(items, block_seg, segments, BLOCK)
    idx = _index(items, segments, seg, rank, valid)
    prev = tl.where(rank > 0, _index(items, segments, seg, rank - 1, valid & (rank > 0)), -1)
    gap = idx - prev
    numel = column(items, _NUMEL, segments, seg)
    bits = column(items, _BITS, segments, seg)
    residue = column(items, _RESIDUE, segments, seg) != 0
    pattern = _pattern(items, segments, seg, idx, valid)
    # bounds are read for residue dtypes only; the others need no residue width
    size, mask = column(items, _SIZE, segments, seg), width_mask(bits)
    # tl.where, not &: Triton's interpreter types a scalar flag ANDed with a block of flags
    # as int64, which a mask refuses
    bounded = tl.where(residue, valid, False)
    low = load_uniform(column(items, _LOW_AT, segments, seg), rank, size, bounded) & mask
    high = load_uniform(column(items, _HIGH_AT, segments, seg), rank, size, bounded) & mask
    key_bits = tl.where(residue, bits, 16)  # keys of residue dtypes only are used
    key = order_key(pattern, key_bits)
    span = tl.maximum(tl.maximum(key - order_key(low, key_bits) + 1,
                                 order_key(high, key_bits) - key), 1)
    need = tl.where(bounded, 1 + bit_length(span - 1), 0)
    wide = valid & (gap > _MAX_GAP_BYTE)
    bad = valid & ((idx < 0) | (idx >= numel) | (gap <= 0))
    code = need | tl.where(wide, _WIDE_BIT, 0)
    tl.store(codes + _block_at(block, BLOCK), code.to(tl.uint8))
    # kept for _write: the weights read again at the indices would touch ~40 % of their
    # sectors a second time at a few percent changed (32-byte sectors, 2-byte values)
    store_uniform(patterns, _block_at(block, BLOCK), pattern, pattern_size, valid)
    row = out + seg * (2 + kept)  # kept: the bins the host reads, < BINS - 1 (missing elements)
    wides = tl.sum(wide.to(tl.int64))
    bads = tl.sum(bad.to(tl.int64))
    tl.atomic_add(row, wides, mask=wides > 0, sem="relaxed")
    tl.atomic_add(row + 1, bads, mask=bads > 0, sem="relaxed")
    bins = tl.arange(0, BINS)
    hist = tl.histogram(tl.where(valid, need, BINS - 1).to(tl.int32), BINS)
    tl.atomic_add(row + 2 + bins, hist.to(tl.int64),
                  mask=(hist > 0) & (bins < kept), sem="relaxed")


@triton.jit
def _escaped(enc, venc, vwidth, code, valid):
    """Per element, whether its gap (GAP8) and its value (RESIDUE) go to escape lists,
    from its entry's encodings and residue width."""
    gap = tl.where(enc == _E_GAP8, valid & ((code & _WIDE_BIT) != 0), False)
    value = tl.where(venc == _V_RESIDUE, valid & ((code & _NEED_MASK) > vwidth), False)
    return gap, value


@triton.jit
def _codes(codes, block, BLOCK: tl.constexpr):
    return tl.load(codes + _block_at(block, BLOCK)).to(tl.int64)


@triton.jit(do_not_specialize=["segments", "blocks"])
def _escape_counts(items, choice, block_seg, segments, codes, counts, blocks,
                   BLOCK: tl.constexpr):
    block, seg, _, valid, _ = _block(items, block_seg, segments, BLOCK)
    gap, value = _escaped(column(choice, _C_ENC, segments, seg),
                          column(choice, _C_VENC, segments, seg),
                          column(choice, _C_VWIDTH, segments, seg),
                          _codes(codes, block, BLOCK), valid)
    tl.store(counts + block, tl.sum(gap.to(tl.int64)))
    tl.store(counts + blocks + block, tl.sum(value.to(tl.int64)))


@triton.jit
def _before(inclusive, counts, block, first, flags):
    """Per element, the flags set before it in its tensor: the exclusive prefix over
    blocks (inclusive minus the block's own count) at this block minus the one at the
    tensor's first block, plus those ahead of it here. The prefix may start anywhere
    before the tensor's first block: a constant offset cancels."""
    flags = flags.to(tl.int32)  # a block's count fits: half the scan's shuffles and shared memory
    ahead = (tl.cumsum(flags, 0) - flags).to(tl.int64)
    return (tl.load(inclusive + block) - tl.load(counts + block)
            - tl.load(inclusive + first) + tl.load(counts + first) + ahead)


@triton.jit
def _write_indices(items, layout, segments, seg, words, rank, valid, has_next, idx, code,
                   inclusive, counts, block, first_block, any_escaped, BLOCK: tl.constexpr):
    """The index sections: raw index, gap byte, low bits or bitmap bit; then escaped gaps
    (ranked from ``inclusive``, the prefix of the GAP8 escapes of each block, only in
    blocks that have some: the ranks take a scan across the block's warps) or the
    Elias-Fano upper bits."""
    enc = column(layout, _ENC, segments, seg)
    nxt = _index(items, segments, seg, rank + 1, has_next)
    prev = tl.where(rank > 0, _index(items, segments, seg, rank - 1, valid & (rank > 0)), -1)
    gap = idx - prev
    wide = (code & _WIDE_BIT) != 0
    first = column(layout, _FIRST, segments, seg)
    stride = column(layout, _STRIDE, segments, seg)
    is_bitmap = enc == _E_BITMAP
    pos = first + tl.where(is_bitmap, idx, rank * stride)
    after = first + tl.where(is_bitmap, nxt, (rank + 1) * stride)
    value = tl.where(enc == _E_GAP8, tl.where(wide, 0, gap), tl.where(is_bitmap, 1, idx))
    width = column(layout, _WIDTH, segments, seg)
    # a block starts at a multiple of BLOCK fields and its section on a word
    if (enc != _E_BITMAP) & packs(width):
        put_packed(words, pos, value, width, valid, BLOCK)
    else:
        put_fields(words, pos, value, width, valid, after, has_next)
    second = column(layout, _SECOND, segments, seg)
    if enc == _E_ELIAS_FANO:
        low_width = column(layout, _LOW_WIDTH, segments, seg)
        put_fields(words, second + (idx >> low_width) + rank, idx * 0 + 1, valid.to(tl.int64),
                   valid, second + (nxt >> low_width) + rank + 1, has_next)
    if any_escaped:  # then the entry is GAP8
        bits = column(layout, _ESCAPE_BITS, segments, seg)
        escaped = valid & wide
        gaps = _before(inclusive, counts, block, first_block, escaped)
        put_fields(words, second + gaps * bits, gap, tl.where(escaped, bits, 0), valid,
                   second + (gaps + escaped.to(tl.int64)) * bits, has_next)


@triton.jit
def _write_values(items, layout, segments, seg, words, rank, valid, has_next, pattern, escaped,
                  values, any_escaped, BLOCK: tl.constexpr):
    """Residue fields of the values not escaped, escape positions and raw values (every
    value of a RAW entry, the escaped ones of a RESIDUE entry)."""
    bits = column(items, _BITS, segments, seg)
    raw = column(layout, _RAW, segments, seg)
    if column(layout, _VENC, segments, seg) == _V_RESIDUE:
        width = column(layout, _VWIDTH, segments, seg)
        fields = column(layout, _FIELDS, segments, seg)
        more = values + escaped.to(tl.int64)
        put_fields(words, fields + (rank - values) * width, order_key(pattern, bits),
                   tl.where(escaped, 0, width), valid, fields + (rank + 1 - more) * width,
                   has_next)
        if any_escaped:
            positions = column(layout, _POSITIONS, segments, seg)
            position_bits = column(layout, _POSITION_BITS, segments, seg)
            put_fields(words, positions + values * position_bits, rank,
                       tl.where(escaped, position_bits, 0), valid,
                       positions + more * position_bits, has_next)
            put_fields(words, raw + values * bits, pattern, tl.where(escaped, bits, 0), valid,
                       raw + more * bits, has_next)
    else:  # 8 to 64 bits per value: whole words per block
        put_packed(words, raw + rank * bits, pattern, bits, valid, BLOCK)


@triton.jit(do_not_specialize=["segments", "patterns", "pattern_size", "blocks"])
def _write(items, layout, block_seg, segments, codes, patterns, pattern_size, counts, inclusive,
           blocks, words, BLOCK: tl.constexpr):
    block, seg, rank, valid, count = _block(items, block_seg, segments, BLOCK)
    if column(layout, _ENC, segments, seg) >= 0:  # dense entries are copied in afterwards
        # the next element, in this block, tells each element whether its word's run ends
        has_next = (tl.arange(0, BLOCK) < BLOCK - 1) & (rank + 1 < count)
        code = _codes(codes, block, BLOCK)
        _, value = _escaped(column(layout, _ENC, segments, seg),
                            column(layout, _VENC, segments, seg),
                            column(layout, _VWIDTH, segments, seg), code, valid)
        first = column(items, _FIRST_BLOCK, segments, seg)
        values = _before(inclusive + blocks, counts + blocks, block, first, value)
        idx = _index(items, segments, seg, rank, valid)
        _write_indices(items, layout, segments, seg, words, rank, valid, has_next, idx, code,
                       inclusive, counts, block, first, tl.load(counts + block) > 0, BLOCK)
        pattern = (load_uniform(patterns, _block_at(block, BLOCK), pattern_size, valid)
                   & width_mask(column(items, _BITS, segments, seg)))
        _write_values(items, layout, segments, seg, words, rank, valid, has_next, pattern,
                      value, values, tl.load(counts + blocks + block) > 0, BLOCK)


class FusedFlat:
    """``flat_encode.TorchFlat``'s interface over the kernels above.

    Args:
        known: the tensor set (addresses, numel, bits and residue flags per tensor).
        rows: the tensors that changed, in body order; ``counts`` and ``weights`` (the
            tensors) are theirs, row by row.
        changes: where every tensor's change set lies (rows of the whole set).
    """

    def __init__(self, known: TensorSet, rows: np.ndarray, counts: np.ndarray,
                 changes: ChangeTable, weights: Sequence[torch.Tensor], device: torch.device):
        self.segments, self.device = len(rows), device
        every = len(rows) == len(known.names)  # rows are sorted: every tensor, in order
        blocks = -(-counts // BLOCK)
        self.blocks = int(blocks.sum())
        columns = np.empty((len(_ITEMS), len(rows)), np.int64)
        columns[_COUNT], columns[_BLOCKS] = counts, blocks
        np.cumsum(blocks, out=columns[_FIRST_BLOCK])
        columns[_FIRST_BLOCK] -= blocks
        columns[_INDEX_AT:_NUMEL] = changes.columns if every else changes.columns[:, rows]
        static = _static(known)
        columns[_NUMEL:] = static if every else static[:, rows]
        copies = [] if known.contiguous else [w.contiguous() for w in weights]
        if copies:  # a tensor that is not contiguous is read from a contiguous copy
            columns[_VALUE_AT] = [c.data_ptr() for c in copies]
        # kept alive until the kernels that read them through their addresses are queued
        self._keep = (changes.keep, copies)
        self.items = host_table(columns, device)
        self.block_seg = block_segments(self.items[_BLOCKS], self.blocks)
        self.codes = torch.empty(self.blocks * BLOCK, dtype=torch.uint8, device=device)
        self.pattern_size = _pattern_bytes(columns[_BITS])
        self.patterns = torch.empty(self.blocks * BLOCK * self.pattern_size, dtype=torch.uint8,
                                    device=device)

    def stats(self, bins: int) -> torch.Tensor:
        """On the device, per tensor (rows): gaps over a byte, invalid indices, and the
        histogram of the residue widths ``0..bins-1`` that values need (columns;
        ``TorchFlat.stats``)."""
        assert bins < HIST_BINS, "a residue needs at most 33 bits"
        # only the bins read: the host reads the table as it is, with no copy to slice it
        out = torch.zeros(self.segments, 2 + bins, dtype=_INT64, device=self.device)
        if self.blocks:
            with on_device(self.device):
                _stats[(self.blocks,)](self.items, self.block_seg, self.segments, self.codes,
                                       self.patterns.data_ptr(), self.pattern_size, out, bins,
                                       BLOCK=BLOCK, BINS=HIST_BINS, num_warps=WARPS)
        return out

    def count_escapes(self, choice: Choice) -> Escapes:
        """Queue the escape counts per block and their prefix sum, which need only the
        encodings (``choice``, before the dense fallback: a dense entry's counts cancel
        out and are never read), so that the device counts while the host lays out."""
        counts = torch.empty(2, self.blocks, dtype=_INT64, device=self.device)
        if self.blocks:
            with on_device(self.device):
                _escape_counts[(self.blocks,)](self.items, host_table(choice.columns(),
                                                                      self.device),
                                               self.block_seg, self.segments, self.codes,
                                               counts, self.blocks, BLOCK=BLOCK,
                                               num_warps=WARPS)
        # one flat prefix sum over both rows (a device-wide scan; a scan per row runs as
        # one slow block each): the second row's offset cancels in _before
        return Escapes(self, (counts, torch.cumsum(counts.view(-1), 0)))

    def write(self, layout: Layout, escapes: Escapes) -> torch.Tensor:
        """The body laid out by ``layout`` as uint8 on the device, dense entries left zero;
        ``escapes``: this encoder's ``count_escapes`` of the encodings ``layout`` lays out."""
        ranks = escapes.ranks_for(self)
        words = layout.size // 8
        # one spare word: an element past its stream's last field adds zero just past it
        body = torch.zeros(words + 1, dtype=_INT64, device=self.device)
        if self.blocks:
            with on_device(self.device):
                _write[(self.blocks,)](self.items, layout.table, self.block_seg,
                                       self.segments, self.codes, self.patterns.data_ptr(),
                                       self.pattern_size, *ranks, self.blocks, body,
                                       BLOCK=BLOCK, num_warps=WARPS,
                                       maxnreg=REGISTERS)
        return body[:words].view(torch.uint8)


def _pattern_bytes(bits: np.ndarray) -> int:
    """The scratch bytes per value pattern for tensors of ``bits`` bits (2 at least): a
    runtime size, so that no payload's dtypes compile another kernel variant."""
    widest = int(bits.max()) if bits.size else 0
    return next(size for size in (2, 4, 8) if widest <= 8 * size)


def _static(known: TensorSet) -> np.ndarray:
    """The items table's rows that only the tensor set decides (numel, bits, residue flag,
    address, itemsize) for every tensor of the set: built once per set and kept on it,
    which a replaced, resized or re-typed tensor rebuilds (``tensor_set``)."""
    static = known.caches.get(FusedFlat)
    if static is None:
        table = known.table
        rows = {"numel": table.numel, "bits": known.bits, "residue": table.residue,
                "value_at": known.pointer, "size": table.itemsize}
        static = known.caches[FusedFlat] = np.stack([rows[name] for name in _STATIC]
                                                    ).astype(np.int64)
    return static
