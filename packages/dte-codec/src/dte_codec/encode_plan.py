"""The flat encoder's host decisions for every tensor at once: encodings from the
statistics, the header entries, and the body layout the kernels write.

Each decision is the reference encoder's, computed with a few numpy ops over all tensors
instead of Python per tensor: ``choose_indices`` and ``choose_values`` (the one-tensor
case, which ``indices.encode_indices`` and ``values.encode_values`` call) pick the
smallest encoding with the reference's tie order; ``Entry.section_sizes`` and the dense
fallback follow in closed form; the layout is a prefix sum over the aligned sections.
Candidate sizes that need only the change counts (``IndexSizes``, ``ValueSizes``) are
computed before the statistics arrive (``prepare``), leaving comparisons for after.
What depends only on the tensors (names, dtypes, shapes) is kept per tensor set
(``tensor_set``, whose ``tensor_table`` a sync takes its changed rows from).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from .bits import BYTE_BITS, ceil_bytes
from .entry_pack import FIELDS
from .fields import host_table
from .encodings import (ALIGNMENT, INDEX32_LIMIT, RESIDUE_DTYPES, IndexEncoding, ValueEncoding,
                        index_itemsizes)
from .entry import Entry

assert ALIGNMENT & (ALIGNMENT - 1) == 0, "sections are aligned with a mask"

_NONE = np.iinfo(np.int64).max
"""The size of a candidate that is not allowed."""
_POWERS = np.left_shift(np.int64(1), np.arange(63, dtype=np.int64))
_SECTIONS = 5
"""Section slots per entry: two of the index, three of the values (unused ones empty)."""
_INDEX_ENCODINGS = {e.value: e for e in IndexEncoding}
_VALUE_ENCODINGS = {e.value: e for e in ValueEncoding}


_DENSE, _INT32, _INT64, _BITMAP, _GAP8, _ELIAS_FANO = (int(e) for e in (
    IndexEncoding.DENSE, IndexEncoding.INT32, IndexEncoding.INT64, IndexEncoding.BITMAP,
    IndexEncoding.GAP8, IndexEncoding.ELIAS_FANO))
_RAW, _RESIDUE = int(ValueEncoding.RAW), int(ValueEncoding.RESIDUE)
"""The encodings as plain ints: numpy compares an array with an int ten times faster than
with an ``IntEnum`` member."""


def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bits needed for each non-negative int64 (0 for 0), without floating point: how
    many powers of two are at most ``x``."""
    return np.searchsorted(_POWERS, x, side="right")


@attrs.frozen
class IndexChoice:
    encoding: np.ndarray
    width: np.ndarray
    escapes: np.ndarray


@attrs.frozen
class ValueChoice:
    encoding: np.ndarray
    width: np.ndarray
    escapes: np.ndarray


