"""Index decoding of every sparse entry of a payload at once, in one flat index space.

The same indices as ``indices.decode_indices`` entry by entry, from a fixed number of
torch ops over all carried elements: raw indices, gap bytes and Elias-Fano low bits are
fields read at computed positions (``fields.read_fields``); escaped gaps are read at
their escape rank; the set bits of Elias-Fano upper streams and bitmaps are found in one
pass over all those bits (a rank per bit by prefix sum, then a scatter). Every check of
the reference (set-bit and escape counts, padding, ranges, strict increase, residue
escape positions) becomes a count of failures on the device; ``FlatIndices.valid``
reads them with one host synchronization. When a check fails, the caller decodes entry
by entry to raise the reference's error. Where the kernels run (``dispatch.fused``) the
index work is a handful of Triton launches instead (``decode_kernel``), same indices and
same failure counts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import torch

from .bits import BYTE_BITS
from .dispatch import fused
from .fields import Segments, host_table, read_fields
from .header import Entry, IndexEncoding, ValueEncoding, align, index_itemsize
from .indices import GAP_ESCAPE, MAX_GAP_BYTE

SPARSE = frozenset({IndexEncoding.INT32, IndexEncoding.INT64, IndexEncoding.BITMAP,
                    IndexEncoding.GAP8, IndexEncoding.ELIAS_FANO})
_INT64 = torch.int64


@attrs.frozen
class FlatIndices:
    """Decoded indices of the sparse entries, and the device count of failed checks."""

    indices: tuple[torch.Tensor, ...]
    """Per sparse entry, in payload order, int64 flat indices (views of one tensor)."""
    failures: torch.Tensor

    def valid(self) -> bool:
        """Whether every check passed (one host synchronization)."""
        return int(self.failures) == 0


def decode_indices_flat(entries: Sequence[Entry], body: torch.Tensor) -> FlatIndices:
    """Indices of every sparse entry of ``entries`` from ``body`` (uint8, 8-byte multiple)."""
    starts, offset = [], 0
    for entry in entries:
        entry_starts = []
        for size in entry.section_sizes():
            entry_starts.append(offset * BYTE_BITS)
            offset += align(size)
        starts.append(entry_starts)
    words = body.view(_INT64) if body.numel() else torch.zeros(1, dtype=_INT64,
                                                               device=body.device)
    sparse = [(e, s) for e, s in zip(entries, starts) if e.index_encoding in SPARSE]
    failures = [_escape_failures(entries, starts, words)]
    if not sparse:
        return FlatIndices((), sum(failures))
    if fused(body.device):
        from .decode_kernel import decode
        flat, index_failures = decode(sparse, [_row(e, s) for e, s in sparse], words)
    else:
        segs = Segments.of([e.count for e, _ in sparse], body.device)
        table = host_table([list(c) for c in zip(*(_row(e, s) for e, s in sparse))],
                           body.device)
        flat, index_failures = _Decoder(segs, table, words, body).run(sparse)
    failures.append(index_failures)
    return FlatIndices(tuple(flat.split([e.count for e, _ in sparse])), sum(failures))


_COLUMNS = ("encoding", "first", "stride", "width", "second", "escape_bits", "low_width",
            "numel", "escapes", "bit_limit")


def _row(entry: Entry, starts: list[int]) -> tuple[int, ...]:
    enc, numel = entry.index_encoding, entry.numel
    raw_bits = index_itemsize(numel) * BYTE_BITS
    second = starts[1] if len(entry.index_sections()) > 1 else starts[0]
    stride, width, limit = {
        IndexEncoding.INT32: (32, 32, 0),
        IndexEncoding.INT64: (64, 64, 0),
        IndexEncoding.GAP8: (BYTE_BITS, BYTE_BITS, 0),
        IndexEncoding.ELIAS_FANO: (entry.index_width, entry.index_width,
                                   entry.count + ((max(numel, 1) - 1) >> entry.index_width) + 1),
        IndexEncoding.BITMAP: (0, 0, numel),
    }[enc]
    return (int(enc), starts[0], stride, width, second, raw_bits, entry.index_width, numel,
            entry.index_escapes, limit)


class _Decoder:
    def __init__(self, segs: Segments, table: torch.Tensor, words: torch.Tensor,
                 body: torch.Tensor):
        self.segs, self.table, self.words, self.body = segs, table, words, body

    def col(self, name: str) -> torch.Tensor:
        return self.segs.spread(self.table[_COLUMNS.index(name)])

    def run(self, sparse: list[tuple[Entry, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        segs, rank = self.segs, self.segs.rank
        enc = self.col("encoding")
        first = read_fields(self.words, self.col("first") + rank * self.col("stride"),
                            self.col("width"))
        gap_idx, gap_failures = self._gaps(enc == IndexEncoding.GAP8, first)
        high, bit_failures = self._set_bits(sparse)
        idx = torch.where(enc == IndexEncoding.GAP8, gap_idx, first)
        idx = torch.where(enc == IndexEncoding.ELIAS_FANO, (high << self.col("low_width")) | first,
                          idx)
        idx = torch.where(enc == IndexEncoding.BITMAP, high, idx)
        previous = segs.previous(idx, -1)
        bad = (idx < 0) | (idx >= self.col("numel")) | ((rank > 0) & (idx <= previous))
        return idx, gap_failures + bit_failures + bad.sum()

    def _gaps(self, is_gap: torch.Tensor, byte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GAP8 entries: indices by segmented prefix sum, and failed checks."""
        wide = is_gap & (byte == GAP_ESCAPE)
        before = self.segs.exclusive_ranks(wide)
        escape_bits = self.col("escape_bits")
        escaped = read_fields(self.words, self.col("second") + before * escape_bits,
                              torch.where(wide, escape_bits, 0))
        gap = torch.where(is_gap, torch.where(wide, escaped, byte), 0)
        total = torch.cumsum(gap, 0)
        idx = total - (total - gap)[self.segs.start] - 1
        counts = self.segs.sums(wide) != self.table[_COLUMNS.index("escapes")]
        counts &= self.table[_COLUMNS.index("encoding")] == IndexEncoding.GAP8
        out_of_range = wide & ((escaped <= MAX_GAP_BYTE) | (escaped > self.col("numel")))
        return idx, counts.sum() + out_of_range.sum()

    def _set_bits(self, sparse: list[tuple[Entry, list[int]]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Elias-Fano upper streams and bitmaps: per element, its high part (Elias-Fano)
        or index (bitmap), and failed checks (set-bit counts, padding).

        Works on bytes, not bits: the stream bytes of all entries back to back, their
        set-bit counts and the prefix sum of those; element ``k`` of an entry is its
        entry's ``k``-th set bit, found by a binary search over the prefix sums and a
        table lookup inside the byte.
        """
        device, total = self.body.device, self.segs.total
        rows, stream_of = [], []
        for (entry, entry_starts), first in zip(sparse, self.segs.starts):
            enc = entry.index_encoding
            is_ef = enc == IndexEncoding.ELIAS_FANO
            if is_ef or enc == IndexEncoding.BITMAP:
                limit = _row(entry, entry_starts)[-1]
                stream_of.append(len(rows))
                rows.append((-(-limit // BYTE_BITS), limit, entry.count, int(is_ef),
                             entry_starts[1 if is_ef else 0] // BYTE_BITS))
            else:
                stream_of.append(0)
        zero = torch.zeros((), dtype=_INT64, device=device)
        if not rows:
            return torch.zeros(total, dtype=_INT64, device=device), zero
        streams = Segments.of([r[0] for r in rows], device)
        table = host_table([list(c) for c in zip(*rows)], device)
        at = (streams.spread(table[4]) + streams.rank).clamp(max=self.body.numel() - 1)
        data = self.body.index_select(0, at).to(_INT64)
        kept = (streams.spread(table[1]) - streams.rank * BYTE_BITS).clamp(0, BYTE_BITS)
        padding = (data >> kept) != 0
        data = data & ((1 << kept) - 1)
        popcount, select = _byte_tables(device)
        ones = popcount.index_select(0, data)
        seen = torch.cumsum(ones, 0)
        wrong = (streams.sums(ones) != table[2]).sum() + padding.sum()
        # per element: its stream, and the global rank of the set bit it is
        stream = self.segs.spread(host_table([stream_of], device)[0])
        first_byte = streams.bounds[0].index_select(0, stream)
        rank = self.segs.rank
        target = (seen - ones).index_select(0, first_byte) + rank
        byte = torch.searchsorted(seen, target, right=True)
        byte = torch.minimum(torch.maximum(byte, first_byte),
                             streams.bounds[1].index_select(0, stream) - 1)
        inside = (target - (seen - ones).index_select(0, byte)).clamp(0, BYTE_BITS - 1)
        offset = select.index_select(0, data.index_select(0, byte) * BYTE_BITS + inside)
        bit = (byte - first_byte) * BYTE_BITS + offset
        is_ef = table[3].index_select(0, stream) > 0
        return torch.where(is_ef, bit - rank, bit), wrong


@functools.cache
def _byte_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per byte value ``v``: its set-bit count; and at ``v * 8 + r`` the position of its
    ``r``-th set bit (0 past the last). Built once per device."""
    popcount = [bin(v).count("1") for v in range(256)]
    select = [([i for i in range(BYTE_BITS) if v >> i & 1] + [0] * BYTE_BITS)[r]
              for v in range(256) for r in range(BYTE_BITS)]
    return host_table([popcount], device)[0], host_table([select], device)[0]


def _escape_failures(entries: Sequence[Entry], starts: list[list[int]],
                     words: torch.Tensor) -> torch.Tensor:
    """Residue escape positions that are out of ``[0, count)`` or not increasing."""
    rows = [(e.count, s[len(e.index_sections()) + 1], index_itemsize(e.count) * BYTE_BITS,
             e.value_escapes) for e, s in zip(entries, starts)
            if e.value_encoding == ValueEncoding.RESIDUE and e.value_escapes]
    if not rows:
        return torch.zeros((), dtype=_INT64, device=words.device)
    segs = Segments.of([r[3] for r in rows], words.device)
    table = host_table([list(c) for c in zip(*rows)], words.device)
    count, start, bits = (segs.spread(table[k]) for k in range(3))
    positions = read_fields(words, start + segs.rank * bits, bits)
    previous = segs.previous(positions, -1)
    bad = (positions < 0) | (positions >= count) | ((segs.rank > 0) & (positions <= previous))
    return bad.sum()

