"""A payload in flight: its packed header on the host, its body where it was encoded."""

from __future__ import annotations

import functools

import attrs
import torch

from .fields import WORD_BYTES
from .header import Header, sealed

_EMPTY = torch.empty(0, dtype=torch.uint8)


@attrs.frozen(eq=False)
class Frame:
    """One payload: ``header`` (the exact header bytes of ``FORMAT.md``, digests set) and
    the body as ``segments``, 1-D uint8 tensors on one device whose concatenation is the
    body.

    A delta fresh from the GPU encoder carries its body digest still queued on the device
    (``pending_digest``), its ``head`` with both digest fields zero: the body is being
    written while the sender's host hands the frame on. ``header`` reads the digest the
    first time it is asked for (one host synchronization, behind the body's writing); a
    receiver in the same process compares it on the device instead (``decode_queued``).

    A delta's body is one segment; a full payload's segments are views of the sender's
    weights with zero padding between them, so a frame is valid only until those
    weights change. ``bytes(frame)`` is the payload as ``FORMAT.md`` gives it (for files
    and host links) and ``Frame.from_bytes`` reads it back.
    """

    head: bytes
    """The header bytes: ``header`` itself, or its digest fields zero while
    ``pending_digest`` is set."""
    segments: tuple[torch.Tensor, ...] = attrs.field(converter=tuple)
    pending_digest: torch.Tensor | None = attrs.field(default=None, kw_only=True)
    """The body digest as a 0-d int64 tensor on the body's device (its two's complement),
    not read yet; None when ``head`` carries it."""

    @functools.cached_property
    def header(self) -> bytes:
        """The header bytes, digests set."""
        if self.pending_digest is None:
            return self.head
        return sealed(self.head, int(self.pending_digest))

    @functools.cached_property
    def body_size(self) -> int:
        return sum(s.numel() for s in self.segments)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole payload, header and body."""
        return len(self.head) + self.body_size

    @property
    def device(self) -> torch.device:
        """Where the body lives (the CPU for an empty body)."""
        return self.segments[0].device if self.segments else _EMPTY.device

    def to(self, device: str | torch.device) -> Frame:
        """The same payload with its body on ``device`` (this frame if already there)."""
        device = torch.device(device)
        if all(s.device == device for s in self.segments):
            return self
        return Frame(self.head, tuple(s.to(device) for s in self.segments),
                     pending_digest=self.pending_digest)

    def body(self) -> torch.Tensor:
        """The body as one word-aligned tensor on the frame's device: the segment itself
        when there is one (and it is aligned), else one copy."""
        if len(self.segments) == 1 and self.segments[0].data_ptr() % WORD_BYTES == 0:
            return self.segments[0]
        if not self.segments:
            return _EMPTY
        return torch.cat(self.segments)

    def __bytes__(self) -> bytes:
        """The payload bytes: the header, then every segment copied to the host once."""
        body = self.body()
        if body.is_cuda:
            body = torch.empty(body.shape, dtype=torch.uint8, pin_memory=True).copy_(body)
        return b"".join((self.header, memoryview(body.numpy()) if body.numel() else b""))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Frame:
        """The frame of payload bytes, its body one CPU segment (one copy of the body).

        Raises:
            HeaderError: truncated or inconsistent header fields.
            DigestError: the header does not match its digest (the body's is checked by
                ``decode``).
        """
        view = memoryview(data).cast("B")
        _, offset = Header.unpack(view)
        if offset == len(view):
            return cls(bytes(view[:offset]), ())
        body = torch.frombuffer(bytearray(view[offset:]), dtype=torch.uint8)
        if body.data_ptr() % WORD_BYTES:  # the flat decoder reads the body as int64 words
            body = body.clone()
        return cls(bytes(view[:offset]), (body,))
