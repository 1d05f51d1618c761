"""Exact encodings of the new values at changed positions.

``RAW`` sends the payload-dtype bit patterns. ``RESIDUE`` sends, per value, only the low
``width`` bits of its order key (see ``bits.order_keys``); the receiver recovers the
difference against its own base value ``b`` as the unique ``d`` in
``[-2**(width-1), 2**(width-1))`` with ``key(b) + d == residue (mod 2**width)``. The
sender never needs the exact base: it needs bounds ``[low, high]`` on it (exact when
``low == high``), and codes a value as a residue only if every base in the bounds
recovers it; the others travel raw in an escape list. Most changes are +-1 ulp, so a
2-4 bit residue covers nearly all values.
"""

from __future__ import annotations

import attrs
import torch

from .bits import BYTE_BITS, bit_length, from_order_keys, order_keys, pack_fields, unpack_fields
from .encoding_choice import choose_values
from .encodings import RESIDUE_DTYPES, ValueEncoding, index_itemsize
from .entry import Entry
from .errors import EntryError
from .indices import check_sorted_positions

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@attrs.frozen
class Encoded:
    """A value encoding with its header fields and body sections."""

    encoding: ValueEncoding
    sections: tuple[torch.Tensor, ...]
    width: int = 0
    escapes: int = 0

    @property
    def size(self) -> int:
        return sum(s.numel() for s in self.sections)


def int_view(values: torch.Tensor) -> torch.Tensor:
    """The same bytes as the signed integer type of equal width."""
    return values.view(_INT_VIEW[values.element_size()])


def encode_values(new: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> Encoded:
    """The smallest exact encoding of ``new`` given bounds ``[low, high]`` on the base."""
    raw = Encoded(ValueEncoding.RAW, (new.contiguous().view(torch.uint8),))
    if new.dtype not in RESIDUE_DTYPES or new.numel() == 0:
        return raw
    bits = new.element_size() * BYTE_BITS
    need = _needed_width(new, low, high, bits)
    counts = torch.bincount(need, minlength=bits + 1).tolist()
    chosen = choose_values(new.numel(), new.dtype, new.element_size(), counts)
    if not chosen:
        return raw
    return _residues(new, need, chosen["value_width"], bits)


def _needed_width(new: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                  bits: int) -> torch.Tensor:
    """Smallest residue width that decodes ``new`` from every base in ``[low, high]``."""
    key = order_keys(int_view(new), bits)
    above = key - order_keys(int_view(low), bits) + 1  # d <= 2**(w-1) - 1 for the lowest base
    below = order_keys(int_view(high), bits) - key  # d >= -2**(w-1) for the highest base
    span = torch.maximum(torch.maximum(above, below), torch.ones_like(key))
    return 1 + bit_length(span - 1)


def _residues(new: torch.Tensor, need: torch.Tensor, width: int, bits: int) -> Encoded:
    key = order_keys(int_view(new), bits)
    escaped = need > width
    positions = torch.nonzero(escaped).view(-1)
    position_dtype = torch.int32 if index_itemsize(new.numel()) == 4 else torch.int64
    fields = pack_fields(key[~escaped] & ((1 << width) - 1), width)
    sections = (fields, positions.to(position_dtype).view(torch.uint8),
                new[escaped].contiguous().view(torch.uint8))
    return Encoded(ValueEncoding.RESIDUE, sections, width=width, escapes=positions.numel())


def check_escapes(entry: Entry, sections: tuple[torch.Tensor, ...]) -> None:
    """Validate the escape positions of a residue entry (no base needed)."""
    if entry.value_encoding == ValueEncoding.RESIDUE:
        positions = _positions(entry, sections[1])
        check_sorted_positions(positions, entry.count, field="value escape positions",
                               tensor=entry.name)


def _positions(entry: Entry, section: torch.Tensor) -> torch.Tensor:
    dtype = torch.int32 if index_itemsize(entry.count) == 4 else torch.int64
    return section.view(dtype).to(torch.int64)


def decode_values(entry: Entry, sections: tuple[torch.Tensor, ...],
                  base: torch.Tensor) -> torch.Tensor:
    """The new values of an entry, resolved against the receiver's ``base`` values."""
    if entry.value_encoding == ValueEncoding.RAW:
        return sections[0].view(entry.dtype)
    fields, positions, escaped = sections
    bits, width = entry.itemsize * 8, entry.value_width
    escapes = _positions(entry, positions)
    keep = torch.ones(entry.count, dtype=torch.bool, device=base.device)
    keep[escapes] = False
    base_key = order_keys(int_view(base[keep]), bits)
    residues = unpack_fields(fields, entry.count - entry.value_escapes, width)
    modulus = 1 << width
    diff = (residues - base_key) & (modulus - 1)
    key = base_key + torch.where(diff >= modulus // 2, diff - modulus, diff)
    if key.numel() and (int(key.min()) < 0 or int(key.max()) >= 1 << bits):
        raise EntryError("values", expected="residues that decode inside the dtype's range",
                         got="a residue that does not fit this receiver's base",
                         tensor=entry.name)
    out = torch.empty(entry.count, dtype=entry.dtype, device=base.device)
    int_view(out)[keep] = from_order_keys(key, bits).to(int_view(out).dtype)
    out[escapes] = escaped.view(entry.dtype)
    return out