@attrs.frozen
class IndexSizes:
    """Per tensor, what its index encodings cost from its count and numel alone: every
    candidate but GAP8 (whose size needs the gaps over a byte), so that only a comparison
    is left once the statistics arrive."""

    count: np.ndarray
    itemsize: np.ndarray
    """Index itemsize of the tensor's numel (INT32 or INT64)."""
    low: np.ndarray
    """Elias-Fano low bits."""
    encoding: np.ndarray
    """The first smallest of raw, Elias-Fano and bitmap."""
    gap_limit: np.ndarray
    """GAP8 wins when its size is below this: it must beat raw strictly (raw comes
    first), and tie Elias-Fano and bitmap (it comes before them)."""
    upper_bytes: np.ndarray
    """Bytes of the Elias-Fano upper bits (its second section)."""
    by_encoding: np.ndarray
    """``(BY_ENCODING, encodings, tensors)``: per encoding value, the first section's
    bytes, the layout's ``width`` and ``stride`` of its fields and whether it has a
    second section (the plan reads a sparse entry's with one gather); DENSE's unused."""

    BY_ENCODING = ("first_bytes", "width", "stride", "two_sections")

    @classmethod
    def of(cls, count: np.ndarray, numel: np.ndarray) -> IndexSizes:
        size = index_itemsizes(numel)
        raw = count * size
        low = np.maximum(_bit_length(numel // np.maximum(count, 1)) - 1, 0)
        upper_bytes = ceil_bytes(count + ((numel - 1) >> low) + 1)
        low_bytes, map_bytes = ceil_bytes(count * low), ceil_bytes(numel)
        ef = low_bytes + upper_bytes
        bitmap = np.where(numel <= BYTE_BITS * raw, map_bytes, _NONE)
        other = np.minimum(ef, bitmap)
        raw_wins = raw <= other
        encoding = np.where(raw_wins, np.where(numel < INDEX32_LIMIT, _INT32, _INT64),
                            np.where(ef <= bitmap, _ELIAS_FANO, _BITMAP))
        raw_bits = size * BYTE_BITS
        by_encoding = np.zeros((len(cls.BY_ENCODING), len(_INDEX_ENCODINGS), len(count)),
                               np.int64)
        first, width, stride, two_sections = by_encoding
        first[[_INT32, _INT64]], width[[_INT32, _INT64]] = raw, raw_bits
        stride[[_INT32, _INT64]] = raw_bits
        first[_BITMAP], width[_BITMAP] = map_bytes, 1  # a bit at each index: stride 0
        first[_GAP8], width[_GAP8], stride[_GAP8] = count, BYTE_BITS, BYTE_BITS
        first[_ELIAS_FANO], width[_ELIAS_FANO], stride[_ELIAS_FANO] = low_bytes, low, low
        two_sections[[_GAP8, _ELIAS_FANO]] = 1
        return cls(count, size, low, encoding, np.where(raw_wins, raw, other + 1), upper_bytes,
                   by_encoding)

    def choose(self, gap_escapes: np.ndarray) -> IndexChoice:
        """The smallest encodings, given each tensor's gaps over a byte."""
        gap = self.count + gap_escapes * self.itemsize < self.gap_limit
        encoding = np.where(gap, _GAP8, self.encoding)
        return IndexChoice(encoding, np.where(encoding == _ELIAS_FANO, self.low, 0),
                           np.where(gap, gap_escapes, 0))


def choose_index_encodings(count: np.ndarray, numel: np.ndarray, *,
                           gap_escapes: np.ndarray) -> IndexChoice:
    """Per tensor, the smallest index encoding from sizes alone; ties go to INT32/INT64,
    then GAP8, then ELIAS_FANO, then BITMAP (the first smallest candidate)."""
    return IndexSizes.of(count, numel).choose(gap_escapes)


@attrs.frozen
class ValueSizes:
    """Per tensor, what its value encodings cost apart from the histogram: the raw size,
    and per residue width what an escape costs and whether the width is narrower than
    the dtype."""

    count: np.ndarray
    residue: np.ndarray
    raw: np.ndarray
    width: np.ndarray
    """The residue widths tried, ``1..bins-1`` (a row)."""
    position_size: np.ndarray
    """Bytes of an escape's position (the count's index itemsize)."""
    escape: np.ndarray
    """Bytes of one escape (position and raw value), a column."""
    escaped_all: np.ndarray
    """Bytes of every value escaped, a column."""
    barred: np.ndarray | None
    """The widths not narrower than the dtype (rows: tensors); None when there are none."""
    rows: np.ndarray
    """``0..tensors-1``."""

    @classmethod
    def of(cls, count: np.ndarray, itemsize: np.ndarray, residue: np.ndarray,
           bins: int) -> ValueSizes:
        width = np.arange(1, max(bins, 1), dtype=np.int64)
        position_size = index_itemsizes(count)
        escape = (position_size + itemsize)[:, None]
        barred = width >= itemsize[:, None] * BYTE_BITS
        return cls(count, residue, count * itemsize, width, position_size, escape,
                   count[:, None] * escape, barred if barred.any() else None,
                   np.arange(len(count)))

    def choose(self, hist: np.ndarray) -> ValueChoice:
        """RESIDUE at the width that makes the values smallest (the narrowest on a tie),
        or RAW when no width beats raw values or the dtype has no residues; ``hist``:
        per tensor (rows), how many values need each residue width ``0..bins-1``."""
        count = self.count
        if not len(self.width):
            zero = np.zeros_like(count)
            return ValueChoice(np.full_like(count, _RAW), zero, zero)
        covered = np.cumsum(hist[:, 1:], axis=1)
        sizes = ceil_bytes(covered * self.width) + (self.escaped_all - covered * self.escape)
        if self.barred is not None:
            sizes[self.barred] = _NONE
        at = sizes.argmin(1)
        chosen = self.residue & (sizes[self.rows, at] < self.raw)
        escapes = count - hist[:, 0] - covered[self.rows, at]
        return ValueChoice(np.where(chosen, _RESIDUE, _RAW), np.where(chosen, at + 1, 0),
                           np.where(chosen, escapes, 0))


def choose_value_encodings(count: np.ndarray, itemsize: np.ndarray, residue: np.ndarray,
                           hist: np.ndarray) -> ValueChoice:
    """Per tensor (rows of ``hist``: how many values need each residue width), RESIDUE at
    the width that makes the values smallest (the narrowest on a tie), or RAW when no
    width beats raw values or the dtype has no residues."""
    return ValueSizes.of(count, itemsize, residue, hist.shape[1]).choose(hist)


def choose_indices(count: int, numel: int, *, gap_escapes: int) -> dict[str, object]:
    """Header fields of the smallest index encoding of one tensor
    (``choose_index_encodings``)."""
    c = choose_index_encodings(np.array([count]), np.array([numel]),
                               gap_escapes=np.array([gap_escapes]))
    return {"index_encoding": IndexEncoding(int(c.encoding[0])), "index_width": int(c.width[0]),
            "index_escapes": int(c.escapes[0])}


def choose_values(count: int, dtype: torch.dtype, itemsize: int,
                  hist: Sequence[int]) -> dict[str, object]:
    """Header fields of the smallest value encoding of one tensor, from the histogram of
    the residue width each value needs (``choose_value_encodings``); empty for RAW."""
    if dtype not in RESIDUE_DTYPES:
        return {}
    row = np.zeros((1, max(len(hist), itemsize * BYTE_BITS)), dtype=np.int64)
    row[0, :len(hist)] = hist
    c = choose_value_encodings(np.array([count]), np.array([itemsize]), np.array([True]), row)
    if c.encoding[0] == ValueEncoding.RAW:
        return {}
    return {"value_encoding": ValueEncoding.RESIDUE, "value_width": int(c.width[0]),
            "value_escapes": int(c.escapes[0])}


@attrs.frozen(eq=False)
class TensorTable:
    """What the plan needs of a set of tensors that does not change between syncs."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: np.ndarray
    itemsize: np.ndarray
    residue: np.ndarray

    def take(self, rows: np.ndarray) -> TensorTable:
        """The table of the tensors ``rows`` (an int array), in that order."""
        if len(rows) == len(self.names) and (rows == np.arange(len(rows))).all():
            return self  # every tensor: no tuple rebuilt per sync
        picked = rows.tolist()
        return TensorTable(tuple(self.names[r] for r in picked),
                           tuple(self.dtypes[r] for r in picked),
                           tuple(self.shapes[r] for r in picked), self.numel[rows],
                           self.itemsize[rows], self.residue[rows])


def tensor_table(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> TensorTable:
    """The table of ``(name, dtype, shape)`` triples."""
    names, dtypes, shapes = zip(*tensors) if tensors else ((), (), ())
    return TensorTable(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes),
                       np.array([int(np.prod(s, dtype=np.int64)) for s in shapes], np.int64),
                       np.array([d.itemsize for d in dtypes], np.int64),
                       np.array([d in RESIDUE_DTYPES for d in dtypes], bool))


@attrs.frozen
class Layout:
    """Per entry, where and how wide each field goes, as one table on the device."""

    table: torch.Tensor
    dense_offsets: np.ndarray
    """Per entry, the byte offset of a dense entry's values; -1 for the others."""
    size: int
    """The body's size in bytes (``Header.body_size``)."""

    COLUMNS = ("index_encoding", "first", "stride", "width", "second", "escape_bits",
               "low_width", "value_encoding", "value_width", "fields", "positions",
               "position_bits", "raw")

    def column(self, segs):
        """Per element of the flat space ``segs`` (``fields.Segments``), a column."""
        def gather(name: str) -> torch.Tensor:
            return segs.spread(self.table[self.COLUMNS.index(name)])
        return gather


@attrs.frozen
class Plan:
    """The entries the reference encoder would write, as columns, and where their fields
    go."""

    table: TensorTable
    count: np.ndarray
    index: IndexChoice
    value: ValueChoice
    layout: Layout

    def entries(self) -> tuple[Entry, ...]:
        """The entries as ``Entry`` objects."""
        return _entries(self.table, self.count, self.index, self.value)

    def fields(self) -> np.ndarray:
        """The entries' per-sync fields as ``entry_pack.FIELDS`` records."""
        fields = np.zeros(len(self.count), FIELDS)
        for name, column in (("count", self.count), ("index_encoding", self.index.encoding),
                             ("index_width", self.index.width),
                             ("index_escapes", self.index.escapes),
                             ("value_encoding", self.value.encoding),
                             ("value_width", self.value.width),
                             ("value_escapes", self.value.escapes)):
            fields[name] = column
        return fields


@attrs.frozen
class Choice:
    """Per tensor, its smallest sparse encodings (the dense fallback not yet applied)."""

    index: IndexChoice
    value: ValueChoice

    COLUMNS = ("index_encoding", "value_encoding", "value_width")

    def columns(self) -> np.ndarray:
        """``COLUMNS`` as rows: what ranking escapes needs (``encode_kernel``)."""
        return np.stack([self.index.encoding, self.value.encoding, self.value.width])


@attrs.frozen
class Counted:
    """What the plan of one payload needs from its tensors and their change counts alone,
    computed while the device gathers the statistics (``prepare``)."""

    table: TensorTable
    count: np.ndarray
    index: IndexSizes
    value: ValueSizes

    def choose(self, *, gap_escapes: np.ndarray, hist: np.ndarray) -> Choice:
        """The smallest sparse encodings from the statistics: gaps over a byte and
        residue-width histograms (rows, ``bins`` columns)."""
        return Choice(self.index.choose(gap_escapes), self.value.choose(hist))

    def plan(self, choice: Choice, *, device: torch.device) -> Plan:
        """The plan of the encodings ``choice`` (``choose``): the dense fallback, the
        entries and the layout."""
        table, count = self.table, self.count
        index, value = choice.index, choice.value
        by_encoding = self.index.by_encoding[:, index.encoding, self.value.rows]
        sizes = self._section_sizes(index, value, by_encoding[0])
        dense_bytes = table.numel * table.itemsize
        dense = sizes.sum(1) >= dense_bytes
        if dense.any():  # usually none: a delta is sent because it is sparse
            keep = ~dense
            count = np.where(dense, table.numel, count)
            index = IndexChoice(np.where(dense, _DENSE, index.encoding),
                                index.width * keep, index.escapes * keep)
            value = ValueChoice(value.encoding * keep, value.width * keep, value.escapes * keep)
            sizes = np.where(dense[:, None], 0, sizes)
            sizes[:, 2] = np.where(dense, dense_bytes, sizes[:, 2])
        aligned = (sizes + (ALIGNMENT - 1)) & -ALIGNMENT  # ALIGNMENT: a power of two
        ends = np.cumsum(aligned.reshape(-1)).reshape(aligned.shape)
        starts = (ends - aligned) * BYTE_BITS
        columns = self._columns(index, value, by_encoding, starts, dense)
        layout = Layout(host_table(columns, device),
                        np.where(dense, starts[:, 0] // BYTE_BITS, -1),
                        int(ends[-1, -1]) if len(ends) else 0)
        return Plan(table, count, index, value, layout)

    def _section_sizes(self, index: IndexChoice, value: ValueChoice,
                       first: np.ndarray) -> np.ndarray:
        """``Entry.section_sizes`` of every sparse entry, in ``_SECTIONS`` slots (bytes);
        ``first``: the index encodings' first sections."""
        count, escapes = self.count, value.escapes
        sizes = np.empty((len(count), _SECTIONS), np.int64)
        sizes[:, 0] = first
        sizes[:, 1] = (np.where(index.encoding == _ELIAS_FANO, self.index.upper_bytes, 0)
                       + index.escapes * self.index.itemsize)  # escapes: GAP8's only
        sizes[:, 2] = np.where(value.encoding == _RESIDUE,
                               ceil_bytes((count - escapes) * value.width), self.value.raw)
        sizes[:, 3] = escapes * self.value.position_size
        sizes[:, 4] = escapes * self.table.itemsize
        return sizes

    def _columns(self, index: IndexChoice, value: ValueChoice, by_encoding: np.ndarray,
                 starts: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """``Layout.COLUMNS`` of every entry; ``starts``: section starts in bits;
        ``by_encoding``: ``IndexSizes.BY_ENCODING`` of each entry's index encoding."""
        _, width, stride, two_sections = by_encoding
        sparse = ~dense
        first, fields = starts[:, 0], starts[:, 2]
        residue = value.encoding == _RESIDUE
        rows = (np.where(dense, -1, index.encoding), first,
                np.where(dense, self.table.itemsize * BYTE_BITS, stride), width * sparse,
                np.where(two_sections.astype(bool) & sparse, starts[:, 1], first),
                self.index.itemsize * BYTE_BITS * sparse, index.width,
                np.where(dense, -1, value.encoding), value.width, fields,
                np.where(residue, starts[:, 3], fields),
                self.value.position_size * BYTE_BITS * sparse,
                np.where(residue, starts[:, 4], fields))
        columns = np.empty((len(rows), len(self.count)), np.int64)
        for at, row in enumerate(rows):
            columns[at] = row
        return columns


def prepare(table: TensorTable, count: np.ndarray, bins: int) -> Counted:
    """What the plan of a payload of ``table``'s tensors with ``count`` changes each
    needs before the statistics (histograms of ``bins`` residue widths) arrive."""
    return Counted(table, count, IndexSizes.of(count, table.numel),
                   ValueSizes.of(count, table.itemsize, table.residue, bins))


def plan(table: TensorTable, count: np.ndarray, *, gap_escapes: np.ndarray, hist: np.ndarray,
         device: torch.device) -> Plan:
    """The plan of one payload from the per-tensor statistics: change counts, gaps over a
    byte and residue-width histograms (rows)."""
    counted = prepare(table, count, hist.shape[1])
    return counted.plan(counted.choose(gap_escapes=gap_escapes, hist=hist), device=device)


def _entries(table: TensorTable, count: np.ndarray, index: IndexChoice,
             value: ValueChoice) -> tuple[Entry, ...]:
    rows = zip(table.names, table.dtypes, table.shapes, *(x.tolist() for x in (
        count, index.encoding, index.width, index.escapes, value.encoding, value.width,
        value.escapes)))
    return tuple(Entry(name=name, dtype=dtype, shape=shape, count=n,
                       index_encoding=_INDEX_ENCODINGS[ie], index_width=iw, index_escapes=ix,
                       value_encoding=_VALUE_ENCODINGS[ve], value_width=vw, value_escapes=vx)
                 for name, dtype, shape, n, ie, iw, ix, ve, vw, vx in rows)
