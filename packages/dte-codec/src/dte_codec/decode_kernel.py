"""``flat_decode.decode_indices_flat``'s device work as Triton launches over all entries.

Blocks never straddle two entries here: entry ``e``'s elements (or its stream's words)
take whole blocks from block ``first_block[e]`` on, so a program reads its entry from a
block -> entry table (one load, built once per payload by ``fields.block_segments``; no
search and no compile-time entry count), branches on the entry's encoding, and the prefix
sum of per-block counts at an entry's first block is the entry's own base.

* ``_stream``, once over the words of every Elias-Fano upper stream and bitmap: the
  per-word set-bit counts (and set padding bits). Their prefix sum ranks every set bit.
* ``_fields``: INT32/INT64 indices are read straight into the output; GAP8 blocks count
  their escape bytes; each Elias-Fano or bitmap element finds its own bit (``rank_select``):
  a binary search of those ranks for its word, narrowed per block to the few words its
  block's ranks span (found by one 64-way search for both ends), then a select inside
  the word. Stores are coalesced, and no
  program loops over the set bits of its words.
* ``_gaps`` (only with GAP8 entries), twice: the per-block sums of the gaps (an escaped
  gap is read at its rank among the escape bytes), then each index as the prefix sum.
* ``_check``: indices inside ``[0, numel)`` and strictly increasing.
* ``_positions`` (only with residue escapes): the escape positions of every residue
  entry inside ``[0, count)`` and strictly increasing.

Every failed check is a count on the device; the caller reads their sum once. Nothing
about a payload but the presence of an encoding selects a compiled variant: entry counts
are not constants and the body's alignment (it may start at any word) is not specialized.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import triton
import triton.language as tl

from .dispatch import on_device
from .encodings import IndexEncoding
from .fields import block_segments, host_tables, starts_of
from .kernel_bits import (bit_length, column, flags_before, get_fields, load_uniform,
                          owned_block, width_mask)
from .rank_select import bounds, last_at_most, popcount, select

BLOCK = 512
"""Elements (or stream words) per program: at 1,024 (8 per thread) ``_fields`` held 156
registers, 3 programs per SM; at 512, 69 and 7, which hide its dependent loads better."""
REGISTERS: int | None = None
"""A cap on ``_fields``' registers per thread (``maxnreg``), None: the compiler's choice
(64 and 56 gave it 2 % at most: docs/benchmarks.md)."""
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
_STREAM = tl.constexpr(11)
# host-only columns: an entry's blocks and its GAP8 escape count
_BLOCKS = 12
_ESCAPES = 13
_STREAM_FIRST_BLOCK = tl.constexpr(0)
_STREAM_WORD = tl.constexpr(1)
_STREAM_LIMIT = tl.constexpr(2)
_STREAM_WORDS = tl.constexpr(3)
# host-only columns: a stream's blocks, its entry's element count, its first and last
# word slots
_STREAM_BLOCKS = 4
_STREAM_COUNT = 5
_STREAM_FIRST_SLOT = 6
_STREAM_LAST_SLOT = 7
_E_INT32 = tl.constexpr(IndexEncoding.INT32.value)
_E_INT64 = tl.constexpr(IndexEncoding.INT64.value)
_E_GAP8 = tl.constexpr(IndexEncoding.GAP8.value)
_E_ELIAS_FANO = tl.constexpr(IndexEncoding.ELIAS_FANO.value)
_E_BITMAP = tl.constexpr(IndexEncoding.BITMAP.value)


@triton.jit
def _entry_block(table, block_seg, segments, BLOCK: tl.constexpr):
    """This program's block, its entry (or stream), and the ranks of its elements in it."""
    return owned_block(table, block_seg, segments, 0, BLOCK)


@triton.jit
def _stream_keep(limit, base):
    """The bits of the word at stream bit ``base`` that lie before the stream's
    ``limit``."""
    return width_mask(tl.minimum(tl.maximum(limit - base, 0), 64))


@triton.jit(do_not_specialize=["segments", "stream_count", "last"],
            do_not_specialize_on_alignment=["words"])
