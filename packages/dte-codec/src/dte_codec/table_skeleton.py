"""A delta's entry table read as numpy columns when its skeleton repeats.

A stream sends the same tensors sync after sync: the names, dtypes and shapes of a
delta's entries (and the reserved field, zero) sit at the same byte offsets in every
table of that stream; only the count, encodings, widths and escape counts move. A
``Skeleton`` keeps those static bytes and the offsets of the varying fields from a table
read field by field; a later table of the same size and entry count whose static bytes
are equal (one comparison) gives its varying fields as columns read at known offsets,
with no Python per entry. Anything else (other static bytes, an encoding code no enum
has, a field beyond the columns' range) is left to the field by field reading, which
names what is wrong. ``Entry`` objects are built from the columns only when asked for
(``Entries``): the reference paths and the error messages read them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from .bits import BYTE_BITS
from .encodings import (BOX_FIELD_BYTES, INDEX32_LIMIT, MAX_NDIM, RESIDUE_DTYPES, SIZE_LIMIT,
                        IndexEncoding, ValueEncoding, index_itemsizes)
from .entry import Entry
from .table_bytes import ENTRY_FIELDS, NAME_LENGTH

_FIELD_BYTES = ENTRY_FIELDS.size
_BYTE_FIELDS = {"index_encoding": 2, "value_encoding": 3, "index_width": 4, "value_width": 5}
"""Offsets of the one-byte varying fields inside an entry's fields (``ENTRY_FIELDS``)."""
_BYTES_AT = slice(min(_BYTE_FIELDS.values()), max(_BYTE_FIELDS.values()) + 1)
"""The one-byte varying fields lie back to back, in ``_BYTE_FIELDS``' order."""
assert list(_BYTE_FIELDS.values()) == list(range(_BYTES_AT.start, _BYTES_AT.stop))
_WORD_FIELDS = ("count", "index_escapes", "value_escapes")
_WORDS_AT = 8
"""Offset of the three u64 varying fields, back to back, inside an entry's fields."""
_FIELD_LIMIT = SIZE_LIMIT
"""Counts and escape counts the columns hold; larger ones (never valid: numel < 2**62)
are judged by the entries."""


