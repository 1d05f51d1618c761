"""``flat_decode.decode_indices_flat``'s device work as Triton launches over all entries.

Blocks never straddle two entries here: entry ``e``'s elements (or its stream's words)
take whole blocks from block ``first_block[e]`` on, so a program reads its entry from a
block -> entry table (one load, built once per payload by ``fields.block_segments``; no
search and no compile-time entry count), branches on the entry's encoding, and the prefix sum of per-block counts
at an entry's first block is the entry's own base.

* ``_fields``: INT32/INT64 indices are read straight into the output; GAP8 blocks count
  their escape bytes.
* ``_gaps`` (only with GAP8 entries), twice: the per-block sums of the gaps (an escaped
  gap is read at its rank among the escape bytes), then each index as the prefix sum.
* ``_stream``, twice over the words of every Elias-Fano upper stream and bitmap: the
  per-word set-bit counts (and set padding bits), then each word hands its set bits to
  the elements whose rank they are, with the low bits for Elias-Fano.
* ``_check``: indices inside ``[0, numel)`` and strictly increasing.

Every failed check is a count on the device; the caller reads their sum once. Nothing
about a payload but the presence of an encoding selects a compiled variant: entry counts
are not constants and the body's alignment (it may start at any word) is not specialized.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .dispatch import on_device
from .fields import block_segments, host_table
from .header import Entry, IndexEncoding
from .kernel_bits import (column, flags_before, get_fields, owned_block, shift_right,
                          width_mask)

BLOCK = 1024
_INT64 = torch.int64
_FIRST_BLOCK = tl.constexpr(0)
_START = tl.constexpr(1)
_COUNT = tl.constexpr(2)
_NUMEL = tl.constexpr(3)
_ENC = tl.constexpr(4)
_FIRST = tl.constexpr(5)
_STRIDE = tl.constexpr(6)
_WIDTH = tl.constexpr(7)
_SECOND = tl.constexpr(8)
_ESCAPE_BITS = tl.constexpr(9)
_LOW_WIDTH = tl.constexpr(10)
# host-only columns: an entry's blocks and its GAP8 escape count
_BLOCKS = 11
_ESCAPES = 12
_STREAM_FIRST_BLOCK = tl.constexpr(0)
_STREAM_ENTRY = tl.constexpr(1)
_STREAM_WORD = tl.constexpr(2)
_STREAM_LIMIT = tl.constexpr(3)
_STREAM_WORDS = tl.constexpr(4)
_STREAM_BLOCKS = 5  # host-only
_E_INT32 = tl.constexpr(IndexEncoding.INT32.value)
_E_INT64 = tl.constexpr(IndexEncoding.INT64.value)
_E_GAP8 = tl.constexpr(IndexEncoding.GAP8.value)
_E_ELIAS_FANO = tl.constexpr(IndexEncoding.ELIAS_FANO.value)


@triton.jit
def _entry_block(table, block_seg, segments, BLOCK: tl.constexpr):
    """This program's block, its entry (or stream), and the ranks of its elements in it."""
    return owned_block(table, block_seg, segments, 0, BLOCK)


