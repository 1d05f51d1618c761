"""Parse and validate a payload: header, digest, section sizes, indices and escapes.

Everything that can be checked without the receiver's tensors is checked here, so that
``apply_`` only has to match names, dtypes and shapes before it writes. On a GPU the body's
checks (digest, indices) are counts on the device; ``decode`` reads them before it returns,
``decode_queued`` leaves them queued on the payload (``QueuedChecks``) for a reader that
reads them with its own values, one host synchronization for both.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from .body_digest import U64, queued_digest
from .encodings import IndexEncoding, Kind
from .entry import Entry
from .errors import CodecError, DigestError, EntryError, HeaderError
from .fields import batched
from .flat_decode import IS_SPARSE, decode_indices_flat
from .frame import Frame
from .header import Header, body_digest_of
from .indices import decode_indices
from .payload import Flat, Payload
from .region import Box
from .section_views import entry_sections
from .table_bytes import TABLE_CACHE
from .values import check_escapes


@attrs.define(eq=False)
class QueuedChecks:
    """The checks of a batched decode, queued on the device behind its launches: the body
    digest and the count of failed index checks, read once (``settle``)."""

    frame: Frame
    header: Header
    queued: torch.Tensor
    """int64 (computed body digest, failed checks) on the body's device, and the sender's
    body digest where the frame's is still queued (``Frame.pending_digest``)."""
    _outcome: tuple[Payload | None] | CodecError | None = None

    @property
    def read(self) -> bool:
        """Whether ``settle`` has run."""
        return self._outcome is not None

    def settle(self, values: Sequence[int] | None = None) -> Payload | None:
        """Compare the checks, ``values`` where the caller read ``queued`` with its own
        values (one host synchronization for both), else read here. Returns None where
        they passed, the payload decoded entry by entry where the batched decode failed
        a check that the reference does not (see ``_batched``); the same every call.

        Raises:
            DigestError: the body does not match its digest.
            EntryError: the first failed check in ``FORMAT.md``'s order.
        """
        if self._outcome is None:
            digest, failed, *sent = self.queued.tolist() if values is None else values
            try:
                _compare_digest(self.frame, digest, *sent)
                self._outcome = (_reference(self.header, self.frame) if failed else None,)
            except CodecError as exc:
                self._outcome = exc
        if isinstance(self._outcome, CodecError):
            raise self._outcome
        return self._outcome[0]


def decode(data: Frame | bytes | bytearray | memoryview, *,
           device: str | torch.device | None = None) -> Payload:
    """Parse and validate a payload into a ``Payload`` whose tensors live on ``device``.

    A frame is decoded where its body lives (``device`` moves it first, one copy);
    bytes on ``device``, the CPU by default. On a GPU every sparse entry's indices are
    decoded together (``decode_batched``), on the CPU entry by entry
    (``decode_per_entry``); see ``fields.batched``.

    Raises:
        HeaderError: truncated or inconsistent header fields.
        DigestError: the header or the body does not match its digest.
        EntryError: invalid indices or escape positions inside an entry.
    """
    return decode_queued(data, device=device).settled()


def decode_batched(data: Frame | bytes | bytearray | memoryview, *,
                   device: str | torch.device | None = None) -> Payload:
    """``decode`` with every sparse entry's indices found together (``flat_decode``), on
    any device: a fixed number of device passes and one host synchronization."""
    return _batched(*_open(data, device)).settled()


def decode_queued(data: Frame | bytes | bytearray | memoryview, *,
                  device: str | torch.device | None = None) -> Payload:
    """``decode`` whose batched checks (digest, indices) stay queued on the device where
    every entry is sparse: the header is checked, but the payload's ``checks`` are read
    when a reader first needs them (``Payload.settled``), so a stage can queue its own
    launches and read both with one host synchronization. Elsewhere as ``decode``.

    Raises:
        HeaderError: truncated or inconsistent header fields.
        DigestError, EntryError: as ``decode``, where the checks were read here.
    """
    header, frame, digest = _open(data, device)
    if not batched(frame.device):
        _check_digest(frame, digest)
        return _reference(header, frame)
    return _batched(header, frame, digest)


def _batched(header: Header, frame: Frame, digest: torch.Tensor) -> Payload:
    """The batched decode; its checks left queued where every entry is sparse."""
    columns = header.columns()
    encodings = columns["index_encoding"]
    sparse = IS_SPARSE[encodings]
    if not sparse.any():
        _check_digest(frame, digest)
        return _reference(header, frame)  # no body copy
    body = frame.body()
    # queued behind the digest: the checks of both are read together, and nothing is
    # written anywhere before the digest has matched
    flat = decode_indices_flat(header, body)
    device = flat.failures.device
    checks = [digest.to(device), flat.failures]
    if frame.pending_digest is not None:  # compared here, not read on the sender's host
        checks.append(frame.pending_digest.to(device))
    queued = QueuedChecks(frame, header, torch.stack(checks))
    if sparse.all():  # no box to read from the body: nothing before the checks
        return Payload(header=header, flat=Flat(header, body, flat, (None,) * sparse.size),
                       checks=queued)
    fallback = queued.settle()
    if fallback is not None:
        return fallback
    try:
        regions = _regions(header, body, encodings)
    except EntryError:  # the reference raises the first failed check, in order
        return _reference(header, frame)
    return Payload(header=header, flat=Flat(header, body, flat, regions))


