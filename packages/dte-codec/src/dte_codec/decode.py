"""Parse and validate a payload: header, digest, section sizes, indices and escapes.

Everything that can be checked without the receiver's tensors is checked here, so that
``apply_`` only has to match names, dtypes and shapes before it writes.
"""

from __future__ import annotations

import bisect
import functools
import itertools

import attrs
import torch

from .body_digest import body_digest
from .errors import DigestError, EntryError, HeaderError
from .fields import batched
from .frame import Frame
from .flat_decode import SPARSE, decode_indices_flat
from .header import (ALIGNMENT, TABLE_CACHE, Entry, Header, IndexEncoding, Kind, align,
                     body_digest_of)
from .indices import decode_indices
from .region import Box
from .values import check_escapes


@attrs.frozen
class Payload:
    """A decoded payload: its header and, per entry, validated indices and value sections."""

    header: Header
    indices: tuple[torch.Tensor | Box, ...]
    """Per entry, int64 flat indices (sparse entries) or the box it covers (dense and box
    entries; a dense entry covers its whole tensor)."""
    values: tuple[tuple[torch.Tensor, ...], ...]
    """Per entry, the value sections as uint8 tensors (see ``FORMAT.md``)."""

    @property
    def nbytes(self) -> int:
        """Size of the body in bytes (the header is not counted)."""
        return self.header.body_size()


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
    header, frame = _open(data, device)
    sections = _split(header, frame.segments)
    if not batched(frame.device):
        return _per_entry(header, sections)
    return _batched(header, frame, sections)


def decode_batched(data: Frame | bytes | bytearray | memoryview, *,
                   device: str | torch.device | None = None) -> Payload:
    """``decode`` with every sparse entry's indices found together (``flat_decode``), on
    any device: a fixed number of device passes and one host synchronization."""
    header, frame = _open(data, device)
    return _batched(header, frame, _split(header, frame.segments))


def _batched(header: Header, frame: Frame, sections: list[tuple[torch.Tensor, ...]]
             ) -> Payload:
    if not any(entry.index_encoding in SPARSE for entry in header.entries):
        return _per_entry(header, sections)  # nothing to decode, no body copy
    flat = decode_indices_flat(header.entries, frame.body())
    try:
        regions = [None if entry.index_encoding in SPARSE else _region(entry, entry_sections)
                   for entry, entry_sections in zip(header.entries, sections)]
    except EntryError:
        regions = None
    if regions is None or not flat.valid():  # the one host synchronization
        return _per_entry(header, sections)  # raises the first failed check, in order
    found = iter(flat.indices)
    indices = [next(found) if region is None else region for region in regions]
    values = [s[len(e.index_sections()):] for e, s in zip(header.entries, sections)]
    return Payload(header=header, indices=tuple(indices), values=tuple(values))


def decode_per_entry(data: Frame | bytes | bytearray | memoryview, *,
                     device: str | torch.device | None = None) -> Payload:
    """``decode`` entry by entry: the reference the batched decoder matches, and the path
    that raises the first failed check in ``FORMAT.md``'s order."""
    header, frame = _open(data, device)
    return _per_entry(header, _split(header, frame.segments))


def _open(data: Frame | bytes | bytearray | memoryview, device: str | torch.device | None
          ) -> tuple[Header, Frame]:
    """The validated header and the frame on ``device``, its body digest checked."""
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
    header = Header.unpack_head(memoryview(frame.header), frame.body_size)
    stored, computed = body_digest_of(frame.header), body_digest(frame.segments)
    if stored != computed:
        raise DigestError("body_digest", expected=f"{stored:#018x}", got=f"{computed:#018x}")
    return header, frame


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