def _fields(table, block_seg, segments, streams, stream_count, before, words, last, out, wides,
            BLOCK: tl.constexpr):
    block, seg, rank = _entry_block(table, block_seg, segments, BLOCK)
    enc = column(table, _ENC, segments, seg)
    count = column(table, _COUNT, segments, seg)
    valid = rank < count
    pos = column(table, _FIRST, segments, seg) + rank * column(table, _STRIDE, segments, seg)
    width = tl.where(valid, column(table, _WIDTH, segments, seg), 0)
    at = out + column(table, _START, segments, seg) + rank
    if (enc == _E_INT32) | (enc == _E_INT64):
        tl.store(at, get_fields(words, pos, width, last), mask=valid)
    if enc == _E_GAP8:
        wide = valid & (get_fields(words, pos, width, last) == 0)
        tl.store(wides + block, tl.sum(wide.to(tl.int64)))
    if (enc == _E_ELIAS_FANO) | (enc == _E_BITMAP):
        # the entry's k-th element is the k-th set bit of its stream, whose words sit in
        # the slots [first, end] of the per-word rank table ``before``
        s = column(table, _STREAM, segments, seg)
        first = column(streams, _STREAM_FIRST_BLOCK, stream_count, s) * BLOCK
        end = first + column(streams, _STREAM_WORDS, stream_count, s) - 1
        base = tl.load(before + first)
        head = base + (block - column(table, _FIRST_BLOCK, segments, seg)).to(tl.int64) * BLOCK
        tail = tl.minimum(head + BLOCK, base + count) - 1
        lo, hi = bounds(before, first, end, head, tail)
        target = base + tl.minimum(rank, count - 1)
        slot = last_at_most(before, lo + rank * 0, hi + rank * 0, target, bit_length(hi - lo))
        word_base = (slot - first) * 64
        word = tl.load(words + tl.minimum(column(streams, _STREAM_WORD, stream_count, s)
                                          + slot - first, last), mask=valid, other=0)
        data = word & _stream_keep(column(streams, _STREAM_LIMIT, stream_count, s), word_base)
        inside = tl.minimum(tl.maximum(target - tl.load(before + slot), 0), 63)
        bit = word_base + select(data, inside)
        low_width = tl.where(enc == _E_ELIAS_FANO, column(table, _LOW_WIDTH, segments, seg), 0)
        low = get_fields(words, pos, tl.where(valid, low_width, 0), last)
        index = tl.where(enc == _E_ELIAS_FANO, ((bit - rank) << low_width) | low, bit)
        tl.store(at, index, mask=valid)


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


@triton.jit(do_not_specialize=["segments", "last"],
            do_not_specialize_on_alignment=["words"])
