"""Parse and validate a payload: header, digest, section sizes, indices and escapes.

Everything that can be checked without the receiver's tensors is checked here, so that
``apply_`` only has to match names, dtypes and shapes before it writes. On a GPU the body's
checks (digest, indices) are counts on the device; ``decode`` reads them before it returns,
``decode_queued`` leaves them queued on the payload (``QueuedChecks``) for a reader that
reads them with its own values, one host synchronization for both.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from .body_digest import U64, queued_digest
from .errors import CodecError, DigestError, EntryError, HeaderError
from .fields import batched
from .frame import Frame
from .flat_decode import (INDEX_SECTIONS, IS_SPARSE, VALUE_SECTIONS, FlatIndices,
                          decode_indices_flat)
from .encodings import ALIGNMENT, IndexEncoding, Kind, align
from .entry import Entry
from .header import Header, body_digest_of
from .table_bytes import TABLE_CACHE
from .indices import decode_indices
from .region import Box
from .values import check_escapes


@attrs.frozen(kw_only=True)
class Payload:
    """A decoded payload: its header and, per entry, validated indices and value sections.

    Built with ``indices`` and ``values`` (entry by entry), or with ``flat`` (the batched
    decoder), from which ``indices`` and ``values`` are made when first read. A payload of
    ``decode_queued`` may still have its checks queued (``checks``): reading ``indices``,
    ``values`` or ``flat`` reads them first and raises their error.
    """

    header: Header
    _indices: tuple[torch.Tensor | Box, ...] = ()
    _values: tuple[tuple[torch.Tensor, ...], ...] = ()
    _flat: Flat | None = None
    _checks: QueuedChecks | None = attrs.field(default=None, eq=False, repr=False)

    @functools.cached_property
    def indices(self) -> tuple[torch.Tensor | Box, ...]:
        """Per entry, int64 flat indices (sparse entries) or the box it covers (dense and
        box entries; a dense entry covers its whole tensor)."""
        settled = self.settled()
        if settled is not self:
            return settled.indices
        return self._indices if self._flat is None else self._flat.entry_indices()

    @functools.cached_property
    def values(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per entry, the value sections as uint8 tensors (see ``FORMAT.md``)."""
        settled = self.settled()
        if settled is not self:
            return settled.values
        return self._values if self._flat is None else self._flat.entry_values()

    @property
    def flat(self) -> Flat | None:
        """The body in one piece and every sparse entry's indices back to back, where the
        batched decoder made them: what the kernels read, with no per-entry tensors."""
        settled = self.settled()
        return settled._flat if settled is self else settled.flat

    @property
    def checks(self) -> QueuedChecks | None:
        """The checks of a ``decode_queued`` payload while they are not read yet (None
        after): a reader may read them together with its own values (``unchecked_flat``)."""
        return None if self._checks is None or self._checks.read else self._checks

    def unchecked_flat(self) -> Flat | None:
        """``flat``, without reading ``checks`` while they are queued: only for launches
        that write scratch and read within the header's bounds, whose caller settles
        ``checks`` before using anything they made."""
        return self._flat if self.checks is not None else self.flat

    def settled(self) -> Payload:
        """This payload once its queued checks passed, or where the batched decode gave
        way, the payload decoded entry by entry; raises the decode's error otherwise.

        Raises:
            DigestError: the body does not match its digest.
            EntryError: invalid indices or escape positions inside an entry.
        """
        if self._checks is None:
            return self
        fallback = self._checks.settle()
        return self if fallback is None else fallback

    @property
    def nbytes(self) -> int:
        """Size of the body in bytes (the header is not counted)."""
        return self.header.body_size()


@attrs.define(eq=False)
class QueuedChecks:
    """The checks of a batched decode, queued on the device behind its launches: the body
    digest and the count of failed index checks, read once (``settle``)."""

    frame: Frame
    header: Header
    queued: torch.Tensor
    """int64 (computed body digest, failed checks) on the body's device."""
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
            digest, failed = self.queued.tolist() if values is None else values
            try:
                _compare_digest(self.frame, digest)
                self._outcome = ((_per_entry(self.header, _split(self.header,
                                                                 self.frame.segments))
                                  if failed else None),)
            except CodecError as exc:
                self._outcome = exc
        if isinstance(self._outcome, CodecError):
            raise self._outcome
        return self._outcome[0]


