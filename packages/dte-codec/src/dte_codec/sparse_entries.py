"""The sparse entries of a payload as the routing kernels read them (``routes``): numpy
columns of their header fields and the device addresses of their indices and value
sections, read from a payload decoded in one body or from per-entry tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from .entry import Entry
from .fields import WORD_BYTES, starts_of
from .flat_decode import IS_SPARSE, VALUE_SECTIONS

if TYPE_CHECKING:
    from .payload import Flat

Sparse = tuple[Entry, torch.Tensor, tuple[torch.Tensor, ...]]
"""A sparse entry of a payload: its entry, flat indices and value sections."""


@attrs.frozen
class SparseEntries:
    """Sparse entries of a payload as the kernels read them: numpy columns of their
    header fields and of the addresses of their indices and value sections."""

    names: tuple[str, ...]
    """The entries' tensor names."""
    columns: Mapping[str, np.ndarray]
    """``Header.columns`` of these entries."""
    index_at: np.ndarray
    index_size: np.ndarray
    value_at: np.ndarray
    """Three rows: raw values or residue fields, residue escape positions, escaped values."""
    fields_bytes: np.ndarray
    """Bytes of each entry's first value section."""
    keep: tuple[torch.Tensor, ...]
    """What the addresses point into."""
    device: torch.device

    @classmethod
    def of_flat(cls, flat: Flat) -> SparseEntries:
        """The sparse entries of a payload decoded in one body (``payload.Flat``)."""
        columns = flat.header.columns()
        picked = np.flatnonzero(IS_SPARSE[columns["index_encoding"]])
        counts = columns["count"][picked]
        indices = flat.indices.flat
        value_at, fields_bytes = flat.value_sections()
        body = flat.body.data_ptr()
        names = flat.header.names()
        if picked.size != len(names):  # else every entry is sparse: the columns as they are
            names = tuple(map(names.__getitem__, picked.tolist()))
            columns = {name: column[picked] for name, column in columns.items()}
        return cls(names, columns,
                   indices.data_ptr() + starts_of(counts) * indices.element_size(),
                   np.full(picked.size, indices.element_size(), dtype=np.int64),
                   body + value_at[:, picked], fields_bytes[picked], (indices, flat.body),
                   flat.body.device)

    @classmethod
    def of_tensors(cls, entries: Sequence[Sparse], device: torch.device) -> SparseEntries | None:
        """``entries`` moved to ``device`` (sections word aligned); None for indices that
        are not 1-D int32 or int64 and fields beyond int64."""
        if any(i.dim() != 1 or i.dtype not in (torch.int32, torch.int64) for _, i, _ in entries):
            return None
        indices = [i.to(device).contiguous() for _, i, _ in entries]
        sections = [tuple(_aligned(s.to(device)) for s in ss) for _, _, ss in entries]
        # an entry's missing sections point at its last one, as in payload.Flat
        value_at = np.array([[ss[min(k, len(ss) - 1)].data_ptr() for ss in sections]
                             for k in range(VALUE_SECTIONS)], dtype=np.int64).reshape(
                                 VALUE_SECTIONS, -1)
        from .entry_table import EntryTable
        table = EntryTable(tuple(e for e, _, _ in entries))
        if table.columns is None:
            return None
        return cls(tuple(e.name for e in table.entries), table.columns,
                   np.array([i.data_ptr() for i in indices], dtype=np.int64),
                   np.array([i.element_size() for i in indices], dtype=np.int64),
                   value_at, np.array([ss[0].numel() for ss in sections], dtype=np.int64),
                   tuple(indices) + tuple(s for ss in sections for s in ss), device)


def _aligned(section: torch.Tensor) -> torch.Tensor:
    """``section`` at a word-aligned address (the kernels read whole words)."""
    return section if section.data_ptr() % WORD_BYTES == 0 else section.clone()
