"""Index decoding of every sparse entry of a payload at once, in one flat index space.

The same indices as ``indices.decode_indices`` entry by entry, from a fixed number of
torch ops over all carried elements: raw indices, gap bytes and Elias-Fano low bits are
fields read at computed positions (``fields.read_fields``); escaped gaps are read at
their escape rank; the set bits of Elias-Fano upper streams and bitmaps are found in one
pass over all those bits (a rank per bit by prefix sum, then a scatter). Every check of
the reference (set-bit and escape counts, padding, ranges, strict increase, residue
escape positions) becomes a count of failures on the device (``FlatIndices.failures``),
which ``decode`` reads with the body digest in one host synchronization
(``decode.QueuedChecks``). When a check fails, the caller decodes entry
by entry to raise the reference's error. Where the kernels run (``dispatch.fused``) the
index work and the escape-position check are a handful of Triton launches instead
(``decode_kernel``), same indices and same failure counts. On the host, the header's
entry table already holds every field and section offset as numpy columns
(``Header.columns``, ``Sections.offsets``); the entry tables are array arithmetic from
there (``_Layout``), no Python per entry.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
import torch

from .bits import BYTE_BITS
from .dispatch import fused
from .encodings import (BITMAP, ELIAS_FANO, INDEX32_LIMIT, RESIDUE, IndexEncoding,
                        index_itemsizes)
from .fields import Segments, host_table, read_fields
from .header import Header
from .indices import GAP_ESCAPE, MAX_GAP_BYTE

SPARSE = frozenset({IndexEncoding.INT32, IndexEncoding.INT64, IndexEncoding.BITMAP,
                    IndexEncoding.GAP8, IndexEncoding.ELIAS_FANO})
IS_SPARSE = np.zeros(len(IndexEncoding), dtype=bool)
"""Per index encoding (of a validated header), whether it is in ``SPARSE``: a lookup
where ``np.isin`` would sort."""
IS_SPARSE[list(SPARSE)] = True
_INT64 = torch.int64
VALUE_SECTIONS = 3
"""The most value sections an entry has: residue fields, escape positions, escaped values."""


@attrs.frozen
class FlatIndices:
    """Decoded indices of the sparse entries, and the device count of failed checks."""

    flat: torch.Tensor
    """The sparse entries' int64 flat indices back to back, in payload order."""
    counts: np.ndarray
    """Per sparse entry, its number of indices."""
    failures: torch.Tensor

    @property
    def indices(self) -> tuple[torch.Tensor, ...]:
        """Per sparse entry, its indices (views of ``flat``)."""
        return tuple(self.flat.split(self.counts.tolist())) if self.counts.size else ()


def decode_indices_flat(header: Header, body: torch.Tensor) -> FlatIndices:
    """Indices of every sparse entry of a validated ``header`` from its ``body`` (uint8,
    8-byte multiple)."""
    layout = _Layout.of(header)
    words = body.view(_INT64) if body.numel() else torch.zeros(1, dtype=_INT64,
                                                               device=body.device)
    rows, counts = layout.sparse_rows()
    if counts.size and fused(body.device):  # the escape checks' table copied with the rest
        from .decode_kernel import decode
        flat, failures = decode(rows, counts, words, _escape_columns(layout, words))
        return FlatIndices(flat, counts, failures)
    failures = [_escape_failures(layout, words)]
    if not counts.size:
        return FlatIndices(torch.empty(0, dtype=_INT64, device=body.device), counts,
                           sum(failures))
    segs = Segments.of(counts.tolist(), body.device)
    flat, index_failures = _Decoder(segs, rows, host_table(rows, body.device), words,
                                    body).run()
    failures.append(index_failures)
    return FlatIndices(flat, counts, sum(failures))


_COLUMNS = ("encoding", "first", "stride", "width", "second", "escape_bits", "low_width",
            "numel", "escapes", "bit_limit")
INDEX_SECTIONS = np.zeros(len(IndexEncoding), dtype=np.int64)
"""Per index encoding, its number of index sections."""
INDEX_SECTIONS[[IndexEncoding.INT32, IndexEncoding.INT64, IndexEncoding.BITMAP,
                 IndexEncoding.BOX]] = 1
INDEX_SECTIONS[[IndexEncoding.GAP8, IndexEncoding.ELIAS_FANO]] = 2
_STRIDES = np.zeros(len(IndexEncoding), dtype=np.int64)
"""Per index encoding, the bits between an entry's consecutive first-section fields
(0 where it has none at a fixed stride; Elias-Fano's is its low-bit width)."""
_STRIDES[[IndexEncoding.INT32, IndexEncoding.INT64, IndexEncoding.GAP8]] = 32, 64, BYTE_BITS


