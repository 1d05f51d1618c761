"""A header's entry table as columns: its validity and its section sizes for all entries
at once.

A delta's table differs from sync to sync (counts, encodings), so the header caches miss
and each side checks and sizes the whole table every sync. ``Entry.validate`` and
``Entry.section_sizes`` stay the definition: the columns are a fast path that answers
"all valid" or gives way to them (which then raise the first failure, in order), and
sizes are taken from them for tables the fast path cannot hold exactly.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

import attrs
import numpy as np

from .bits import ceil_bytes
from .encodings import (BITMAP, BOX, DENSE, ELIAS_FANO, GAP8, INT32, INT64, RAW, RESIDUE,
                        IndexEncoding, Kind, align, index_itemsizes)
from .entry import Entry
from .fields import starts_of
from .table_skeleton import Entries, static_columns

EXACT_NUMEL = 2**40
"""Largest tensor (exclusive) whose section sizes the columns compute: every size and
their sum over up to ``EXACT_ENTRIES`` entries then stays far inside int64."""
EXACT_ENTRIES = 2**20


def _ints(values: np.ndarray | tuple[int, ...]) -> tuple[int, ...]:
    return values if isinstance(values, tuple) else tuple(values.tolist())


@attrs.frozen
class Sections:
    """The unpadded byte sizes of every section of a table, in body order, and how many
    sections each entry has: int64 arrays where the columns computed them (what the
    batched decoder reads, with no Python int per section), Python ints where the
    entries did (sizes beyond int64 are possible there until a body bounds them). Equal
    by their sizes as ints, however they are held (no sync compares or hashes them)."""

    _sizes: np.ndarray | tuple[int, ...] = attrs.field(eq=_ints)
    _per_entry: np.ndarray | tuple[int, ...] = attrs.field(eq=_ints)
    body_size: int
    """Bytes of all sections, each padded to the alignment."""

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return _ints(self._sizes)

    @functools.cached_property
    def per_entry(self) -> tuple[int, ...]:
        return _ints(self._per_entry)

    @functools.cached_property
    def size_array(self) -> np.ndarray:
        """``sizes`` as int64 (read only once the header's body length has matched a real
        body, which bounds them)."""
        return np.asarray(self._sizes, dtype=np.int64)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Each section's byte offset in the body (int64, as ``size_array``)."""
        return starts_of(align(self.size_array))

    @functools.cached_property
    def firsts(self) -> np.ndarray:
        """Each entry's first section, as a position in ``sizes``."""
        return starts_of(np.asarray(self._per_entry, dtype=np.int64))


