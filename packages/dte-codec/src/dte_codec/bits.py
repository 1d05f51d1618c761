"""Bit-level building blocks, all vectorised torch ops so they run on the tensor's device.

Bit order is little-endian everywhere: bit ``i`` of a packed stream is bit ``i % 8`` (LSB
first) of byte ``i // 8``, and a ``width``-bit field stores its least significant bit first.
"""

from __future__ import annotations

import torch

BYTE_BITS = 8


def ceil_bytes(bits):
    """Bytes that hold ``bits`` bits (non-negative integers, an array or a tensor): a
    shift, cheaper than a division."""
    return (bits + (BYTE_BITS - 1)) >> 3


def _shifts(count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(count, device=device, dtype=torch.int64)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into ``ceil(n / 8)`` bytes (LSB first, zero padding)."""
    n = mask.numel()
    padded = torch.zeros(-(-n // BYTE_BITS) * BYTE_BITS, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.reshape(-1)
    weights = 1 << _shifts(BYTE_BITS, mask.device).to(torch.uint8)
    return (padded.view(-1, BYTE_BITS) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``count`` bits of ``packed`` as a bool tensor."""
    shifts = _shifts(BYTE_BITS, packed.device).to(torch.uint8)
    bits = (packed.to(torch.uint8).unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:count].bool()


def pack_fields(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative int64 values, each into ``width`` bits."""
    bits = (values.to(torch.int64).unsqueeze(1) >> _shifts(width, values.device)) & 1
    return pack_bits(bits.reshape(-1))


def unpack_fields(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of ``pack_fields``: ``count`` int64 values of ``width`` bits each."""
    bits = unpack_bits(packed, count * width).view(count, width).to(torch.int64)
    return (bits << _shifts(width, packed.device)).sum(1)


def bit_length(values: torch.Tensor) -> torch.Tensor:
    """Number of bits needed for each non-negative int64 value < 2**53 (0 for 0)."""
    _, exponent = torch.frexp(values.to(torch.float64))
    return exponent.to(torch.int64)


def order_keys(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Map sign-magnitude float bit patterns to unsigned keys in the floats' total order.

    Negative patterns are flipped, positive ones get the top bit set, so keys increase
    with the value (-0 sits just below +0, NaNs at both ends). The map is a bijection on
    ``width``-bit patterns; ``from_order_keys`` inverts it.
    """
    mask = (1 << width) - 1
    top = 1 << (width - 1)
    unsigned = bits.to(torch.int64) & mask
    negative = (unsigned & top) != 0
    return torch.where(negative, unsigned ^ mask, unsigned | top)


def from_order_keys(keys: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of ``order_keys``: unsigned ``width``-bit patterns as int64."""
    mask = (1 << width) - 1
    top = 1 << (width - 1)
    upper_half = (keys & top) != 0
    return torch.where(upper_half, keys ^ top, keys ^ mask)


def width_mask(width: torch.Tensor) -> torch.Tensor:
    """``2**width - 1`` per element for int64 widths 0..64 (all ones for 64)."""
    ones = torch.ones_like(width)
    return torch.where(width >= 64, -ones, (ones << width.clamp(max=63)) - 1)


def order_keys_by_width(bits: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """``order_keys`` of unsigned int64 patterns with a width (1..63) per element."""
    top = torch.ones_like(width) << (width - 1)
    return torch.where((bits & top) != 0, bits ^ width_mask(width), bits | top)


def from_order_keys_by_width(keys: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Inverse of ``order_keys_by_width``."""
    top = torch.ones_like(width) << (width - 1)
    return torch.where((keys & top) != 0, keys ^ top, keys ^ width_mask(width))
