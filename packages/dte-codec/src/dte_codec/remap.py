"""Deliver along a plan: sparse indices remapped to every target, dense boxes as views.

``remap`` turns the flat indices of changed elements of one source local tensor into,
per target ``(rank, tensor)``, the sorted flat indices there and the positions of those
elements in the input, so values (and any other per-element array) follow with one
gather. It unravels the indices once and treats all transfers of the parameter in one
batch of tensor ops on the indices' device: a transfer is an affine map from source
coordinates to a target flat index, so the number of kernel launches does not grow
with the number of target ranks. Every target of the plan gets an entry, empty ones
too, so that every rank sees the same sequence of (possibly zero-size) messages.

``copy_slices`` is the dense path: each transfer is one strided view copied into one
strided view; dense entries never travel as index lists.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import attrs
import torch

from .encodings import INDEX32_LIMIT
from .errors import GeometryError
from .geometry import Transfer


@attrs.frozen
class Remapped:
    """Sorted, unique flat indices into one target tensor (int32 below 2**31 elements,
    else int64) and, for each, its position in the source index array (int64)."""

    indices: torch.Tensor
    positions: torch.Tensor


def remap(transfers: Sequence[Transfer], source_shape: Sequence[int], indices: torch.Tensor,
          *, tensor: str = "") -> dict[tuple[int, str], Remapped]:
    """Map flat ``indices`` of a source local tensor shaped ``source_shape`` to every
    target of ``transfers`` (the plan of that tensor). ``indices`` need not be sorted but
    must be unique (a repeated index stays repeated in every target it reaches).

    Raises:
        GeometryError: ``indices`` is not a 1-D integer tensor inside the source tensor,
            or a transfer's box lies outside its source or target tensor.
    """
    shape = tuple(source_shape)
    check_index_type(indices, tensor)
    check_boxes(transfers, shape, tensor)
    if not transfers:
        check_range(indices, shape, tensor)
        return {}
    table = _table(tuple(transfers), shape, indices.device)
    coords = _unravel(indices.to(torch.int64), shape)
    which, positions = table.select(coords, indices.numel())
    flat = table.target_flat(coords, which, positions)
    key = table.sort_key(flat, which)
    bounds = table.group_starts
    # One host sync in the common case: range check, order check and group sizes together.
    flags = torch.stack([out_of_range_flag(indices, shape), _unsorted(key)]).to(torch.int64)
    summary = torch.cat([flags, torch.searchsorted(key, bounds)]).tolist()
    if summary[0]:
        check_range(indices, shape, tensor)
    starts = summary[2:]
    if summary[1]:
        order = torch.argsort(key)
        flat, positions, key = (t.index_select(0, order) for t in (flat, positions, key))
        starts = torch.searchsorted(key, bounds).tolist()
    counts = [b - a for a, b in zip([0] + starts, starts + [key.numel()])]
    out = {}
    for target, target_flat, place in zip(table.keys, flat.split(counts),
                                          positions.split(counts)):
        numel = math.prod(table.shapes[target])
        dtype = torch.int32 if numel < INDEX32_LIMIT else torch.int64
        out[target] = Remapped(target_flat.to(dtype), place)
    return out


def copy_slices(transfers: Sequence[Transfer], source_tensor: torch.Tensor,
                target_tensors: Mapping[tuple[int, str], torch.Tensor], *,
                tensor: str = "") -> None:
    """Copy every transfer's source box of ``source_tensor`` into its target box of
    ``target_tensors[(rank, name)]``, view to view (casting if dtypes differ).

    Raises:
        GeometryError: a target tensor is missing or has another shape than the plan's,
            or a box lies outside its tensor.
    """
    check_boxes(transfers, tuple(source_tensor.shape), tensor)
    for transfer in transfers:
        target = target_tensors.get(transfer.target)
        name = f"rank {transfer.target_rank} {transfer.target_tensor}"
        if target is None:
            raise GeometryError("target tensors", tensor=tensor, expected=name, got="missing")
        if tuple(target.shape) != transfer.target_shape:
            raise GeometryError("shape", tensor=name, expected=transfer.target_shape,
                                got=tuple(target.shape))
        view = target[transfer.target_box.slices()]
        # Both boxes have one shape up to size-1 dimensions, and a view may always add
        # or drop those, so this never copies the source.
        view.copy_(source_tensor[transfer.source_box.slices()].view(view.shape))


def check_index_type(indices: torch.Tensor, tensor: str) -> None:
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise GeometryError("indices", tensor=tensor, expected="a 1-D int32 or int64 tensor",
                            got=f"{indices.dim()}-D {indices.dtype}")


def out_of_range_flag(indices: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A 0-d bool tensor (no host sync): some index lies outside the source tensor."""
    if indices.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=indices.device)
    low, high = torch.aminmax(indices)
    return (low < 0) | (high >= math.prod(shape))


