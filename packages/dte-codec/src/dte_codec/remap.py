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

import math
from collections.abc import Mapping, Sequence

import attrs
import torch

from .errors import GeometryError
from .geometry import Transfer
from .header import INDEX32_LIMIT


@attrs.frozen
class Remapped:
    """Sorted, unique flat indices into one target tensor (int32 below 2**31 elements,
    else int64) and, for each, its position in the source index array (int64)."""

    indices: torch.Tensor
    positions: torch.Tensor


def remap(transfers: Sequence[Transfer], source_shape: Sequence[int], indices: torch.Tensor,
          *, tensor: str = "") -> dict[tuple[int, str], Remapped]:
    """Map flat ``indices`` of a source local tensor shaped ``source_shape`` to every
    target of ``transfers`` (the plan of that tensor).

    Raises:
        GeometryError: ``indices`` is not a 1-D integer tensor inside the source tensor,
            or a transfer's box lies outside its source or target tensor.
    """
    shape = tuple(source_shape)
    _check_indices(indices, shape, tensor)
    _check_boxes(transfers, shape, tensor)
    keys = sorted({t.target for t in transfers})
    if not keys:
        return {}
    table = _Table.build(transfers, keys, indices.device)
    coords = _unravel(indices.to(torch.int64), shape)
    which, positions = table.inside(coords).nonzero(as_tuple=True)
    offsets = coords[positions] - table.starts[which]
    flat = table.bases[which] + (offsets * table.weights[which]).sum(-1)
    group = table.groups[which]
    order = torch.argsort(table.group_offsets[group] + flat)
    counts = torch.bincount(group, minlength=len(keys)).tolist()
    flats = flat[order].split(counts)
    places = positions[order].split(counts)
    out = {}
    for key, target_flat, place in zip(keys, flats, places):
        numel = math.prod(table.shapes[key])
        dtype = torch.int32 if numel < INDEX32_LIMIT else torch.int64
        out[key] = Remapped(target_flat.to(dtype), place)
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
    _check_boxes(transfers, tuple(source_tensor.shape), tensor)
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


def _check_indices(indices: torch.Tensor, shape: tuple[int, ...], tensor: str) -> None:
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise GeometryError("indices", tensor=tensor, expected="a 1-D int32 or int64 tensor",
                            got=f"{indices.dim()}-D {indices.dtype}")
    numel = math.prod(shape)
    if indices.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(indices))
    if low < 0 or high >= numel:
        raise GeometryError("indices", tensor=tensor, expected=f"inside [0, {numel})",
                            got=f"[{low}, {high}]")


def _check_boxes(transfers: Sequence[Transfer], shape: tuple[int, ...], tensor: str) -> None:
    for transfer in transfers:
        if not transfer.source_box.inside(shape):
            raise GeometryError("source box", tensor=tensor, expected=f"inside {shape}",
                                got=str(transfer.source_box))
        if not transfer.target_box.inside(transfer.target_shape):
            raise GeometryError("target box", tensor=transfer.target_tensor,
                                expected=f"inside {transfer.target_shape}",
                                got=str(transfer.target_box))


def _strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``(n, ndim)`` row-major coordinates of the flat indices."""
    columns = [(flat // stride) % size for stride, size in zip(_strides(shape), shape)]
    return torch.stack(columns, dim=1) if columns else flat.new_zeros((flat.numel(), 0))


@attrs.frozen
class _Table:
    """The transfers of one parameter as tensors: source box ``starts``/``stops``, and
    the affine map to the target flat index, ``bases + (coord - start) @ weights``."""

    starts: torch.Tensor
    stops: torch.Tensor
    weights: torch.Tensor
    bases: torch.Tensor
    groups: torch.Tensor
    group_offsets: torch.Tensor
    shapes: dict[tuple[int, str], tuple[int, ...]]

    @classmethod
    def build(cls, transfers: Sequence[Transfer], keys: list[tuple[int, str]],
              device: torch.device) -> _Table:
        group_of = {key: g for g, key in enumerate(keys)}
        shapes = {t.target: t.target_shape for t in transfers}
        offsets = [0]
        for key in keys[:-1]:  # targets placed one after another make one sort key
            offsets.append(offsets[-1] + math.prod(shapes[key]))
        rows = [_affine(t) for t in transfers]
        return cls(
            starts=_int64([list(t.source_box.start) for t in transfers], device),
            stops=_int64([list(t.source_box.stop) for t in transfers], device),
            weights=_int64([weights for _, weights in rows], device),
            bases=_int64([base for base, _ in rows], device),
            groups=_int64([group_of[t.target] for t in transfers], device),
            group_offsets=_int64(offsets, device), shapes=shapes)

    def inside(self, coords: torch.Tensor) -> torch.Tensor:
        """``(transfers, n)``: whether each index lies in each transfer's source box."""
        mask = torch.ones((self.starts.shape[0], coords.shape[0]), dtype=torch.bool,
                          device=coords.device)
        for d in range(coords.shape[1]):
            column = coords[:, d]
            mask &= (column >= self.starts[:, d, None]) & (column < self.stops[:, d, None])
        return mask


def _int64(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _affine(transfer: Transfer) -> tuple[int, list[int]]:
    """The target flat index of the box's first element, and per source dimension the
    target stride its offset moves by (the k-th non-singleton source dimension is the
    k-th non-singleton target dimension; singleton ones never move)."""
    strides = _strides(transfer.target_shape)
    base = sum(s * w for s, w in zip(transfer.target_box.start, strides))
    target_dims = [d for d, n in enumerate(transfer.target_box.size) if n != 1]
    weights = [0] * len(transfer.source_box.size)
    source_dims = [d for d, n in enumerate(transfer.source_box.size) if n != 1]
    for sd, td in zip(source_dims, target_dims):
        weights[sd] = strides[td]
    return base, weights

