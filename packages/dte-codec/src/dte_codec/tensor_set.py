"""What the encoders need of a set of tensors that does not change from sync to sync,
built once per set and kept across syncs.

A sender encodes the same tensors sync after sync, so their names, dtypes, shapes,
addresses and the header bytes that follow from them are computed once
(``TensorSet``); a sync only checks that the set is still the one it was built for, with
one pass per attribute over the tensors (addresses, shapes, dtypes, devices,
contiguity). A tensor replaced (another storage), resized, re-typed or made
non-contiguous fails that check and the set is rebuilt; values written in place change
nothing here, since nothing here depends on them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import torch

from .bits import BYTE_BITS
from .encode_plan import TensorTable, tensor_table
from .encodings import DTYPE_CODES, MAX_NDIM
from .entry_pack import EntryTemplates
from .header import MAX_NAME_BYTES

SET_CACHE = 4
"""Tensor sets remembered (by their names): a process may send a few streams."""


@attrs.frozen
class Key:
    """Per tensor, what a set's cached facts depend on; equal keys: the same facts (the
    generated ``==`` compares the lists field by field, stopping at the first unequal
    one: as fast as spelled out by hand, 10 us for 290 tensors)."""

    pointers: list[int]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    devices: list[torch.device]
    contiguous: list[bool]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Key:
        return cls([t.data_ptr() for t in tensors], [t.shape for t in tensors],
                   [t.dtype for t in tensors], [t.device for t in tensors],
                   [t.is_contiguous() for t in tensors])


@attrs.frozen(eq=False, slots=False)
class TensorSet:
    """The facts of one set of tensors, in the mapping's order."""

    key: Key
    table: TensorTable
    """Names, dtypes, shapes and numpy columns of numel, itemsize and residue flags."""
    pointer: np.ndarray
    encodable: np.ndarray
    """Whether a delta entry of the tensor fits the format (name length, dtype, ndim) and
    the tensor has elements; the others send the encoder down the reference path."""
    device: torch.device | None
    """The device of every tensor, or None when they are spread over several."""
    caches: dict = attrs.field(factory=dict, init=False, repr=False)
    """What encoders keep of this set, by their type (``encode.FullLayout``)."""

    @property
    def names(self) -> tuple[str, ...]:
        return self.table.names

    @functools.cached_property
    def bits(self) -> np.ndarray:
        return self.table.itemsize * BYTE_BITS

    @functools.cached_property
    def contiguous(self) -> bool:
        return all(self.key.contiguous)

    @functools.cached_property
    def dtype_ids(self) -> dict[torch.dtype, int]:
        """A number per dtype of the set."""
        return {dtype: k for k, dtype in enumerate(dict.fromkeys(self.table.dtypes))}

    @functools.cached_property
    def dtype_column(self) -> np.ndarray:
        """Per tensor, its dtype's number (``dtype_ids``)."""
        ids = self.dtype_ids
        return np.array([ids[dtype] for dtype in self.table.dtypes], np.int64)

    @functools.cached_property
    def row(self) -> dict[str, int]:
        """Each tensor's position, by name."""
        return {name: r for r, name in enumerate(self.table.names)}

    def rows(self, names: Sequence[str]) -> np.ndarray:
        """The positions of tensors ``names``."""
        row = self.row
        return np.fromiter((row[name] for name in names), np.int64, len(names))

    @functools.cached_property
    def templates(self) -> EntryTemplates:
        """Every tensor's packed delta entry, its per-sync fields left to fill."""
        return EntryTemplates(self.table.names, self.table.dtypes, self.table.shapes)


_sets: dict[tuple[str, ...], TensorSet] = {}


def tensor_set(tensors: Mapping[str, torch.Tensor]) -> TensorSet:
    """The facts of ``tensors``: the ones built before when the set is unchanged, else
    new ones (replacing those of a set under the same names)."""
    names, values = tuple(tensors), list(tensors.values())
    key = Key.of(values)
    known = _sets.get(names)
    if known is not None and known.key == key:
        return known
    built = _build(names, key)
    _sets.pop(names, None)
    if len(_sets) >= SET_CACHE:
        _sets.pop(next(iter(_sets)))  # the oldest
    _sets[names] = built
    return built


def _build(names: tuple[str, ...], key: Key) -> TensorSet:
    table = tensor_table(list(zip(names, key.dtypes, key.shapes)))
    encodable = np.array([len(n.encode()) <= MAX_NAME_BYTES and d in DTYPE_CODES
                          and len(s) <= MAX_NDIM for n, d, s in zip(names, key.dtypes, key.shapes)],
                         bool) & (table.numel > 0)
    devices = set(key.devices)
    return TensorSet(key, table, np.array(key.pointers, np.int64), encodable,
                     devices.pop() if len(devices) == 1 else None)
