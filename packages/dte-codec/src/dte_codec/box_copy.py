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

import functools
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence

import attrs
import torch

from .dispatch import fused, on_device
from .fields import WORD_BYTES, host_table
from .region import Box
from .remap import row_major_strides

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
    contiguous: bool
    chunks: torch.Tensor
    copies: torch.Tensor


@attrs.frozen
class CopyPlan:
    """The cuts of one set of box entries as device tables, one launch per unit (item
    size) and per whether rows are contiguous on both sides."""

    tensors: tuple[str, ...]
    launches: tuple[_Launch, ...]
    _tables: dict[str, tuple[tuple[int, ...], torch.Tensor]] = attrs.field(
        factory=dict, init=False, eq=False, repr=False)
    """The last address table of the sections and of the tensors, on the device."""

    @classmethod
    def of(cls, cuts: Sequence[Cut], itemsizes: Mapping[str, int], device: torch.device,
           *, aligned: bool) -> CopyPlan | None:
        """The plan of ``cuts`` into local tensors of ``itemsizes``; None when a cut has
        more than three dimensions that do not merge (the reference copies it).
        ``aligned``: every value section and local tensor starts on a word, so contiguous
        rows whose offsets and lengths are whole words move a word per item."""
        tensors = tuple(sorted({c.tensor for c in cuts}))
        ids = {name: k for k, name in enumerate(tensors)}
        copies: dict[tuple[int, bool], list[list[int]]] = defaultdict(list)
        chunks: dict[tuple[int, bool], list[list[int]]] = defaultdict(list)
        for cut in cuts:
            if 0 in cut.inside.size:  # an empty tensor's cut moves nothing
                continue
            row = _copy_row(cut, ids[cut.tensor], itemsizes[cut.tensor], aligned=aligned)
            if row is None:
                return None
            unit, contiguous, (outer, middle, length), columns = row
            key = (unit, contiguous)
            chunks[key] += _chunks(len(copies[key]), outer * middle, length)
            copies[key].append(columns)
        launches = tuple(_Launch(unit, contiguous, host_table(_columns(chunks[key]), device),
                                 host_table(_columns(copies[key]), device))
                         for key in sorted(copies) if chunks[key]
                         for unit, contiguous in [key])
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
        entries = self._addresses("entries", tuple(map(torch.Tensor.data_ptr, values)), device)
        tensors = self._addresses("tensors", tuple(map(torch.Tensor.data_ptr, targets)), device)
        with on_device(device):
            for launch in self.launches:
                kernel.copy(launch.chunks, launch.copies, entries, tensors,
                            itemsize=launch.itemsize, contiguous=launch.contiguous)
        # written through addresses: tell autograd, as an in-place torch write would
        torch.autograd.graph.increment_version(targets)

    def _addresses(self, which: str, addresses: tuple[int, ...], device: torch.device
                   ) -> torch.Tensor:
        """``addresses`` as a device table, copied only when they differ from the last
        ones of ``which``: a stream's sections and local tensors mostly stay put."""
        last = self._tables.get(which)
        if last is None or last[0] != addresses:
            last = self._tables[which] = (addresses, host_table([list(addresses)], device)[0])
        return last[1]


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


PLANS = 4
"""Copy plans kept per cache (``copies_by_name``'s, a ``ShardStage``'s): a receiver gets
the same boxes every full version."""


def copies_by_name(weights: Mapping[str, torch.Tensor],
                   items: Sequence[tuple[str, Box, torch.Tensor]]) -> StagedCopies | None:
    """The box entries of a full version, each (tensor name, box, raw section) written
    into the tensor of that name, as one ``StagedCopies`` where the kernels run on the one
    device of every tensor and section; None elsewhere (``copy_`` per entry). The plan
    is kept per boxes, tensor shapes, device and alignment; per call only the devices
    and addresses are read. The sections must fit their boxes (``fit.check_fit``)."""
    if not items:
        return None
    targets = [weights[name] for name, _, _ in items]
    raws = tuple(raw for _, _, raw in items)
    device = targets[0].device
    index = -1 if device.index is None else device.index
    if not fused(device) or {t.get_device() for t in itertools.chain(targets, raws)} != {index}:
        return None
    aligned = not any(t.data_ptr() % WORD_BYTES for t in itertools.chain(raws, targets))
    if not aligned and any(r.data_ptr() % t.element_size() for r, t in zip(raws, targets)):
        return None
    plan = _by_name(tuple((name, box, t.shape, t.element_size())
                          for (name, box, _), t in zip(items, targets)), device, aligned)
    return None if plan is None else StagedCopies(plan, raws, weights)


@functools.lru_cache(maxsize=PLANS)
def _by_name(boxes: tuple[tuple[str, Box, torch.Size, int], ...], device: torch.device,
             aligned: bool) -> CopyPlan | None:
    cuts = [Cut(k, name, Box.whole(box.size), box.size, box, tuple(shape))
            for k, (name, box, shape, _) in enumerate(boxes)]
    return CopyPlan.of(cuts, {name: itemsize for name, _, _, itemsize in boxes}, device,
                       aligned=aligned)


def _copy_row(cut: Cut, tensor: int, itemsize: int, *, aligned: bool
              ) -> tuple[int, bool, tuple[int, int, int], list[int]] | None:
    """The copy's unit (bytes per item moved), whether its rows are contiguous on both
    sides, its (outer, middle, length) in units and its row of the copy table
    (``box_copy_kernel``)."""
    source_full, target_full = row_major_strides(cut.shape), row_major_strides(cut.local_shape)
    sizes = [n for n in cut.inside.size if n != 1] or [1]
    source_strides = [s for n, s in zip(cut.inside.size, source_full) if n != 1] or [1]
    target_strides = [t for n, t in zip(cut.local.size, target_full) if n != 1] or [1]
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
    sizes = [1] * pad + sizes
    source_strides, target_strides = [0] * pad + source_strides, [0] * pad + target_strides
    source_at = sum(b * s for b, s in zip(cut.inside.start, source_full))
    target_at = sum(b * s for b, s in zip(cut.local.start, target_full))
    contiguous = source_strides[-1] == 1 and target_strides[-1] == 1
    per = WORD_BYTES // itemsize if aligned and contiguous else 1
    if per > 1 and all(v % per == 0 for v in (sizes[-1], source_at, target_at,
                                               *source_strides[:-1], *target_strides[:-1])):
        sizes[-1] //= per
        source_at, target_at = source_at // per, target_at // per
        source_strides = [s // per for s in source_strides[:-1]] + [1]
        target_strides = [t // per for t in target_strides[:-1]] + [1]
    else:
        per = 1
    columns = [cut.entry, tensor, source_at, target_at, sizes[1], *source_strides,
               *target_strides]
    return itemsize * per, contiguous, (sizes[0], sizes[1], sizes[2]), columns


def _chunks(copy: int, rows: int, length: int) -> list[list[int]]:
    """The chunk rows (copy, first row, rows, first column, columns) of one copy."""
    if length >= _CHUNK:
        return [[copy, r, 1, c, min(_CHUNK, length - c)]
                for r in range(rows) for c in range(0, length, _CHUNK)]
    per = _CHUNK // length
    return [[copy, r, min(per, rows - r), 0, length] for r in range(0, rows, per)]


def _columns(rows: list[list[int]]) -> list[list[int]]:
    return [list(c) for c in zip(*rows)]