def _regions(header: Header, body: torch.Tensor, encodings: np.ndarray
             ) -> tuple[Box | None, ...]:
    """Per entry, the box of a dense or box entry (None for sparse entries)."""
    regions: list[Box | None] = [None] * len(header.entries)
    sections = header.sections()
    for k in np.flatnonzero(~IS_SPARSE[encodings]).tolist():
        first = int(sections.firsts[k])
        at, size = int(sections.offsets[first]), sections.sizes[first]
        regions[k] = _region(header.entries[k], (body[at:at + size],))
    return tuple(regions)


def decode_per_entry(data: Frame | bytes | bytearray | memoryview, *,
                     device: str | torch.device | None = None) -> Payload:
    """``decode`` entry by entry: the reference the batched decoder matches, and the path
    that raises the first failed check in ``FORMAT.md``'s order."""
    header, frame, digest = _open(data, device)
    _check_digest(frame, digest)
    return _reference(header, frame)


def _open(data: Frame | bytes | bytearray | memoryview, device: str | torch.device | None
          ) -> tuple[Header, Frame, torch.Tensor]:
    """The validated header, the frame on ``device`` and its body digest, queued (see
    ``_check_digest``)."""
    frame = data if isinstance(data, Frame) else Frame.from_bytes(data)
    segments = frame.segments
    # CUDA devices compared by index: no torch.device built per segment of a full frame
    if not (all(s.dtype == torch.uint8 and s.dim() == 1 for s in segments)
            and len({s.get_device() if s.is_cuda else s.device for s in segments}) <= 1):
        shapes = {(s.dtype, s.dim(), s.device) for s in segments}
        raise HeaderError("body segments", expected="1-D uint8 tensors on one device",
                          got=sorted(map(str, shapes)))
    if device is not None and frame.device != torch.device(device):  # one device, checked
        frame = frame.to(device)
    # queued first: the device hashes the body while the host reads the header (whose
    # errors still come first: the digest is compared later)
    digest = queued_digest(frame.segments)
    header = Header.unpack_head(memoryview(frame.head), frame.body_size,
                                sealed=frame.pending_digest is None)
    return header, frame, digest


def _check_digest(frame: Frame, digest: torch.Tensor) -> None:
    """Raise ``DigestError`` if the body does not match the digest its header carries
    (one host synchronization)."""
    _compare_digest(frame, int(digest))


def _compare_digest(frame: Frame, computed: int, sent: int | None = None) -> None:
    """Raise ``DigestError`` unless ``computed`` is the body digest the header carries, or
    ``sent``, the sender's where it was read with the checks."""
    stored = body_digest_of(frame.header) if sent is None else sent & U64
    computed &= U64
    if stored != computed:
        raise DigestError("body_digest", expected=f"{stored:#018x}", got=f"{computed:#018x}")


def _reference(header: Header, frame: Frame) -> Payload:
    """The payload of ``frame`` decoded entry by entry (its digest checked elsewhere)."""
    return _per_entry(header, entry_sections(header, frame.segments))


def _per_entry(header: Header, sections: list[tuple[torch.Tensor, ...]]) -> Payload:
    if header.kind == Kind.FULL:
        return _full(header, sections)
    indices, values = [], []
    for entry, own in zip(header.entries, sections):
        n_index = len(entry.index_sections())
        index_sections, value_sections = own[:n_index], own[n_index:]
        check_escapes(entry, value_sections)
        indices.append(_region(entry, index_sections))
        values.append(value_sections)
    return Payload(header=header, indices=tuple(indices), values=tuple(values))


def _full(header: Header, sections: list[tuple[torch.Tensor, ...]]) -> Payload:
    """A full payload: its entries are dense or boxes with RAW values (``Header.validate``),
    so only the boxes are left to check, read from the body in one host copy (not one
    per entry), in entry order."""
    entries = header.entries
    regions = _dense_regions(entries)
    if regions is not None:
        return Payload(header=header, indices=regions, values=tuple(sections))
    box = [entry.index_encoding == IndexEncoding.BOX for entry in entries]
    fields = [s[0] for s, is_box in zip(sections, box) if is_box]
    host = iter(torch.cat(fields).cpu().split([f.numel() for f in fields]))
    regions = tuple(_region(entry, (next(host),) if is_box else ())
                    for entry, is_box in zip(entries, box))
    values = tuple(s[1:] if is_box else s for s, is_box in zip(sections, box))
    return Payload(header=header, indices=regions, values=values)


@functools.lru_cache(maxsize=TABLE_CACHE)
def _dense_regions(entries: tuple[Entry, ...]) -> tuple[Box, ...] | None:
    """Each entry's whole-tensor box when every entry is dense (a full version of whole
    tensors, the same table sync after sync: the same boxes each time); None otherwise."""
    if not all(entry.index_encoding == IndexEncoding.DENSE for entry in entries):
        return None
    return tuple(Box.whole(entry.shape) for entry in entries)


def _region(entry: Entry, sections: tuple[torch.Tensor, ...]) -> torch.Tensor | Box:
    if entry.index_encoding == IndexEncoding.DENSE:
        return Box.whole(entry.shape)
    if entry.index_encoding == IndexEncoding.BOX:
        box = Box.from_tensor(sections[0], entry.shape, tensor=entry.name)
        if box.numel != entry.count:
            raise EntryError("box", expected=f"volume {entry.count}", got=box.numel,
                             tensor=entry.name)
        return box
    return decode_indices(entry, sections)
