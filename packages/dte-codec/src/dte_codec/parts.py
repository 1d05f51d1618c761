"""Payload entries built one at a time, and their assembly into a ``Frame``.

``encode_full`` and ``encode_delta`` cover a sender that holds whole tensors. A sender
that holds only part of each receiver tensor (a trainer shard feeding a rollout shard of
another layout) builds the entries itself: ``box_part`` for a dense region,
``sparse_part`` for changed elements, then ``assemble``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import attrs
import torch

from .body_digest import body_digest
from .encodings import ALIGNMENT, DTYPE_CODES, IndexEncoding, Kind, align
from .entry import Entry
from .errors import EncodeError, HeaderError
from .frame import Frame
from .header import MAX_NAME_BYTES, Header, sealed
from .indices import check_sorted_positions, encode_indices
from .region import Box
from .values import encode_values

_EMPTY = torch.empty(0, dtype=torch.uint8)


@attrs.frozen
class Part:
    """One entry of a payload and its body sections (uint8 tensors on any device)."""

    entry: Entry
    sections: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.sections)


ENTRY_CACHE = 1 << 16
"""Dense and box entries remembered: a stream builds the same ones sync after sync, and
the same ``Entry`` object makes the header's table caches hit by identity."""


def dense_part(name: str, tensor: torch.Tensor) -> Part:
    """A whole tensor, dense."""
    return Part(_dense_entry(name, tensor.dtype, tuple(tensor.shape)), (bytes_of(tensor),))


@functools.lru_cache(maxsize=ENTRY_CACHE)
def _dense_entry(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Entry:
    _check_tensor(name, dtype)
    return Entry(name=name, dtype=dtype, shape=shape, count=math.prod(shape))


def box_part(name: str, block: torch.Tensor, *, shape: tuple[int, ...],
             start: tuple[int, ...]) -> Part:
    """The dense region ``block`` of a receiver tensor of ``shape``, placed at ``start``."""
    _check_tensor(name, block.dtype)
    box = Box(tuple(start), tuple(block.shape))
    if len(box.start) != len(shape) or any(
            b < 0 or b + n > d for b, n, d in zip(box.start, box.size, shape)):
        raise EncodeError("box", expected=f"a region inside shape {tuple(shape)}",
                          got=f"start {box.start}, size {box.size}", tensor=name)
    entry = Entry(name=name, dtype=block.dtype, shape=tuple(shape), count=box.numel,
                  index_encoding=IndexEncoding.BOX)
    return Part(entry, (box.to_tensor().to(block.device), bytes_of(block)))


def sparse_part(name: str, values: torch.Tensor, *, shape: tuple[int, ...],
                indices: torch.Tensor, base_low: torch.Tensor, base_high: torch.Tensor) -> Part:
    """New ``values`` at sorted flat ``indices`` of a tensor of ``shape``, each in the
    cheapest exact encoding, given bounds on the receiver's current values."""
    _check_tensor(name, values.dtype)
    numel = Box.whole(tuple(shape)).numel
    indices = indices.reshape(-1).to(device=values.device, dtype=torch.int64)
    check_sorted_positions(indices, numel, field="indices", tensor=name, error=EncodeError)
    for field, array in (("values", values), ("base_low", base_low), ("base_high", base_high)):
        if array.dtype != values.dtype or array.shape != indices.shape:
            raise EncodeError(field, expected=f"{values.dtype} of shape {tuple(indices.shape)}",
                              got=f"{array.dtype} of shape {tuple(array.shape)}", tensor=name)
    index_part = encode_indices(indices, numel)
    value_part = encode_values(values, base_low.to(values.device), base_high.to(values.device))
    entry = Entry(name=name, dtype=values.dtype, shape=tuple(shape), count=indices.numel(),
                  index_encoding=index_part.encoding, index_width=index_part.width,
                  index_escapes=index_part.escapes, value_encoding=value_part.encoding,
                  value_width=value_part.width, value_escapes=value_part.escapes)
    return Part(entry, index_part.sections + value_part.sections)


def assemble(parts: Iterable[Part], *, stream_id: str, kind: Kind, base_version: int,
             version: int) -> Frame:
    """The frame of a payload made of ``parts``.

    A full payload's sections stay where they are (views of the weights, zero padding
    between them); a delta's are laid out in one body on their device.

    Raises:
        EncodeError: header fields the format cannot carry (versions, stream id).
    """
    parts = list(parts)
    header = checked_header([p.entry for p in parts], stream_id=stream_id, kind=kind,
                            base_version=base_version, version=version)
    sections = [s for part in parts for s in part.sections]
    if kind == Kind.FULL:
        return seal(header, *padded(sections))
    return seal(header, torch.cat(padded(sections)) if sections else _EMPTY)


def checked_header(entries: Sequence[Entry], *, stream_id: str, kind: Kind, base_version: int,
                   version: int) -> Header:
    """The header of a payload with these entries, validated.

    Raises:
        EncodeError: header fields the format cannot carry (versions, stream id).
    """
    header = Header(stream_id=stream_id, kind=kind, base_version=base_version,
                    payload_version=version, entries=tuple(entries))
    try:
        header.validate()
    except HeaderError as exc:
        raise EncodeError(exc.field, expected=exc.expected, got=exc.got, tensor=exc.tensor) from exc
    return header


def seal(header: Header, *segments: torch.Tensor) -> Frame:
    """The frame of ``header`` and the body made of ``segments`` (uint8, one device),
    with both digests set: the body's computed where it lives, one pass over all segments
    (one host synchronization)."""
    segments = tuple(s if s.dim() == 1 else s.reshape(-1) for s in segments)
    return seal_packed(header.pack(), segments, body_digest(segments),
                       body_size=header.body_size())


def seal_packed(head: bytes, segments: tuple[torch.Tensor, ...], digest: int | torch.Tensor, *,
                body_size: int) -> Frame:
    """The frame of the packed header ``head`` (``Header.pack``: digest fields zero) and
    the body made of the 1-D uint8 ``segments`` of ``body_size`` bytes, whose body digest
    is ``digest``: both digest fields set, or, for a digest still queued on the device (a
    0-d tensor), set when first read (``Frame.pending_digest``)."""
    if isinstance(digest, torch.Tensor):
        frame = Frame(head, segments, pending_digest=digest)
    else:
        frame = Frame(sealed(head, digest), segments)
    assert frame.body_size == body_size, "body does not fit header"
    return frame


def padded(sections: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every section as flat bytes on one device, each followed by the zero padding that
    aligns the next (a slice of one small zero tensor, not an allocation per section)."""
    devices = {s.device for s in sections}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    zeros = torch.zeros(ALIGNMENT, dtype=torch.uint8, device=device)
    pieces = []
    for section in sections:
        section = section.reshape(-1).to(device)
        pieces.append(section)
        pad = align(section.numel()) - section.numel()
        if pad:
            pieces.append(zeros[:pad])
    return pieces


def _check_tensor(name: str, dtype: torch.dtype) -> None:
    if len(name.encode()) > MAX_NAME_BYTES:
        raise EncodeError("name", expected=f"<= {MAX_NAME_BYTES} UTF-8 bytes",
                          got=len(name.encode()), tensor=name[:64])
    if dtype not in DTYPE_CODES:
        raise EncodeError("dtype", expected=f"one of {list(DTYPE_CODES)}", got=dtype,
                          tensor=name)


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat (a view where it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