class EntryTable:
    """The entries' fields as int64 columns (``None`` columns: a field beyond int64 or
    not an integer, which only the per-entry path judges)."""

    def __init__(self, entries: Sequence[Entry]):
        self.entries = entries
        # a table read through its skeleton comes with its columns
        self.columns = entries.columns if isinstance(entries, Entries) else _columns(entries)
        self._passed: set[Kind] = set()

    def validate(self, kind: Kind) -> None:
        """``Entry.validate(kind)`` of every entry, in order (remembered once passed)."""
        if kind in self._passed:
            return
        if not self.valid(kind):
            for entry in self.entries:
                entry.validate(kind)
        self._passed.add(kind)

    def valid(self, kind: Kind) -> bool:
        """Whether every entry passes ``Entry.validate(kind)`` (False also when the
        columns cannot tell: the caller then asks the entries)."""
        if self.columns is None:
            return False
        c = self.columns
        n, numel, ie, ve = c["count"], c["numel"], c["index_encoding"], c["value_encoding"]
        dense = ie == DENSE
        block = dense | (ie == BOX)
        residue = ve == RESIDUE
        ok = (c["shape_fits"] & (n <= numel)
              & (block | (kind == Kind.DELTA)) & (~dense | (n == numel)) & (dense | (n >= 1))
              & (~block | (ve == RAW))
              & ((ie != INT32) | c["index32_fits"])
              & (c["index_escapes"] <= n)
              & ((ie == GAP8) | (c["index_escapes"] == 0))
              & (c["index_width"] <= 62)
              & ((ie == ELIAS_FANO) | (c["index_width"] == 0))
              & (~residue | c["residue_dtype"])
              & np.where(residue, (c["value_width"] >= 1)
                         & (c["value_width"] <= c["max_value_width"]), c["value_width"] == 0)
              & (c["value_escapes"] <= n) & (residue | (c["value_escapes"] == 0))
              # negative fields (no reader makes them) are left to the entries to judge
              & (ie >= 0) & (ve >= 0) & (c["index_escapes"] >= 0) & (c["value_escapes"] >= 0)
              & (c["index_width"] >= 0))
        return bool(ok.all())

    @functools.cached_property
    def sections(self) -> Sections:
        """``Entry.section_sizes`` of each entry, in order (from the columns for a valid
        table of tensors under ``EXACT_NUMEL`` elements)."""
        c = self.columns
        valid = Kind.DELTA in self._passed or self.valid(Kind.DELTA)  # validated: known
        if (not valid or len(self.entries) >= EXACT_ENTRIES
                or (len(self.entries) and int(c["numel"].max()) >= EXACT_NUMEL)):
            sizes = [e.section_sizes() for e in self.entries]
            return Sections(tuple(s for entry in sizes for s in entry), tuple(map(len, sizes)),
                            sum(e.body_bytes for e in self.entries))
        slots = _slots(c)
        present = slots >= 0
        sizes = slots[present]
        return Sections(sizes, present.sum(axis=1), int(align(sizes).sum()))


_FIELDS = ("count", "index_encoding", "index_width", "index_escapes", "value_encoding",
           "value_width", "value_escapes")
_fields_of = operator.attrgetter(*_FIELDS)


def _columns(entries: Sequence[Entry]) -> dict[str, np.ndarray] | None:
    if not entries:
        empty = np.zeros(0, np.int64)
        return {name: empty for name in _FIELDS} | static_columns(empty, empty, ())
    # numpy makes int64 of Python ints (and int enums) inside int64 and something else of
    # anything else (larger ints, floats, None): those entries go the per-entry way
    fields = np.array([_fields_of(e) for e in entries])
    shapes = np.array([(len(e.shape), math.prod(e.shape)) for e in entries])
    if fields.dtype != np.int64 or shapes.dtype != np.int64:
        return None
    return dict(zip(_FIELDS, fields.T)) | static_columns(*shapes.T, [e.dtype for e in entries])


def _slots(c: dict[str, np.ndarray]) -> np.ndarray:
    """(entries, 5) section sizes: two index sections, then three value sections, -1
    where an entry has no such section (for valid columns: every encoding code known,
    every size a non-negative int64 far from overflow)."""
    n, ie, width, none = c["count"], c["index_encoding"], c["index_width"], -1
    slots = np.empty((len(n), 5), np.int64)
    # the candidates of every encoding, chosen by its code in one pass
    np.choose(ie, _by_code(
        {DENSE: none, INT32: n * 4, INT64: n * 8, BITMAP: c["bitmap_bytes"], GAP8: n,
         ELIAS_FANO: ceil_bytes(n * width), BOX: c["box_bytes"]}), out=slots[:, 0])
    upper = ceil_bytes(n + (c["numel_top"] >> width) + 1)
    slots[:, 1] = np.where(ie == GAP8, c["index_escapes"] * c["numel_itemsize"],
                           np.where(ie == ELIAS_FANO, upper, none))
    residue = c["value_encoding"] == RESIDUE
    esc, itemsize = c["value_escapes"], c["itemsize"]
    slots[:, 2] = np.where(residue, ceil_bytes((n - esc) * c["value_width"]),
                           n * itemsize)
    slots[:, 3] = np.where(residue, esc * index_itemsizes(n), none)
    slots[:, 4] = np.where(residue, esc * itemsize, none)
    return slots


def _by_code(candidates: dict[int, np.ndarray]) -> list[np.ndarray]:
    """``candidates`` of every ``IndexEncoding``, in code order."""
    return [candidates[code] for code in range(len(IndexEncoding))]
