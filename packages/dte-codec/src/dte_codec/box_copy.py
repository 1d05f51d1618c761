"""Box entries of a full version written into local tensors by one launch per item size.

A ``Cut`` says: the box ``inside`` of entry ``entry``'s values (laid out as the entry's
box, ``shape``) goes to the box ``local`` of local tensor ``tensor``; both boxes have the
same shape once their size-1 dimensions are dropped. ``CopyPlan.of`` turns the cuts of a
payload's entries into device tables once (the cuts, their strides, the chunks the
kernel's programs take, ``box_copy_kernel``); ``StagedCopies`` then writes a payload with
those entries by passing only the addresses of its value sections and of the local
tensors. The reference is one ``copy_`` per cut (``apply.Staged``); both write the same
bits, as neither converts items.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import attrs
import torch

from .dispatch import on_device
from .fields import host_table
from .region import Box
from .remap import _strides

_DIMS = 3
"""Dimensions a copy has once size-1 ones are dropped and contiguous ones merged."""
_CHUNK = 1 << 16
"""Elements per program: whole rows up to this many, else part of one row."""


@attrs.frozen
class Cut:
    """The box ``inside`` of entry ``entry``'s values (shaped ``shape``) goes to the box
    ``local`` of local tensor ``tensor`` (shaped ``local_shape``)."""

    entry: int
    tensor: str
    inside: Box
    shape: tuple[int, ...]
    local: Box
    local_shape: tuple[int, ...]


@attrs.frozen
class _Launch:
    itemsize: int
    chunks: torch.Tensor
    copies: torch.Tensor


@attrs.frozen
class CopyPlan:
    """The cuts of one set of box entries as device tables, per item size."""

    tensors: tuple[str, ...]
    launches: tuple[_Launch, ...]

    @classmethod
    def of(cls, cuts: Sequence[Cut], itemsizes: Mapping[str, int],
           device: torch.device) -> CopyPlan | None:
        """The plan of ``cuts`` into local tensors of ``itemsizes``; None when a cut has
        more than three dimensions that do not merge (the reference copies it)."""
        tensors = tuple(sorted({c.tensor for c in cuts}))
        ids = {name: k for k, name in enumerate(tensors)}
        copies: dict[int, list[list[int]]] = defaultdict(list)
        chunks: dict[int, list[list[int]]] = defaultdict(list)
        for cut in cuts:
            row = _copy_row(cut, ids[cut.tensor], itemsizes[cut.tensor])
            if row is None:
                return None
            size = itemsizes[cut.tensor]
            chunks[size] += _chunks(len(copies[size]), row[0] * row[1], row[2])
            copies[size].append(row[3:])
        launches = tuple(_Launch(size, host_table(_columns(chunks[size]), device),
                                 host_table(_columns(copies[size]), device))
                         for size in sorted(copies) if chunks[size])
        return cls(tensors, launches)

    def write(self, values: Sequence[torch.Tensor], weights: Mapping[str, torch.Tensor]
              ) -> None:
        """Copy every cut from ``values`` (per entry, its raw section on the device)
        into ``weights``."""
        if not self.launches:
            return
        from . import box_copy_kernel as kernel
        device = self.launches[0].chunks.device
        targets = [weights[name] for name in self.tensors]
        entries = host_table([[v.data_ptr() for v in values]], device)[0]
        tensors = host_table([[t.data_ptr() for t in targets]], device)[0]
        with on_device(device):
            for launch in self.launches:
                kernel.copy(launch.chunks, launch.copies, entries, tensors,
                            itemsize=launch.itemsize)
        # written through addresses: tell autograd, as an in-place torch write would
        torch.autograd.graph.increment_version(targets)


@attrs.frozen
class StagedCopies:
    """Every box entry of a full version, written by ``CopyPlan.write`` (``apply.Staged``'s
    protocol; a full version keeps no undo log)."""

    plan: CopyPlan
    values: tuple[torch.Tensor, ...]
    weights: Mapping[str, torch.Tensor]

    @property
    def name(self) -> str:
        return f"{len(self.values)} box entries"

    def saved(self) -> None:
        return None

    def write(self) -> None:
        self.plan.write(self.values, self.weights)


def _copy_row(cut: Cut, tensor: int, itemsize: int) -> list[int] | None:
    """(outer, middle, length) then the copy table's row (``box_copy_kernel``)."""
    source = [(n, s) for n, s in zip(cut.inside.size, _strides(cut.shape)) if n != 1]
    target = [(n, s) for n, s in zip(cut.local.size, _strides(cut.local_shape)) if n != 1]
    sizes = [n for n, _ in source]
    source_strides, target_strides = [s for _, s in source], [s for _, s in target]
    d = len(sizes) - 1
    while d > 0:  # merge a dimension into the next where both sides are contiguous
        if (source_strides[d - 1] == source_strides[d] * sizes[d]
                and target_strides[d - 1] == target_strides[d] * sizes[d]):
            sizes[d - 1] *= sizes.pop(d)
            source_strides.pop(d - 1)
            target_strides.pop(d - 1)
        d -= 1
    if len(sizes) > _DIMS:
        return None
    pad = _DIMS - len(sizes)
    sizes, source_strides, target_strides = ([1] * pad + sizes, [0] * pad + source_strides,
                                             [0] * pad + target_strides)
    source_at = sum(b * s for b, s in zip(cut.inside.start, _strides(cut.shape)))
    target_at = sum(b * s for b, s in zip(cut.local.start, _strides(cut.local_shape)))
    return [sizes[0], sizes[1], sizes[2], cut.entry, tensor, source_at, target_at, sizes[1],
            *source_strides, *target_strides]


def _chunks(copy: int, rows: int, length: int) -> list[list[int]]:
    """The chunk rows (copy, first row, rows, first column, columns) of one copy."""
    if length >= _CHUNK:
        return [[copy, r, 1, c, min(_CHUNK, length - c)]
                for r in range(rows) for c in range(0, length, _CHUNK)]
    per = _CHUNK // length
    return [[copy, r, min(per, rows - r), 0, length] for r in range(0, rows, per)]


def _columns(rows: list[list[int]]) -> list[list[int]]:
    return [list(c) for c in zip(*rows)]
