"""Build payloads: every tensor dense for a full sync, the cheapest exact encoding per
tensor for a delta."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Protocol

import torch

from .errors import EncodeError, HeaderError
from .header import (DIGEST_OFFSET, DTYPE_CODES, MAX_NAME_BYTES, NO_BASE, Entry, Header, Kind,
                     align, payload_digest)
from .indices import check_sorted_positions, encode_indices
from .values import encode_values


class ChangeSet(Protocol):
    """What ``encode_delta`` needs per tensor (``dte_detector.ChangeSet`` has this shape).

    ``indices``: sorted, unique flat indices of the elements to send (int32 or int64).
    ``base_low``/``base_high``: per index, bounds on the receiver's current value, in the
    tensor's dtype, compared in the total order of bit patterns; equal when exact.
    """

    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor


def encode_full(tensors: Mapping[str, torch.Tensor], *, stream_id: str, version: int) -> bytes:
    """A full payload carrying every tensor densely.

    Raises:
        EncodeError: a name, dtype or version that the format cannot carry.
    """
    entries, sections = [], []
    for name, tensor in tensors.items():
        _check_tensor(name, tensor)
        entries.append(Entry(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape),
                             count=tensor.numel()))
        sections.append((_bytes_of(tensor),))
    header = Header(stream_id=stream_id, kind=Kind.FULL, base_version=NO_BASE,
                    payload_version=version, entries=tuple(entries))
    return _assemble(header, sections)


def encode_delta(tensors: Mapping[str, torch.Tensor], changes: Mapping[str, ChangeSet], *,
                 stream_id: str, base_version: int, version: int) -> bytes:
    """A delta payload from ``base_version`` to ``version``.

    Every tensor needs a change set (an empty one when nothing changed). Each changed
    tensor goes dense or sparse, whichever is smaller; unchanged tensors are left out.

    Raises:
        EncodeError: missing or extra change sets, or a change set that does not fit
            its tensor (unsorted or out-of-range indices, bounds of the wrong shape).
    """
    if set(changes) != set(tensors):
        missing, extra = sorted(set(tensors) - set(changes)), sorted(set(changes) - set(tensors))
        raise EncodeError("changes", expected="one change set per tensor",
                          got=f"missing {missing}, extra {extra}")
    entries, sections = [], []
    for name, tensor in tensors.items():
        _check_tensor(name, tensor)
        encoded = _encode_one(name, tensor, changes[name])
        if encoded is not None:
            entries.append(encoded[0])
            sections.append(encoded[1])
    header = Header(stream_id=stream_id, kind=Kind.DELTA, base_version=base_version,
                    payload_version=version, entries=tuple(entries))
    return _assemble(header, sections)


def _encode_one(name: str, tensor: torch.Tensor, change: ChangeSet):
    indices = change.indices.reshape(-1).to(device=tensor.device, dtype=torch.int64)
    check_sorted_positions(indices, tensor.numel(), field="indices", tensor=name,
                           error=EncodeError)
    if indices.numel() == 0:
        return None
    for field in ("base_low", "base_high"):
        bound = getattr(change, field)
        if bound.dtype != tensor.dtype or bound.shape != indices.shape:
            raise EncodeError(field, expected=f"{tensor.dtype} of shape {tuple(indices.shape)}",
                              got=f"{bound.dtype} of shape {tuple(bound.shape)}", tensor=name)
    shape, numel = tuple(tensor.shape), tensor.numel()
    new = tensor.reshape(-1)[indices]
    index_part = encode_indices(indices, numel)
    value_part = encode_values(new, change.base_low.to(tensor.device),
                               change.base_high.to(tensor.device))
    if index_part.size + value_part.size >= numel * tensor.element_size():
        dense = Entry(name=name, dtype=tensor.dtype, shape=shape, count=numel)
        return dense, (_bytes_of(tensor),)
    entry = Entry(name=name, dtype=tensor.dtype, shape=shape, count=indices.numel(),
                  index_encoding=index_part.encoding, index_width=index_part.width,
                  index_escapes=index_part.escapes, value_encoding=value_part.encoding,
                  value_width=value_part.width, value_escapes=value_part.escapes)
    return entry, index_part.sections + value_part.sections


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    if len(name.encode()) > MAX_NAME_BYTES:
        raise EncodeError("name", expected=f"<= {MAX_NAME_BYTES} UTF-8 bytes",
                          got=len(name.encode()), tensor=name[:64])
    if tensor.dtype not in DTYPE_CODES:
        raise EncodeError("dtype", expected=f"one of {list(DTYPE_CODES)}", got=tensor.dtype,
                          tensor=name)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _assemble(header: Header, sections: list[tuple[torch.Tensor, ...]]) -> bytes:
    try:
        header.validate()
    except HeaderError as exc:
        raise EncodeError(exc.field, expected=exc.expected, got=exc.got, tensor=exc.tensor) from exc
    parts = []
    for section in (s for entry in sections for s in entry):
        section = section.reshape(-1).cpu()
        parts.append(section)
        pad = align(section.numel()) - section.numel()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
    body = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    data = bytearray(header.pack())
    data += body.numpy().tobytes()
    struct.pack_into("<Q", data, DIGEST_OFFSET, payload_digest(data))
    return bytes(data)