@attrs.frozen
class _Layout:
    """Per entry of a payload, as numpy columns: its header fields and the body bit
    offsets of its first, second and residue escape-position sections."""

    encoding: np.ndarray
    count: np.ndarray
    numel: np.ndarray
    width: np.ndarray
    escapes: np.ndarray
    value_escapes: np.ndarray
    residue: np.ndarray
    """Whether the entry's values are residues with escapes (a position section)."""
    first: np.ndarray
    second: np.ndarray
    positions: np.ndarray

    @classmethod
    def of(cls, header: Header) -> _Layout:
        c, sections = header.columns(), header.sections()
        offsets = sections.offsets * BYTE_BITS
        head = sections.firsts
        end = np.append(head[1:], offsets.size) - 1
        index_sections = INDEX_SECTIONS[c["index_encoding"]]
        # clamped to the entry's own sections: only entries that have the section use it
        return cls(c["index_encoding"], c["count"], c["numel"], c["index_width"],
                   c["index_escapes"], c["value_escapes"],
                   (c["value_encoding"] == RESIDUE) & (c["value_escapes"] > 0),
                   offsets[head],
                   np.where(index_sections > 1, offsets[np.minimum(head + 1, end)],
                            offsets[head]),
                   offsets[np.minimum(head + index_sections + 1, end)])

    def sparse_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The ``_COLUMNS`` rows of the sparse entries (columns x entries), and their
        element counts."""
        pick = IS_SPARSE[self.encoding]
        enc, numel, width = self.encoding[pick], self.numel[pick], self.width[pick]
        is_ef = enc == ELIAS_FANO
        stride = np.where(is_ef, width, _STRIDES[enc])
        limit = np.where(is_ef, self.count[pick] + ((np.maximum(numel, 1) - 1) >> width) + 1,
                         np.where(enc == BITMAP, numel, 0))
        raw_bits = np.where(numel < INDEX32_LIMIT, 32, 64)
        rows = np.stack([enc, self.first[pick], stride, stride, self.second[pick], raw_bits,
                         width, numel, self.escapes[pick], limit])
        return rows, self.count[pick]


class _Decoder:
    def __init__(self, segs: Segments, rows: np.ndarray, table: torch.Tensor,
                 words: torch.Tensor, body: torch.Tensor):
        self.segs, self.rows, self.table, self.words, self.body = segs, rows, table, words, body

    def col(self, name: str) -> torch.Tensor:
        return self.segs.spread(self.table[_COLUMNS.index(name)])

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        segs, rank = self.segs, self.segs.rank
        enc = self.col("encoding")
        first = read_fields(self.words, self.col("first") + rank * self.col("stride"),
                            self.col("width"))
        gap_idx, gap_failures = self._gaps(enc == IndexEncoding.GAP8, first)
        high, bit_failures = self._set_bits()
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

    def _set_bits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Elias-Fano upper streams and bitmaps: per element, its high part (Elias-Fano)
        or index (bitmap), and failed checks (set-bit counts, padding).

        Works on bytes, not bits: the stream bytes of all entries back to back, their
        set-bit counts and the prefix sum of those; element ``k`` of an entry is its
        entry's ``k``-th set bit, found by a binary search over the prefix sums and a
        table lookup inside the byte.
        """
        device, total = self.body.device, self.segs.total
        enc = self.rows[0]
        is_ef = enc == IndexEncoding.ELIAS_FANO
        picked = is_ef | (enc == IndexEncoding.BITMAP)
        limit = self.rows[9][picked]
        # per stream: bytes, bit limit, expected set bits, Elias-Fano, first byte
        rows = np.stack([-(-limit // BYTE_BITS), limit, np.asarray(self.segs.counts)[picked],
                         is_ef[picked], np.where(is_ef, self.rows[4], self.rows[1])[picked]
                         // BYTE_BITS]).T
        stream_of = np.where(picked, np.cumsum(picked) - 1, 0)
        zero = torch.zeros((), dtype=_INT64, device=device)
        if not rows.size:
            return torch.zeros(total, dtype=_INT64, device=device), zero
        streams = Segments.of(rows[:, 0].tolist(), device)
        table = host_table(rows.T, device)
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
        stream = self.segs.spread(host_table(stream_of[None], device)[0])
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


def _escape_columns(layout: _Layout, words: torch.Tensor
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``decode_kernel.escape_failures``'s arrays of the residue escape positions (None
    where there are none)."""
    pick = layout.residue
    if not pick.any():
        return None
    count = layout.count[pick]
    return (layout.value_escapes[pick], words.data_ptr() + layout.positions[pick] // BYTE_BITS,
            index_itemsizes(count), count)


def _escape_failures(layout: _Layout, words: torch.Tensor) -> torch.Tensor:
    """Residue escape positions that are out of ``[0, count)`` or not increasing."""
    pick = layout.residue
    if not pick.any():
        return torch.zeros((), dtype=_INT64, device=words.device)
    if fused(words.device):
        from .decode_kernel import escape_failures
        return escape_failures(*_escape_columns(layout, words), words.device)
    count = layout.count[pick]
    segs = Segments.of(layout.value_escapes[pick].tolist(), words.device)
    table = host_table(np.stack([count, layout.positions[pick],
                                 index_itemsizes(count) * BYTE_BITS]), words.device)
    count, start, bits = (segs.spread(table[k]) for k in range(3))
    positions = read_fields(words, start + segs.rank * bits, bits)
    previous = segs.previous(positions, -1)
    bad = (positions < 0) | (positions >= count) | ((segs.rank > 0) & (positions <= previous))
    return bad.sum()