@triton.jit
def _popcount(x):
    x = x - (shift_right(x, x * 0 + 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + (shift_right(x, x * 0 + 2) & 0x3333333333333333)
    x = (x + shift_right(x, x * 0 + 4)) & 0x0F0F0F0F0F0F0F0F
    return shift_right(x * 0x0101010101010101, x * 0 + 56)


@triton.jit(do_not_specialize=["segments", "last"],
            do_not_specialize_on_alignment=["words"])
def _fields(table, block_seg, segments, words, last, out, wides, BLOCK: tl.constexpr):
    block, seg, rank = _entry_block(table, block_seg, segments, BLOCK)
    enc = column(table, _ENC, segments, seg)
    valid = rank < column(table, _COUNT, segments, seg)
    pos = column(table, _FIRST, segments, seg) + rank * column(table, _STRIDE, segments, seg)
    width = tl.where(valid, column(table, _WIDTH, segments, seg), 0)
    if (enc == _E_INT32) | (enc == _E_INT64):
        value = get_fields(words, pos, width, last)
        tl.store(out + column(table, _START, segments, seg) + rank, value, mask=valid)
    if enc == _E_GAP8:
        wide = valid & (get_fields(words, pos, width, last) == 0)
        tl.store(wides + block, tl.sum(wide.to(tl.int64)))


@triton.jit(do_not_specialize=["segments", "last"],
            do_not_specialize_on_alignment=["words"])
def _gaps(table, block_seg, segments, words, last, wide_before, gap_before, sums, failures,
          out, BLOCK: tl.constexpr, WRITE: tl.constexpr):
    block, seg, rank = _entry_block(table, block_seg, segments, BLOCK)
    if column(table, _ENC, segments, seg) == _E_GAP8:
        valid = rank < column(table, _COUNT, segments, seg)
        byte = get_fields(words, column(table, _FIRST, segments, seg) + rank * 8,
                          tl.where(valid, 8, 0), last)
        wide = valid & (byte == 0)
        first = column(table, 0, segments, seg)
        ahead = flags_before(wide_before, block, wide) - tl.load(wide_before + first)
        bits = column(table, _ESCAPE_BITS, segments, seg)
        escaped = get_fields(words, column(table, _SECOND, segments, seg) + ahead * bits,
                             tl.where(wide, bits, 0), last)
        gap = tl.where(wide, escaped, byte)
        if WRITE:
            index = (tl.load(gap_before + block) - tl.load(gap_before + first)
                     + tl.cumsum(gap, 0) - 1)
            tl.store(out + column(table, _START, segments, seg) + rank, index, mask=valid)
        else:
            numel = column(table, _NUMEL, segments, seg)
            bad = wide & ((escaped <= 255) | (escaped > numel))
            tl.store(sums + block, tl.sum(gap))
            tl.store(failures + block, tl.sum(bad.to(tl.int64)))


@triton.jit(do_not_specialize=["segments", "entries", "last"],
            do_not_specialize_on_alignment=["words"])
def _stream(streams, block_seg, table, segments, entries, words, last, counts, before,
            failures, out, BLOCK: tl.constexpr, WRITE: tl.constexpr):
    block, s, rank = _entry_block(streams, block_seg, segments, BLOCK)
    inside = rank < column(streams, _STREAM_WORDS, segments, s)
    word = tl.load(words + tl.minimum(column(streams, _STREAM_WORD, segments, s) + rank, last),
                   mask=inside, other=0)
    limit = column(streams, _STREAM_LIMIT, segments, s)
    base = rank * 64
    keep = width_mask(tl.minimum(tl.maximum(limit - base, 0), 64))
    # bits past the limit inside the stream's bytes must be zero; the section's padding
    # bytes after them are not checked (FORMAT.md)
    padded = width_mask(tl.minimum(tl.maximum(((limit + 7) // 8) * 8 - base, 0), 64))
    data = word & keep
    ones = _popcount(data)
    if WRITE:
        entry = column(streams, _STREAM_ENTRY, segments, s)
        count = column(table, _COUNT, entries, entry)
        start = column(table, _START, entries, entry)
        low_width = column(table, _LOW_WIDTH, entries, entry)
        is_ef = column(table, _ENC, entries, entry) == _E_ELIAS_FANO
        first_low = column(table, _FIRST, entries, entry)
        r = flags_before(before, block, ones) - tl.load(before + column(streams, 0, segments, s))
        for _ in range(tl.max(ones)):
            lowest = data & -data
            bit = base + _popcount(lowest - 1)
            found = (data != 0) & (r < count)
            low = get_fields(words, first_low + r * low_width,
                             tl.where(found & is_ef, low_width, 0), last)
            index = tl.where(is_ef, ((bit - r) << low_width) | low, bit)
            tl.store(out + start + r, index, mask=found)
            data ^= lowest
            r += 1
    else:
        tl.store(counts + block, tl.sum(ones))
        tl.store(failures + block, tl.sum(((word & padded & ~keep) != 0).to(tl.int64)))


@triton.jit(do_not_specialize=["segments"])
def _check(table, block_seg, segments, out, failures, BLOCK: tl.constexpr):
    block, seg, rank = _entry_block(table, block_seg, segments, BLOCK)
    valid = rank < column(table, _COUNT, segments, seg)
    at = out + column(table, _START, segments, seg) + rank
    index = tl.load(at, mask=valid, other=0)
    previous = tl.load(at - 1, mask=valid & (rank > 0), other=-1)
    bad = valid & ((index < 0) | (index >= column(table, _NUMEL, segments, seg))
                   | (index <= previous))
    tl.store(failures + block, tl.sum(bad.to(tl.int64)))


def decode(sparse: Sequence[tuple[Entry, list[int]]], rows: Sequence[tuple[int, ...]],
           words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the sparse entries back to back (int64) and the count of failed checks.

    ``rows``: per entry ``flat_decode._row`` (encoding, first, stride, width, second,
    escape_bits, low_width, numel, escapes, bit_limit); ``words``: the body as int64.
    """
    with on_device(words.device):
        return _decode(sparse, rows, words)


def _decode(sparse: Sequence[tuple[Entry, list[int]]], rows: Sequence[tuple[int, ...]],
            words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device, last = words.device, words.numel() - 1
    counts = [entry.count for entry, _ in sparse]
    blocks = [triton.cdiv(n, BLOCK) for n in counts]
    columns = [_starts(blocks), _starts(counts), counts] + [list(c) for c in zip(*(
        (row[7], row[0], row[1], row[2], row[3], row[4], row[5], row[6]) for row in rows))]
    table = host_table(columns + [blocks, [row[8] for row in rows]], device)  # _BLOCKS, _ESCAPES
    segments, total_blocks = len(sparse), sum(blocks)
    block_seg = block_segments(table[_BLOCKS], total_blocks)
    out = torch.empty(sum(counts), dtype=_INT64, device=device)
    wides, sums, gap_failures, check_failures = _rows(4, total_blocks, device)
    grid = (total_blocks,)
    args = (table, block_seg, segments)
    _fields[grid](*args, words, last, out, wides, BLOCK=BLOCK)
    failures = [_stream_pass(rows, table, words, out)]
    if any(row[0] == IndexEncoding.GAP8 for row in rows):
        wide_before = _exclusive(wides)
        _gaps[grid](*args, words, last, wide_before, wide_before, sums, gap_failures, out,
                    BLOCK=BLOCK, WRITE=False)
        _gaps[grid](*args, words, last, wide_before, _exclusive(sums), sums, gap_failures, out,
                    BLOCK=BLOCK, WRITE=True)
        # wides counts only GAP8 blocks, and other entries have no escapes
        failures.append((_per_entry(wides, table[_FIRST_BLOCK.value], table[_BLOCKS]) != table[_ESCAPES]).sum())
        failures.append(gap_failures.sum())
    _check[grid](*args, out, check_failures, BLOCK=BLOCK)
    failures.append(check_failures.sum())
    return out, sum(failures)


def _stream_pass(rows, table: torch.Tensor, words: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """Both ``_stream`` launches over the Elias-Fano upper streams and bitmaps; failures."""
    device, last = words.device, words.numel() - 1
    picked = [(k, row) for k, row in enumerate(rows)
              if row[0] in (IndexEncoding.ELIAS_FANO, IndexEncoding.BITMAP)]
    if not picked:
        return torch.zeros((), dtype=_INT64, device=device)
    stream_words = [-(-row[9] // 64) for _, row in picked]
    blocks = [triton.cdiv(n, BLOCK) for n in stream_words]
    word_at = [(row[4] if row[0] == IndexEncoding.ELIAS_FANO else row[1]) // 64
               for _, row in picked]
    picks = [k for k, _ in picked]
    streams = host_table([_starts(blocks), picks, word_at, [row[9] for _, row in picked],
                          stream_words, blocks], device)
    block_seg = block_segments(streams[_STREAM_BLOCKS], sum(blocks))
    ones, bad = _rows(2, sum(blocks), device)
    grid = (sum(blocks),)
    args = (streams, block_seg, table, len(picked), len(rows), words, last)
    _stream[grid](*args, ones, ones, bad, out, BLOCK=BLOCK, WRITE=False)
    _stream[grid](*args, ones, _exclusive(ones), bad, out, BLOCK=BLOCK, WRITE=True)
    expected = table[_COUNT.value].index_select(0, streams[_STREAM_ENTRY.value])
    return (_per_entry(ones, streams[_STREAM_FIRST_BLOCK.value], streams[_STREAM_BLOCKS]) != expected).sum() + bad.sum()


def _rows(count: int, length: int, device: torch.device) -> torch.Tensor:
    """``count`` zeroed int64 rows of ``length``, each starting on a 16-byte boundary:
    Triton specializes a pointer on that alignment, so rows of an odd length would compile
    every kernel that takes them a second time."""
    return torch.zeros(count, length + length % 2, dtype=_INT64, device=device)[:, :length]


def _starts(sizes: list[int]) -> list[int]:
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    return starts


def _exclusive(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def _per_entry(per_block: torch.Tensor, first_blocks: torch.Tensor, blocks: torch.Tensor
               ) -> torch.Tensor:
    """Per entry, the sum of its blocks' counts (device columns of the entry table)."""
    total = torch.cumsum(per_block, 0)
    return (total.index_select(0, first_blocks + blocks - 1) - total.index_select(0, first_blocks)
            + per_block.index_select(0, first_blocks))
