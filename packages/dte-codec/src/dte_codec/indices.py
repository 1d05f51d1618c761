"""Exact encodings of a sorted set of flat indices, chosen by byte cost in closed form.

Decoders use only prefix sums, comparisons, gathers and scatters, so they run on the
receiver's device, and they validate what they produce: indices strictly increasing and
inside ``[0, numel)``, escape counts matching the header.
"""

from __future__ import annotations

import attrs
import torch

from .bits import pack_bits, pack_fields, unpack_bits, unpack_fields
from .encoding_choice import choose_indices
from .encodings import INDEX32_LIMIT, IndexEncoding, index_itemsize
from .entry import Entry
from .errors import CodecError, EntryError

GAP_ESCAPE = 0
"""Byte value marking a gap stored in the escape list (a real gap is always >= 1)."""
MAX_GAP_BYTE = 255


@attrs.frozen
class Encoded:
    """An index encoding with its header fields and body sections."""

    encoding: IndexEncoding
    sections: tuple[torch.Tensor, ...]
    width: int = 0
    escapes: int = 0

    @property
    def size(self) -> int:
        return sum(s.numel() for s in self.sections)


def encode_indices(indices: torch.Tensor, numel: int) -> Encoded:
    """The smallest exact encoding of sorted, unique int64 ``indices`` into ``numel`` elements.

    Sizes come in closed form (``choose_indices``) and only the winner is built.
    """
    escapes = int((_gaps(indices) > MAX_GAP_BYTE).sum())
    encoding = choose_indices(indices.numel(), numel, gap_escapes=escapes)["index_encoding"]
    build = {IndexEncoding.INT32: _raw, IndexEncoding.INT64: _raw, IndexEncoding.GAP8: _gap8,
             IndexEncoding.ELIAS_FANO: _elias_fano, IndexEncoding.BITMAP: _bitmap}[encoding]
    return build(indices, numel)


def _raw(indices: torch.Tensor, numel: int) -> Encoded:
    small = numel < INDEX32_LIMIT
    dtype = torch.int32 if small else torch.int64
    encoding = IndexEncoding.INT32 if small else IndexEncoding.INT64
    return Encoded(encoding, (indices.to(dtype).view(torch.uint8),))


def _bitmap(indices: torch.Tensor, numel: int) -> Encoded:
    mask = torch.zeros(numel, dtype=torch.bool, device=indices.device)
    mask[indices] = True
    return Encoded(IndexEncoding.BITMAP, (pack_bits(mask),))


def _gaps(indices: torch.Tensor) -> torch.Tensor:
    return torch.diff(indices, prepend=indices.new_full((1,), -1))


def _gap8(indices: torch.Tensor, numel: int) -> Encoded:
    gaps = _gaps(indices)
    wide = gaps > MAX_GAP_BYTE
    dtype = _escape_dtype(numel)
    small = gaps.masked_fill(wide, GAP_ESCAPE).to(torch.uint8)
    escaped = gaps[wide].to(dtype).view(torch.uint8)
    return Encoded(IndexEncoding.GAP8, (small, escaped), escapes=int(wide.sum()))


def _elias_fano(indices: torch.Tensor, numel: int) -> Encoded:
    n = indices.numel()
    width = max(0, (numel // n).bit_length() - 1)
    low = pack_fields(indices & ((1 << width) - 1), width)
    upper_bits = n + ((numel - 1) >> width) + 1
    upper = torch.zeros(upper_bits, dtype=torch.bool, device=indices.device)
    upper[(indices >> width) + torch.arange(n, device=indices.device)] = True
    return Encoded(IndexEncoding.ELIAS_FANO, (low, pack_bits(upper)), width=width)


def _escape_dtype(limit: int) -> torch.dtype:
    return torch.int32 if index_itemsize(limit) == 4 else torch.int64


def decode_indices(entry: Entry, sections: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Decode and validate an entry's index sections into int64 flat indices."""
    enc = entry.index_encoding
    if enc in (IndexEncoding.INT32, IndexEncoding.INT64):
        dtype = torch.int32 if enc == IndexEncoding.INT32 else torch.int64
        indices = sections[0].view(dtype).to(torch.int64)
    elif enc == IndexEncoding.BITMAP:
        indices = _decode_bitmap(entry, sections[0])
    elif enc == IndexEncoding.GAP8:
        indices = _decode_gap8(entry, *sections)
    else:
        indices = _decode_elias_fano(entry, *sections)
    check_sorted_positions(indices, entry.numel, field="indices", tensor=entry.name)
    return indices


def check_sorted_positions(positions: torch.Tensor, limit: int, *, field: str, tensor: str,
                           error: type[CodecError] = EntryError) -> None:
    """Raise ``error`` unless ``positions`` strictly increase inside ``[0, limit)``."""
    if positions.numel() == 0:
        return
    # min/max, not first/last: int64 differences wrap, so an out-of-range run can look
    # increasing; once every position is inside [0, limit) the differences are exact.
    lowest, highest = int(positions.min()), int(positions.max())
    if lowest < 0 or highest >= limit:
        raise error(field, expected=f"inside [0, {limit})", got=f"[{lowest}, {highest}]",
                    tensor=tensor)
    steps = torch.diff(positions)
    if bool((steps <= 0).any()):
        at = int(torch.nonzero(steps <= 0)[0]) + 1
        raise error(field, expected="strictly increasing",
                         got=f"{int(positions[at])} after {int(positions[at - 1])} at {at}",
                         tensor=tensor)


def _decode_bitmap(entry: Entry, packed: torch.Tensor) -> torch.Tensor:
    bits = unpack_bits(packed, packed.numel() * 8)
    if bool(bits[entry.numel:].any()):
        raise EntryError("bitmap padding", expected="zero bits past numel", got="set bits",
                         tensor=entry.name)
    indices = torch.nonzero(bits[: entry.numel]).view(-1)
    if indices.numel() != entry.count:
        raise EntryError("bitmap", expected=f"{entry.count} set bits", got=indices.numel(),
                         tensor=entry.name)
    return indices


def _decode_gap8(entry: Entry, small: torch.Tensor, escaped: torch.Tensor) -> torch.Tensor:
    gaps = small.to(torch.int64)
    wide = gaps == GAP_ESCAPE
    if int(wide.sum()) != entry.index_escapes:
        raise EntryError("index_escapes", expected=f"{entry.index_escapes} escape bytes",
                         got=int(wide.sum()), tensor=entry.name)
    values = escaped.view(_escape_dtype(entry.numel)).to(torch.int64)
    if values.numel() and not bool(((values > MAX_GAP_BYTE) & (values <= entry.numel)).all()):
        raise EntryError("escaped gaps", expected=f"in ({MAX_GAP_BYTE}, {entry.numel}]",
                         got=f"[{int(values.min())}, {int(values.max())}]", tensor=entry.name)
    gaps[wide] = values
    return torch.cumsum(gaps, 0) - 1


def _decode_elias_fano(entry: Entry, low: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    n, width = entry.count, entry.index_width
    upper_bits = n + ((entry.numel - 1) >> width) + 1
    bits = unpack_bits(upper, upper.numel() * 8)
    ones = torch.nonzero(bits[:upper_bits]).view(-1)
    if ones.numel() != n or bool(bits[upper_bits:].any()):
        raise EntryError("elias-fano upper bits", expected=f"{n} set bits, zero padding",
                         got=f"{int(bits.sum())} set bits", tensor=entry.name)
    high = ones - torch.arange(n, device=ones.device)
    return (high << width) | unpack_fields(low, n, width)
