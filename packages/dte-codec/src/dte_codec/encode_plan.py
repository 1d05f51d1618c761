"""The flat encoder's host plan for every tensor at once: the encodings chosen from the
statistics (``encoding_choice``), the header entries, and the body layout the kernels write.

``Entry.section_sizes`` and the dense fallback follow in closed form from the choices;
the layout is a prefix sum over the aligned sections. What the plan needs from the change
counts alone is computed before the statistics arrive (``prepare``). What depends only on
the tensors (names, dtypes, shapes) is kept per tensor set (``tensor_set``, whose
``tensor_table`` a sync takes its changed rows from).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from .bits import BYTE_BITS, ceil_bytes
from .encoding_choice import IndexChoice, IndexSizes, ValueChoice, ValueSizes
from .encodings import (ALIGNMENT, DENSE, ELIAS_FANO, INDEX_ENCODINGS, RESIDUE, RESIDUE_DTYPES,
                        VALUE_ENCODINGS)
from .entry import Entry
from .entry_pack import FIELDS
from .fields import host_table

assert ALIGNMENT & (ALIGNMENT - 1) == 0, "sections are aligned with a mask"

_SECTIONS = 5
"""Section slots per entry: two of the index, three of the values (unused ones empty)."""


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
        """``COLUMNS`` as rows: what ranking escapes needs (both flat encoders)."""
        return np.stack([self.index.encoding, self.value.encoding, self.value.width])


@attrs.frozen(eq=False)
class Escapes:
    """The escapes' ranks that a flat encoder's ``count_escapes`` counted, in that
    encoder's form, for its ``write``: the order of the two steps travels as this value,
    not as state left on the encoder."""

    encoder: object
    """The flat encoder (``flat_encode.TorchFlat`` or ``encode_kernel.FusedFlat``)."""
    ranks: tuple[torch.Tensor, torch.Tensor]

    def ranks_for(self, encoder: object) -> tuple[torch.Tensor, torch.Tensor]:
        """``ranks``, which only the encoder that counted them can read (an internal
        invariant of the two steps: no input of a caller's reaches it)."""
        assert encoder is self.encoder, "escapes counted by another encoder"
        return self.ranks


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
            index = IndexChoice(np.where(dense, DENSE, index.encoding),
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
        sizes[:, 1] = (np.where(index.encoding == ELIAS_FANO, self.index.upper_bytes, 0)
                       + index.escapes * self.index.itemsize)  # escapes: GAP8's only
        sizes[:, 2] = np.where(value.encoding == RESIDUE,
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
        residue = value.encoding == RESIDUE
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
                       index_encoding=INDEX_ENCODINGS[ie], index_width=iw, index_escapes=ix,
                       value_encoding=VALUE_ENCODINGS[ve], value_width=vw, value_escapes=vx)
                 for name, dtype, shape, n, ie, iw, ix, ve, vw, vx in rows)