def static_columns(ndim: np.ndarray, numel: np.ndarray, dtypes: Sequence[torch.dtype]
                   ) -> dict[str, np.ndarray]:
    """The columns of a table that its tensors decide (int64 ``ndim`` and ``numel``, and
    ``dtypes``), with what the checks and section sizes derive from them alone: kept
    with a skeleton, they cost nothing per sync."""
    itemsize = np.array([d.itemsize for d in dtypes], dtype=np.int64)
    return {"ndim": ndim, "numel": numel,
            "itemsize": itemsize,
            "residue_dtype": np.array([d in RESIDUE_DTYPES for d in dtypes], dtype=bool),
            "shape_fits": (ndim <= MAX_NDIM) & (numel < SIZE_LIMIT),
            "index32_fits": numel < INDEX32_LIMIT,
            "max_value_width": itemsize * BYTE_BITS - 1,
            "bitmap_bytes": -(-numel // 8),  # a division: numel may reach 2**63 here
            "box_bytes": 2 * ndim * BOX_FIELD_BYTES,
            "numel_itemsize": index_itemsizes(numel),
            "numel_top": np.maximum(numel, 1) - 1}


class Skeleton:
    """The static part of a delta's entry table: its bytes, the tensors they name and
    where each entry's varying fields lie. One object per table shape: headers read
    through the same skeleton name the same tensors, in the same order."""

    def __init__(self, entries: Sequence[Entry], table: bytes):
        """The skeleton of ``table``, which a field by field reading parsed into
        ``entries``."""
        self.names = tuple(e.name for e in entries)
        self.dtypes = tuple(e.dtype for e in entries)
        self.shapes = tuple(e.shape for e in entries)
        self.unique_names = len(set(self.names)) == len(self.names)
        """No tensor has two entries (so entries never overlap each other)."""
        fields_at, pos = [], 0
        for entry in entries:
            pos += NAME_LENGTH.size + len(entry.name.encode())
            fields_at.append(pos)
            pos += _FIELD_BYTES + 8 * len(entry.shape)
        self.fields_at = np.array(fields_at, dtype=np.int64)
        varying = np.concatenate(
            [list(_BYTE_FIELDS.values()), np.arange(_WORDS_AT, _FIELD_BYTES)])
        # the table with its varying bytes masked to zero: a later table of this skeleton
        # masked the same way equals it (one pass over the bytes, no gather)
        self._mask = np.full(len(table), 0xFF, dtype=np.uint8)
        self._mask[(self.fields_at[:, None] + varying).ravel()] = 0
        self._static = np.frombuffer(table, dtype=np.uint8) & self._mask
        self._fields = self.fields_at[:, None] + np.arange(_FIELD_BYTES)
        self._columns = static_columns(
            np.array([len(s) for s in self.shapes], dtype=np.int64),
            np.array([e.numel for e in entries], dtype=np.int64), self.dtypes)

    @staticmethod
    def holds(entries: Sequence[Entry]) -> bool:
        """Whether the columns can hold these entries' sizes (every tensor under 2**62
        elements; larger ones are judged entry by entry)."""
        return all(e.numel < _FIELD_LIMIT for e in entries)

    def read(self, table: bytes) -> dict[str, np.ndarray] | None:
        """``EntryTable.columns`` of ``table`` (as long as this skeleton's), or None
        where its static bytes differ or a field needs the field by field reading."""
        data = np.frombuffer(table, dtype=np.uint8)
        if not np.array_equal(data & self._mask, self._static):
            return None
        fields = data[self._fields]
        words = np.ascontiguousarray(fields[:, _WORDS_AT:]).view("<u8")
        small = fields[:, _BYTES_AT].astype(np.int64)
        if (words.max(initial=0) >= _FIELD_LIMIT
                or small[:, 0].max(initial=0) >= len(IndexEncoding)
                or small[:, 1].max(initial=0) >= len(ValueEncoding)):
            return None
        columns = dict(zip(_BYTE_FIELDS, small.T)) | dict(zip(_WORD_FIELDS,
                                                              words.astype(np.int64).T))
        return columns | self._columns


class Entries(Sequence[Entry]):
    """A table's entries, made from a skeleton and the columns read through it: each
    ``Entry`` is built when first asked for. Equal to (and hashed as) the tuple of them."""

    def __init__(self, skeleton: Skeleton, columns: dict[str, np.ndarray],
                 made: Sequence[Entry] = ()):
        """``made``: all the entries, where they were already built."""
        self.skeleton = skeleton
        self.columns = columns
        self._made: list[Entry | None] = list(made) or [None] * len(skeleton.names)

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self._all[k]
        entry = self._made[k]
        if entry is None:
            entry = self._made[k] = self._entry(k)
        return entry

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._all)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Entries, tuple)):
            return self._all == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all)

    def __repr__(self) -> str:
        return f"Entries({len(self)} of {self.skeleton.names[:3]}...)"

    @functools.cached_property
    def _all(self) -> tuple[Entry, ...]:
        return tuple(self[k] for k in range(len(self)))

    def _entry(self, k: int) -> Entry:
        s, c = self.skeleton, self.columns
        dtype: torch.dtype = s.dtypes[k]
        return Entry(name=s.names[k], dtype=dtype, shape=s.shapes[k], count=int(c["count"][k]),
                     index_encoding=IndexEncoding(int(c["index_encoding"][k])),
                     index_width=int(c["index_width"][k]),
                     index_escapes=int(c["index_escapes"][k]),
                     value_encoding=ValueEncoding(int(c["value_encoding"][k])),
                     value_width=int(c["value_width"][k]),
                     value_escapes=int(c["value_escapes"][k]))
