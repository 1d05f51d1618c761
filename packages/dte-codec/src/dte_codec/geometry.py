"""Shard geometry: which box of a rank's local tensor holds which box of a canonical tensor.

The canonical space is the unsharded model under its Hugging Face names. A rank's
``Shard`` lists its local tensors and ``Piece``s: "the box ``local`` of local tensor
``tensor`` holds the box ``region`` of canonical tensor ``canonical``". Both boxes are
unit-step and row-major and have the same shape once their size-1 dimensions are
dropped, so the i-th element of one is the i-th element of the other. That is what
lets a fused local tensor (a ``[E, 2I, H]`` expert stack, an interleaved QKV) hold
boxes of several canonical 2-D tensors.

``plan`` intersects the boxes of one source shard with those of every target shard in
canonical space and turns each overlap into a ``Transfer`` between local boxes. Only
``primary`` source pieces send, so a region held by several source ranks (norms on every
TP rank, dense weights on every EP rank) is sent once; every target piece receives, so
a replicated target region is written on every replica.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import attrs
import torch

from .errors import GeometryError
from .region import Box, int_tuple


@attrs.frozen(kw_only=True)
class Piece:
    """The box ``local`` of local tensor ``tensor`` holds the box ``region`` of canonical
    tensor ``canonical``; ``primary``: this rank is the one that sends the region."""

    tensor: str
    local: Box
    canonical: str
    region: Box
    primary: bool = True

    def __attrs_post_init__(self) -> None:
        if self.local.squeezed != self.region.squeezed or self.region.numel == 0:
            raise GeometryError(
                "piece", tensor=self.tensor,
                expected=f"a non-empty box shaped like {self.canonical!r} {self.region}",
                got=str(self.local))

    def to_local(self, sub: Box) -> Box:
        """The local box holding ``sub``, a box inside ``region``.

        The k-th dimension of ``region`` longer than one corresponds to the k-th such
        dimension of ``local``; every other local dimension has size one.
        """
        start, size = list(self.local.start), [1] * len(self.local.size)
        local_dims = [d for d, n in enumerate(self.local.size) if n != 1]
        region_dims = [d for d, n in enumerate(self.region.size) if n != 1]
        for ld, rd in zip(local_dims, region_dims):
            start[ld] += sub.start[rd] - self.region.start[rd]
            size[ld] = sub.size[rd]
        return Box(start, size)


@attrs.frozen
class TensorSpec:
    """A local or canonical tensor's shape and dtype."""

    shape: tuple[int, ...] = attrs.field(converter=int_tuple)
    dtype: torch.dtype


@attrs.frozen(kw_only=True)
class Shard:
    """One rank's local tensors and the pieces of canonical tensors they hold."""

    rank: int
    tensors: Mapping[str, TensorSpec]
    pieces: tuple[Piece, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        for piece in self.pieces:
            spec = self.tensors.get(piece.tensor)
            if spec is None or not piece.local.inside(spec.shape):
                raise GeometryError(
                    "piece", tensor=piece.tensor,
                    expected=f"a box inside {spec.shape if spec else 'a local tensor'}",
                    got=str(piece.local))

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise ``GeometryError`` unless ``tensors`` are exactly this shard's, by name,
        shape and dtype."""
        if set(tensors) != set(self.tensors):
            raise GeometryError("names", expected=sorted(self.tensors), got=sorted(tensors))
        for name, spec in self.tensors.items():
            got = tensors[name]
            if tuple(got.shape) != spec.shape:
                raise GeometryError("shape", tensor=name, expected=spec.shape,
                                    got=tuple(got.shape))
            if got.dtype != spec.dtype:
                raise GeometryError("dtype", tensor=name, expected=spec.dtype, got=got.dtype)


def materialize(shard: Shard, canonical: Mapping[str, torch.Tensor], *,
                fill: float = 0.0) -> dict[str, torch.Tensor]:
    """The shard's local tensors cut out of full ``canonical`` tensors (what a full
    load gives); elements that no piece covers (vocab padding) hold ``fill``."""
    device = next(iter(canonical.values())).device if canonical else None
    out = {name: torch.full(spec.shape, fill, dtype=spec.dtype, device=device)
           for name, spec in shard.tensors.items()}
    for piece in shard.pieces:
        source = canonical[piece.canonical][piece.region.slices()]
        target = out[piece.tensor][piece.local.slices()]
        target.copy_(source.view(target.shape))
    return out


def held_counts(shard: Shard) -> dict[str, int]:
    """Per local tensor, the elements its pieces hold (fewer than all where a tensor has
    padding that no canonical tensor fills)."""
    counts = dict.fromkeys(shard.tensors, 0)
    for piece in shard.pieces:
        counts[piece.tensor] += piece.local.numel
    return counts


@attrs.frozen(kw_only=True, cache_hash=True)
class Transfer:
    """Copy the box ``source_box`` of one source local tensor into the box
    ``target_box`` of ``target_tensor`` (shaped ``target_shape``) on ``target_rank``."""

    target_rank: int
    target_tensor: str
    target_shape: tuple[int, ...] = attrs.field(converter=int_tuple)
    source_box: Box
    target_box: Box

    @property
    def target(self) -> tuple[int, str]:
        return self.target_rank, self.target_tensor


def plan(source: Shard, targets: Sequence[Shard]) -> dict[str, tuple[Transfer, ...]]:
    """Per local tensor of ``source``, the transfers that carry its primary pieces to
    every target piece they overlap, ordered by target rank, tensor and box."""
    receivers = defaultdict(list)
    for target in targets:
        for piece in target.pieces:
            receivers[piece.canonical].append((target, piece))
    transfers: dict[str, list[Transfer]] = {name: [] for name in source.tensors}
    for piece in source.pieces:
        if not piece.primary:
            continue
        for target, held in receivers[piece.canonical]:
            common = piece.region.intersect(held.region)
            if common.numel == 0:
                continue
            transfers[piece.tensor].append(Transfer(
                target_rank=target.rank, target_tensor=held.tensor,
                target_shape=target.tensors[held.tensor].shape,
                source_box=piece.to_local(common), target_box=held.to_local(common)))
    return {name: tuple(sorted(ts, key=_order)) for name, ts in transfers.items()}


def _order(transfer: Transfer) -> tuple:
    return transfer.target_rank, transfer.target_tensor, transfer.target_box.start