@attrs.frozen
class Flat:
    """A payload held as one body: where each section lies in it (``header.sections()``),
    and the indices of the sparse entries back to back."""

    header: Header
    body: torch.Tensor
    """The body, uint8, word aligned."""
    indices: FlatIndices
    regions: tuple[Box | None, ...]
    """Per entry, the box of a dense or box entry; None for a sparse entry."""

    def value_sections(self) -> tuple[np.ndarray, np.ndarray]:
        """Per entry, the body offsets of its value sections as three rows (raw values or
        residue fields, residue escape positions, escaped values; a row past an entry's
        last value section repeats that section's offset), and the size of its first."""
        sections = self.header.sections()
        firsts = sections.firsts
        last = np.append(firsts[1:], sections.offsets.size) - 1
        first_value = firsts + INDEX_SECTIONS[self.header.columns()["index_encoding"]]
        return (np.stack([sections.offsets[np.minimum(first_value + k, last)]
                          for k in range(VALUE_SECTIONS)]),
                sections.size_array[first_value])

    def entry_indices(self) -> tuple[torch.Tensor | Box, ...]:
        found = iter(self.indices.indices)
        return tuple(next(found) if region is None else region for region in self.regions)

    def entry_values(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        sections = self.header.sections()
        views = [self.body[at:at + size]
                 for at, size in zip(sections.offsets.tolist(), sections.sizes)]
        index_sections = INDEX_SECTIONS[self.header.columns()["index_encoding"]].tolist()
        return tuple(tuple(views[first + n:first + count]) for first, n, count in
                     zip(sections.firsts.tolist(), index_sections, sections.per_entry))


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
        return _per_entry(header, _split(header, frame.segments))
    return _batched(header, frame, digest)


def _batched(header: Header, frame: Frame, digest: torch.Tensor) -> Payload:
    """The batched decode; its checks left queued where every entry is sparse."""
    columns = header.columns()
    encodings = columns["index_encoding"]
    sparse = IS_SPARSE[encodings]
    if not sparse.any():
        _check_digest(frame, digest)
        return _per_entry(header, _split(header, frame.segments))  # no body copy
    body = frame.body()
    # queued behind the digest: the checks of both are read together, and nothing is
    # written anywhere before the digest has matched
    flat = decode_indices_flat(header, body)
    queued = QueuedChecks(frame, header, torch.stack([digest.to(flat.failures.device),
                                                      flat.failures]))
    if sparse.all():  # no box to read from the body: nothing before the checks
        return Payload(header=header, flat=Flat(header, body, flat, (None,) * sparse.size),
                       checks=queued)
    fallback = queued.settle()
    if fallback is not None:
        return fallback
    try:
        regions = _regions(header, body, encodings)
    except EntryError:  # the reference raises the first failed check, in order
        return _per_entry(header, _split(header, frame.segments))
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
    return _per_entry(header, _split(header, frame.segments))


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
    return Header.unpack_head(memoryview(frame.header), frame.body_size), frame, digest


def _check_digest(frame: Frame, digest: torch.Tensor) -> None:
    """Raise ``DigestError`` if the body does not match the digest its header carries
    (one host synchronization)."""
    _compare_digest(frame, int(digest))


def _compare_digest(frame: Frame, computed: int) -> None:
    stored, computed = body_digest_of(frame.header), computed & U64
    if stored != computed:
        raise DigestError("body_digest", expected=f"{stored:#018x}", got=f"{computed:#018x}")


def _per_entry(header: Header, sections: list[tuple[torch.Tensor, ...]]) -> Payload:
    if header.kind == Kind.FULL:
        return _full(header, sections)
    indices, values = [], []
    for entry, entry_sections in zip(header.entries, sections):
        n_index = len(entry.index_sections())
        index_sections, value_sections = entry_sections[:n_index], entry_sections[n_index:]
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


def _split(header: Header, segments: tuple[torch.Tensor, ...]
           ) -> list[tuple[torch.Tensor, ...]]:
    """Per entry, its sections: views of the segment that holds each (a section across
    segments is copied together)."""
    table = header.sections()
    if len(segments) == 1:  # a delta's body: plain slices, no segment search
        views, pos, body = [], 0, segments[0]
        for size in table.sizes:
            views.append(body[pos:pos + size])
            pos += -(-size // ALIGNMENT) * ALIGNMENT
    else:
        # where each section lies depends only on the table and the segments' sizes, the
        # same for every full version of a stream; a section that is a whole segment (a
        # dense tensor) is that segment, no view made
        places = _places(table.sizes, tuple(s.numel() for s in segments))
        views = [segments[p] if p.__class__ is int else _cut(segments, p) for p in places]
    found = iter(views)
    return [tuple(itertools.islice(found, n)) for n in table.per_entry]


@functools.lru_cache(maxsize=TABLE_CACHE)
def _places(sizes: tuple[int, ...], segment_sizes: tuple[int, ...]
            ) -> tuple[int | tuple[int, int, int, int], ...]:
    """Per section of ``sizes`` (padded to the alignment, in body order) in a body made
    of segments of ``segment_sizes``: the index of the segment it is exactly, else
    (first segment, last segment, start, stop), start and stop counted from the first
    segment's start."""
    bounds = list(itertools.accumulate(segment_sizes, initial=0))
    places, pos = [], 0
    for size in sizes:
        first = bisect.bisect_right(bounds, pos) - 1
        if size == 0 or first == len(segment_sizes):
            places.append((0, -1, 0, 0))
        else:
            last = bisect.bisect_left(bounds, pos + size) - 1
            start = pos - bounds[first]
            whole = first == last and start == 0 and size == segment_sizes[first]
            places.append(first if whole else (first, last, start, start + size))
        pos += align(size)
    return tuple(places)


def _cut(segments: tuple[torch.Tensor, ...], place: tuple[int, int, int, int]
         ) -> torch.Tensor:
    """The bytes ``place`` (``_places``) of ``segments``: an empty section is an empty
    view of the first segment, one across segments is copied together."""
    first, last, start, stop = place
    if last < 0:
        return segments[0][:0] if segments else torch.empty(0, dtype=torch.uint8)
    joined = segments[first] if first == last else torch.cat(segments[first:last + 1])
    return joined[start:stop]
