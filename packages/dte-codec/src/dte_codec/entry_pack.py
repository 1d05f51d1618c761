"""A delta's packed entry table, written from per-entry columns.

An entry's bytes (``FORMAT.md``) are its name, dtype and dimensions, which belong to the
tensor, around the fields that change from sync to sync (encodings, widths, count,
escapes). ``EntryTemplates`` packs every tensor's entry once with those fields zero; a
sync joins the templates of the tensors it carries and writes all their fields with one
numpy assignment, instead of packing an ``Entry`` per tensor. The bytes are
``Header.pack``'s (``table_bytes.pack_entry``), which the codec tests compare.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .entry import Entry
from .fields import starts_of
from .table_bytes import NAME_LENGTH, pack_entry

FIELDS = np.dtype([("index_encoding", "u1"), ("value_encoding", "u1"), ("index_width", "u1"),
                   ("value_width", "u1"), ("reserved", "<u2"), ("count", "<u8"),
                   ("index_escapes", "<u8"), ("value_escapes", "<u8")])
"""The fields of an entry after its dtype and ndim bytes, in their packed order."""
_AFTER_NAME = 2
"""The dtype and ndim bytes, between the name and ``FIELDS``."""


class EntryTemplates:
    """Every tensor's packed entry with its per-sync fields zero, and where they go."""

    def __init__(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                 shapes: Sequence[tuple[int, ...]]):
        self.templates = [pack_entry(Entry(name=n, dtype=d, shape=tuple(s), count=0))
                          for n, d, s in zip(names, dtypes, shapes)]
        self.sizes = np.array([len(t) for t in self.templates], np.int64)
        self.fields_at = np.array([NAME_LENGTH.size + len(n.encode()) + _AFTER_NAME
                                   for n in names], np.int64)

    def pack(self, rows: np.ndarray, fields: np.ndarray) -> bytes:
        """The entries of tensors ``rows`` (in order) with ``fields`` (a ``FIELDS``
        record per row)."""
        if not len(rows):
            return b""
        table = np.frombuffer(bytearray(b"".join([self.templates[r] for r in rows.tolist()])),
                              np.uint8)
        at = starts_of(self.sizes[rows]) + self.fields_at[rows]
        table[at[:, None] + np.arange(FIELDS.itemsize)] = fields.view(np.uint8).reshape(
            len(rows), FIELDS.itemsize)
        return table.tobytes()
