"""Parse and validate a payload: header, digest, section sizes, indices and escapes.

Everything that can be checked without the receiver's tensors is checked here, so that
``apply_`` only has to match names, dtypes and shapes before it writes.
"""

from __future__ import annotations

import attrs
import torch

from .errors import EntryError
from .fields import WORD_BYTES, batched
from .flat_decode import SPARSE, decode_indices_flat
from .header import Entry, Header, IndexEncoding, align
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


def decode(data: bytes | bytearray | memoryview, *, device: str | torch.device = "cpu"
           ) -> Payload:
    """Parse ``data`` into a ``Payload`` whose tensors live on ``device``.

    On a GPU every sparse entry's indices are decoded together (``decode_batched``),
    on the CPU entry by entry (``decode_per_entry``); see ``fields.batched``.

    Raises:
        HeaderError: truncated or inconsistent header fields.
        DigestError: the bytes do not match the header's digest.
        EntryError: invalid indices or escape positions inside an entry.
    """
    view = memoryview(data).cast("B")
    header, offset = Header.unpack(view)
    body = _body(view[offset:], device)
    sections = _split(header, body)
    if not batched(body.device):
        return _per_entry(header, sections)
    return _batched(header, body, sections)


def decode_batched(data: bytes | bytearray | memoryview, *,
                   device: str | torch.device = "cpu") -> Payload:
    """``decode`` with every sparse entry's indices found together (``flat_decode``), on
    any device: a fixed number of device passes and one host synchronization."""
    view = memoryview(data).cast("B")
    header, offset = Header.unpack(view)
    body = _body(view[offset:], device)
    return _batched(header, body, _split(header, body))


def _batched(header: Header, body: torch.Tensor,
             sections: list[tuple[torch.Tensor, ...]]) -> Payload:
    flat = decode_indices_flat(header.entries, body)
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


def decode_per_entry(data: bytes | bytearray | memoryview, *,
                     device: str | torch.device = "cpu") -> Payload:
    """``decode`` entry by entry: the reference the batched decoder matches, and the path
    that raises the first failed check in ``FORMAT.md``'s order."""
    view = memoryview(data).cast("B")
    header, offset = Header.unpack(view)
    body = _body(view[offset:], device)
    return _per_entry(header, _split(header, body))


def _per_entry(header: Header, sections: list[tuple[torch.Tensor, ...]]) -> Payload:
    indices, values = [], []
    for entry, entry_sections in zip(header.entries, sections):
        n_index = len(entry.index_sections())
        index_sections, value_sections = entry_sections[:n_index], entry_sections[n_index:]
        check_escapes(entry, value_sections)
        indices.append(_region(entry, index_sections))
        values.append(value_sections)
    return Payload(header=header, indices=tuple(indices), values=tuple(values))


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


def _body(raw: memoryview, device: str | torch.device) -> torch.Tensor:
    if len(raw) == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    body = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if body.data_ptr() % WORD_BYTES:  # the flat decoder reads the body as int64 words
        body = body.clone()
    return body.to(device)


def _split(header: Header, body: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    out, pos = [], 0
    for entry in header.entries:
        sections = []
        for size in entry.section_sizes():
            sections.append(body[pos:pos + size])
            pos += align(size)
        out.append(tuple(sections))
    return out

