"""Build payloads (``Frame``): every tensor dense for a full sync, the cheapest exact
encoding per tensor for a delta."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import attrs
import torch

from .body_digest import BodyRuns
from .encodings import Kind
from .entry import Entry
from .errors import EncodeError
from .fields import batched
from .flat_encode import encode_delta_flat
from .frame import Frame
from .header import NO_BASE
from .parts import Part, assemble, checked_header, dense_part, padded, seal_packed, sparse_part
from .tensor_set import tensor_set


class ChangeSet(Protocol):
    """What ``encode_delta`` needs per tensor (``dte_detector.ChangeSet`` has this shape).

    ``indices``: sorted, unique flat indices of the elements to send (int32 or int64).
    ``base_low``/``base_high``: per index, bounds on the receiver's current value, in the
    tensor's dtype, compared in the total order of bit patterns; equal when exact.
    """

    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor


def encode_full(tensors: Mapping[str, torch.Tensor], *, stream_id: str, version: int) -> Frame:
    """A full payload carrying every tensor densely: its body segments are views of the
    tensors (no copy), so send it before they change.

    Raises:
        EncodeError: a name, dtype or version that the format cannot carry.
    """
    layout = full_layout(tensors)
    header = checked_header(layout.entries, stream_id=stream_id, kind=Kind.FULL,
                            base_version=NO_BASE, version=version)
    return seal_packed(header.pack(), layout.segments, layout.digest(),
                       body_size=header.body_size())


@attrs.frozen(eq=False)
class FullLayout:
    """A full payload of a set of tensors but for its versions: the entries, the body
    segments (views of the tensors and the zero padding between them) and their word
    runs for the body digest."""

    entries: tuple[Entry, ...]
    segments: tuple[torch.Tensor, ...]
    runs: BodyRuns

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> FullLayout:
        parts = [dense_part(name, tensor) for name, tensor in tensors.items()]
        segments = tuple(padded([s for part in parts for s in part.sections]))
        return cls(tuple(part.entry for part in parts), segments, BodyRuns(segments))

    def digest(self) -> int:
        """The body digest of the tensors' bytes now."""
        return (self.runs if self.runs.views else BodyRuns(self.segments)).digest()


def full_layout(tensors: Mapping[str, torch.Tensor]) -> FullLayout:
    """The layout of ``tensors``, built once per tensor set (``tensor_set``) when every
    tensor is contiguous on one device, so that its segments are views; others need
    copies of the values as they are, and are laid out anew.

    The kept segments hold the tensors' memory until their set is rebuilt or dropped
    (``tensor_set.SET_CACHE``).
    """
    known = tensor_set(tensors)
    if not known.contiguous or known.device is None:
        return FullLayout.of(tensors)
    layout = known.caches.get(FullLayout)
    if layout is None:
        layout = known.caches[FullLayout] = FullLayout.of(tensors)
    return layout


def encode_delta(tensors: Mapping[str, torch.Tensor], changes: Mapping[str, ChangeSet], *,
                 stream_id: str, base_version: int, version: int) -> Frame:
    """A delta payload from ``base_version`` to ``version``.

    Every tensor needs a change set (an empty one when nothing changed). Each changed
    tensor goes dense or sparse, whichever is smaller; unchanged tensors are left out.
    On a GPU all tensors are encoded together (``encode_delta_batched``); on the CPU
    one at a time (``encode_delta_per_tensor``). The bytes are the same (see
    ``fields.batched``).

    Raises:
        EncodeError: missing or extra change sets, or a change set that does not fit
            its tensor (unsorted or out-of-range indices, bounds of the wrong shape).
    """
    if set(changes) != set(tensors):
        missing, extra = sorted(set(tensors) - set(changes)), sorted(set(changes) - set(tensors))
        raise EncodeError("changes", expected="one change set per tensor",
                          got=f"missing {missing}, extra {extra}")
    encoder = (encode_delta_batched if any(batched(t.device) for t in tensors.values())
               else encode_delta_per_tensor)
    return encoder(tensors, changes, stream_id=stream_id, base_version=base_version,
                   version=version)


def encode_delta_batched(tensors: Mapping[str, torch.Tensor], changes: Mapping[str, ChangeSet],
                         *, stream_id: str, base_version: int, version: int) -> Frame:
    """``encode_delta`` of all tensors together (``flat_encode``): a fixed number of device
    passes and two host synchronizations, whatever the number of tensors."""
    payload = encode_delta_flat(tensors, changes, stream_id=stream_id,
                                base_version=base_version, version=version)
    if payload is None:  # a change set that does not fit: the reference raises its error
        payload = encode_delta_per_tensor(tensors, changes, stream_id=stream_id,
                                          base_version=base_version, version=version)
    return payload


def encode_delta_per_tensor(tensors: Mapping[str, torch.Tensor],
                            changes: Mapping[str, ChangeSet], *, stream_id: str,
                            base_version: int, version: int) -> Frame:
    """``encode_delta`` one tensor at a time: the reference the batched encoder matches
    byte for byte, and the path that reports a change set that does not fit."""
    parts = (_cheapest(name, tensor, changes[name]) for name, tensor in tensors.items())
    return assemble([p for p in parts if p is not None], stream_id=stream_id, kind=Kind.DELTA,
                    base_version=base_version, version=version)


def _cheapest(name: str, tensor: torch.Tensor, change: ChangeSet) -> Part | None:
    if change.indices.numel() == 0:
        return None
    indices = change.indices.reshape(-1).to(device=tensor.device, dtype=torch.int64)
    if int(indices.min()) < 0 or int(indices.max()) >= tensor.numel():
        raise EncodeError("indices", expected=f"inside [0, {tensor.numel()})",
                          got=f"[{int(indices.min())}, {int(indices.max())}]", tensor=name)
    sparse = sparse_part(name, tensor.reshape(-1)[indices], shape=tuple(tensor.shape),
                         indices=indices, base_low=change.base_low,
                         base_high=change.base_high)
    if sparse.nbytes >= tensor.numel() * tensor.element_size():
        return dense_part(name, tensor)
    return sparse