def _stream(streams, block_seg, segments, words, last, ones, failures, BLOCK: tl.constexpr):
    block, s, rank = _entry_block(streams, block_seg, segments, BLOCK)
    inside = rank < column(streams, _STREAM_WORDS, segments, s)
    word = tl.load(words + tl.minimum(column(streams, _STREAM_WORD, segments, s) + rank, last),
                   mask=inside, other=0)
    limit = column(streams, _STREAM_LIMIT, segments, s)
    base = rank * 64
    keep = _stream_keep(limit, base)
    # bits past the limit inside the stream's bytes must be zero; the section's padding
    # bytes after them are not checked (FORMAT.md)
    padded = width_mask(tl.minimum(tl.maximum(((limit + 7) // 8) * 8 - base, 0), 64))
    tl.store(ones + block * BLOCK + tl.arange(0, BLOCK), popcount(word & keep))
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


# columns of the residue escape-position table (host-only: the blocks)
_P_ESCAPES = tl.constexpr(1)
_P_AT = tl.constexpr(2)
_P_SIZE = tl.constexpr(3)
_P_COUNT = tl.constexpr(4)
_P_BLOCKS = 5


@triton.jit(do_not_specialize=["segments"])
def _positions(table, block_seg, segments, failures, BLOCK: tl.constexpr):
    """Residue escape positions outside ``[0, count)`` or not strictly increasing."""
    _, seg, rank = _entry_block(table, block_seg, segments, BLOCK)
    valid = rank < column(table, _P_ESCAPES, segments, seg)
    at = column(table, _P_AT, segments, seg)
    size = column(table, _P_SIZE, segments, seg)
    position = load_uniform(at, rank, size, valid)
    previous = load_uniform(at, rank - 1, size, valid & (rank > 0))
    bad = valid & ((position < 0) | (position >= column(table, _P_COUNT, segments, seg))
                   | ((rank > 0) & (position <= previous)))
    # one atomic per bad position (none in a sound payload), not a block-wide sum
    tl.atomic_add(failures + rank * 0, 1, mask=bad, sem="relaxed")


def escape_failures(escapes: np.ndarray, at: np.ndarray, sizes: np.ndarray,
                    counts: np.ndarray, device: torch.device) -> torch.Tensor:
    """The count of residue escape positions out of ``[0, count)`` or not increasing, per
    entry ``escapes`` positions of ``sizes`` bytes at address ``at``: one launch."""
    with on_device(device):
        rows = _escape_rows(escapes, at, sizes, counts)
        return _escape_pass(rows, *host_tables([rows], device))


def _escape_rows(escapes: np.ndarray, at: np.ndarray, sizes: np.ndarray, counts: np.ndarray
                 ) -> np.ndarray:
    blocks = -(-escapes // BLOCK)
    return np.stack([starts_of(blocks), escapes, at, sizes, counts, blocks])


def _escape_pass(rows: np.ndarray, table: torch.Tensor) -> torch.Tensor:
    """The ``_positions`` launch over the escape table ``rows`` (``table`` on the device):
    the count of its failed checks, 0-d."""
    total = int(rows[_P_BLOCKS].sum())
    failures = torch.zeros((), dtype=_INT64, device=table.device)
    _positions[(total,)](table, block_segments(table[_P_BLOCKS], total), rows.shape[1],
                         failures, BLOCK=BLOCK)
    return failures


def decode(rows: np.ndarray, counts: np.ndarray, words: torch.Tensor,
           escapes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the sparse entries back to back (int64) and the count of failed checks.

    ``rows``: columns x entries, ``flat_decode._COLUMNS`` (encoding, first, stride, width,
    second, escape_bits, low_width, numel, escapes, bit_limit); ``counts``: per entry its
    element count; ``words``: the body as int64. ``escapes``: ``escape_failures``'s
    arrays, whose failed checks are then counted too. Every table goes to the device in
    one copy.
    """
    with on_device(words.device):
        return _decode(rows, counts, words, escapes)


def _decode(rows: np.ndarray, counts: np.ndarray, words: torch.Tensor,
            escapes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    device, last = words.device, words.numel() - 1
    blocks = -(-counts // BLOCK)
    streams_rows, stream_of = _stream_rows(rows, counts)
    enc, first, stride, width, second, escape_bits, low_width, numel, escapes_n, _ = rows
    tables = [np.stack([starts_of(blocks), starts_of(counts), counts, numel, enc, first, stride,
                        width, second, escape_bits, low_width, stream_of, blocks, escapes_n])]
    if streams_rows is not None:
        tables.append(streams_rows)
    if escapes is not None:
        escape_rows = _escape_rows(*escapes)
        tables.append(escape_rows)
    table, *rest = host_tables(tables, device)  # every table in one copy
    # without streams, ``_fields`` takes the entry table in their place: only Elias-Fano
    # and bitmap entries read them (and an aligned int64 table compiles no other variant)
    streams, ranks = table, None
    if streams_rows is not None:
        streams = rest[0]
        ranks = _stream_pass(streams_rows, streams, words)
    segments, total_blocks = counts.size, int(blocks.sum())
    block_seg = block_segments(table[_BLOCKS], total_blocks)
    out = torch.empty(int(counts.sum()), dtype=_INT64, device=device)
    wides, sums, gap_failures, check_failures = _rows(4, total_blocks, device)
    grid = (total_blocks,)
    args = (table, block_seg, segments)
    _fields[grid](*args, streams, streams.shape[1], table if ranks is None else ranks.before,
                  words, last, out, wides, BLOCK=BLOCK,
                  maxnreg=REGISTERS)
    # what ``_fields`` does not read is queued behind it: the device is busy meanwhile
    failures = [] if ranks is None else [ranks.failures(streams)]
    if escapes is not None:
        failures.append(_escape_pass(escape_rows, rest[-1]))
    if (enc == IndexEncoding.GAP8).any():
        wide_before = starts_of(wides)
        _gaps[grid](*args, words, last, wide_before, wide_before, sums, gap_failures, out,
                    BLOCK=BLOCK, WRITE=False)
        _gaps[grid](*args, words, last, wide_before, starts_of(sums), sums, gap_failures, out,
                    BLOCK=BLOCK, WRITE=True)
        # wides counts only GAP8 blocks, and other entries have no escapes
        per_entry = _per_entry(wides, table[_FIRST_BLOCK.value], table[_BLOCKS])
        failures.append((per_entry != table[_ESCAPES]).sum())
        failures.append(gap_failures.sum())
    _check[grid](*args, out, check_failures, BLOCK=BLOCK)
    failures.append(check_failures.sum())
    return out, sum(failures)


def _stream_rows(rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The Elias-Fano upper streams and bitmaps as ``_stream``'s table rows (None where
    there are none), and each entry's stream (0 for entries without one)."""
    enc = rows[0]
    is_ef = enc == IndexEncoding.ELIAS_FANO
    picked = is_ef | (enc == IndexEncoding.BITMAP)
    stream_of = np.where(picked, np.cumsum(picked) - 1, 0)
    if not picked.any():
        return None, stream_of
    limit = rows[9][picked]
    stream_words = -(-limit // 64)
    blocks = -(-stream_words // BLOCK)
    word_at = np.where(is_ef, rows[4], rows[1])[picked] // 64
    first_block = starts_of(blocks)
    return np.stack([first_block, word_at, limit, stream_words, blocks, counts[picked],
                     first_block * BLOCK, (first_block + blocks) * BLOCK - 1]), stream_of


@attrs.frozen
class _Ranks:
    """What ``_stream`` leaves: per stream word slot the set bits before it, and what its
    checks need (the prefix sums of the set bits, the words with set padding bits)."""

    before: torch.Tensor
    seen: torch.Tensor
    padded: torch.Tensor

    def failures(self, streams: torch.Tensor) -> torch.Tensor:
        """The streams' failed checks: set bits other than their element counts, set
        padding bits."""
        found = (self.seen.index_select(0, streams[_STREAM_LAST_SLOT])
                 - self.before.index_select(0, streams[_STREAM_FIRST_SLOT]))
        return (found != streams[_STREAM_COUNT]).sum() + self.padded.sum()


def _stream_pass(rows: np.ndarray, streams: torch.Tensor, words: torch.Tensor) -> _Ranks:
    """The ``_stream`` launch over the stream table ``rows`` (``_stream_rows``; on the
    device ``streams``): the ranks ``_fields`` searches (``_Ranks``)."""
    device, last = words.device, words.numel() - 1
    total = int(rows[_STREAM_BLOCKS].sum())
    block_seg = block_segments(streams[_STREAM_BLOCKS], total)
    ones = torch.empty(total * BLOCK, dtype=_INT64, device=device)
    padded = _rows(1, total, device)[0]
    _stream[(total,)](streams, block_seg, rows.shape[1], words, last, ones, padded, BLOCK=BLOCK)
    seen = torch.cumsum(ones, 0)
    return _Ranks(seen - ones, seen, padded)


def _rows(count: int, length: int, device: torch.device) -> torch.Tensor:
    """``count`` zeroed int64 rows of ``length``, each starting on a 16-byte boundary:
    Triton specializes a pointer on that alignment, so rows of an odd length would compile
    every kernel that takes them a second time."""
    return torch.zeros(count, length + length % 2, dtype=_INT64, device=device)[:, :length]


def _per_entry(per_block: torch.Tensor, first_blocks: torch.Tensor, blocks: torch.Tensor
               ) -> torch.Tensor:
    """Per entry, the sum of its blocks' counts (device columns of the entry table)."""
    total = torch.cumsum(per_block, 0)
    return (total.index_select(0, first_blocks + blocks - 1) - total.index_select(0, first_blocks)
            + per_block.index_select(0, first_blocks))