def _unsorted(key: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: ``key`` is not strictly increasing."""
    if key.numel() < 2:
        return torch.zeros((), dtype=torch.bool, device=key.device)
    return (key[1:] <= key[:-1]).any()


def check_range(indices: torch.Tensor, shape: tuple[int, ...], tensor: str) -> None:
    if indices.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(indices))
    numel = math.prod(shape)
    if low < 0 or high >= numel:
        raise GeometryError("indices", tensor=tensor, expected=f"inside [0, {numel})",
                            got=f"[{low}, {high}]")


def check_boxes(transfers: Sequence[Transfer], shape: tuple[int, ...], tensor: str) -> None:
    for transfer in transfers:
        if not transfer.source_box.inside(shape):
            raise GeometryError("source box", tensor=tensor, expected=f"inside {shape}",
                                got=str(transfer.source_box))
        if not transfer.target_box.inside(transfer.target_shape):
            raise GeometryError("target box", tensor=transfer.target_tensor,
                                expected=f"inside {transfer.target_shape}",
                                got=str(transfer.target_box))


def row_major_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Per dimension, the row-major coordinate of each flat index."""
    return [(flat // stride) % size for stride, size in zip(row_major_strides(shape), shape)]


PerTransfer = int | torch.Tensor
"""A value per transfer: a plain int when every transfer has the same one (no gather)."""


@attrs.frozen
class _Table:
    """The transfers of one parameter on one device, grouped by target (``keys``): the
    source box ``bounds`` in the dimensions where some box is not the whole tensor, and
    per transfer an affine map ``shift + sum_d coord_d * weight_d`` to the target flat
    index. Targets are laid one after another (``offset`` per transfer, ``group_starts``)
    so that one sort key orders every group. Its memory is a ``(transfers, n)`` mask."""

    count: int
    keys: tuple[tuple[int, str], ...]
    shapes: dict[tuple[int, str], tuple[int, ...]]
    bounds: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]
    shift: PerTransfer
    weights: tuple[tuple[int, PerTransfer], ...]
    offset: PerTransfer
    group_starts: torch.Tensor

    def select(self, coords: list[torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which transfer and which input position each output element comes from,
        ordered by transfer, then position."""
        if not self.bounds:  # every box is the whole tensor
            device = self.group_starts.device
            which = torch.arange(self.count, device=device).repeat_interleave(n)
            return which, torch.arange(n, device=device).repeat(self.count)
        mask = None
        for d, low, high in self.bounds:
            inside = (coords[d] >= low) & (coords[d] < high)
            mask = inside if mask is None else mask & inside
        return mask.nonzero(as_tuple=True)

    def target_flat(self, coords: list[torch.Tensor], which: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        flat = torch.zeros_like(positions) + _gather(self.shift, which)
        for d, weight in self.weights:
            flat += coords[d].index_select(0, positions) * _gather(weight, which)
        return flat

    def sort_key(self, flat: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        return flat + _gather(self.offset, which)


def _gather(value: PerTransfer, which: torch.Tensor) -> PerTransfer:
    return value if isinstance(value, int) else value.index_select(0, which)


@functools.lru_cache(maxsize=4096)
def _table(transfers: tuple[Transfer, ...], shape: tuple[int, ...],
           device: torch.device) -> _Table:
    """Built once per (plan of a parameter, device): every sync step reuses it."""
    transfers = tuple(sorted(transfers, key=lambda t: t.target))
    keys = tuple(sorted({t.target for t in transfers}))
    shapes = {t.target: t.target_shape for t in transfers}
    starts = [0]
    for key in keys:
        starts.append(starts[-1] + math.prod(shapes[key]))
    start_of = dict(zip(keys, starts))
    affine = [affine_map(t) for t in transfers]

    bounds = []
    for d, size in enumerate(shape):
        low = [t.source_box.start[d] for t in transfers]
        high = [t.source_box.stop[d] for t in transfers]
        if max(low) > 0 or min(high) < size:  # skip dimensions every box spans
            bounds.append((d, _column(low, device), _column(high, device)))
    weights = [(d, _per_transfer([w[d] for _, w in affine], device)) for d in range(len(shape))]
    return _Table(count=len(transfers), keys=keys, shapes=shapes, bounds=tuple(bounds),
                  shift=_per_transfer([shift for shift, _ in affine], device),
                  weights=tuple((d, w) for d, w in weights if not isinstance(w, int) or w),
                  offset=_per_transfer([start_of[t.target] for t in transfers], device),
                  group_starts=torch.tensor(starts[1:-1], dtype=torch.int64, device=device))


def _per_transfer(values: list[int], device: torch.device) -> PerTransfer:
    if len(set(values)) == 1:
        return values[0]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _column(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a ``(transfers, 1)`` tensor, to compare against all indices at once."""
    return torch.tensor(values, dtype=torch.int64, device=device)[:, None]


def affine_map(transfer: Transfer) -> tuple[int, tuple[int, ...]]:
    """The target flat index of the box's first element, and per source dimension the
    target stride its offset moves by (the k-th non-singleton source dimension is the
    k-th non-singleton target dimension; singleton ones never move)."""
    strides = row_major_strides(transfer.target_shape)
    target_dims = [d for d, n in enumerate(transfer.target_box.size) if n != 1]
    weights = [0] * len(transfer.source_box.size)
    source_dims = [d for d, n in enumerate(transfer.source_box.size) if n != 1]
    for sd, td in zip(source_dims, target_dims):
        weights[sd] = strides[td]
    base = sum(s * w for s, w in zip(transfer.target_box.start, strides))
    shift = base - sum(s * w for s, w in zip(transfer.source_box.start, weights))
    return shift, tuple(weights)
