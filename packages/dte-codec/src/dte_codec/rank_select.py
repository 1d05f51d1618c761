"""Rank and select over 64-bit words inside a Triton kernel: how ``decode_kernel`` finds
the k-th set bit of an Elias-Fano upper stream or a bitmap.

``popcount`` counts each word's set bits (their prefix sum ranks every set bit);
``bounds`` and ``last_at_most`` search that non-decreasing rank table for the word that
holds a given rank; ``select`` finds the bit inside the word.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_bits import bit_length, shift_right

_LOG = tl.constexpr(6)
_FAN = tl.constexpr(1 << _LOG.value)
"""``bounds`` probes ``_FAN`` slots per target and step."""


@triton.jit
def popcount(x):
    x = x - (shift_right(x, x * 0 + 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + (shift_right(x, x * 0 + 2) & 0x3333333333333333)
    x = (x + shift_right(x, x * 0 + 4)) & 0x0F0F0F0F0F0F0F0F
    return shift_right(x * 0x0101010101010101, x * 0 + 56)


@triton.jit
def last_at_most(before, lo, hi, target, steps):
    """The last slot in ``[lo, hi]`` whose ``before`` (non-decreasing) is at most
    ``target``, given that ``before[lo]`` is; ``steps`` halvings of ``hi - lo`` (its bit
    length) reach it. Blocks of slots; every load stays inside ``[lo, hi]``."""
    for _ in range(steps):
        mid = (lo + hi + 1) >> 1
        ok = tl.load(before + mid) <= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def bounds(before, first, end, head, tail):
    """``last_at_most`` over ``[first, end]`` for the two scalars ``head <= tail`` at once,
    with ``_FAN`` probes per target and step: ``log`` of the range's length to that base
    in dependent loads, where a bisection takes its binary log, twice (those loads wait on
    each other, and they decided this kernel's time). A step's probes cut each range into
    pieces of ``step`` slots; those at most the target are a prefix, so their count picks
    the piece. Returns the slots of ``head`` and ``tail``."""
    row = tl.arange(0, 2)[:, None]
    lane = tl.arange(1, _FAN + 1)[None, :].to(tl.int64)
    target = tl.where(row == 0, head, tail)
    lo = first + row * 0
    hi = end + row * 0
    for _ in range((bit_length(end - first) + _LOG - 1) // _LOG):
        step = tl.maximum((hi - lo + _FAN - 1) >> _LOG, 1)
        probe = lo + lane * step
        inside = probe <= hi
        ok = inside & (tl.load(before + probe, mask=inside, other=0) <= target)
        lo = lo + tl.sum(ok.to(tl.int64), 1)[:, None] * step
        hi = tl.minimum(hi, lo + step - 1)
    return tl.sum(tl.where(row == 0, lo, 0)), tl.sum(tl.where(row == 1, lo, 0))


@triton.jit
def select(data, inside):
    """The position of the ``inside``-th (0-based) set bit of each int64 ``data``.

    The low half's set bits pick the half; in it the popcount's partial sums are kept: set
    bits per 2, 4, 8 and 16 bits (each count in the low bits of its field). From the half
    down, each level skips the low half of the current field when ``inside`` lies past its
    set bits: five compares, no popcount per level. All in 32 bits: a 64-bit shift or mask
    takes two instructions or more, and a whole word's partial sums held the registers
    that limited the kernel's programs per SM."""
    inside = inside.to(tl.int32)
    low = data.to(tl.uint32)
    low_ones = _popcount32(low)
    up = inside >= low_ones
    half = tl.where(up, shift_right(data, data * 0 + 32).to(tl.uint32), low)
    inside = tl.where(up, inside - low_ones, inside)
    pairs = half - ((half >> 1) & 0x55555555)
    nibbles = (pairs & 0x33333333) + ((pairs >> 2) & 0x33333333)
    bytes_ = (nibbles + (nibbles >> 4)) & 0x0F0F0F0F
    pos = inside * 0
    pos, inside = _skip_low(bytes_ + (bytes_ >> 8), pos, inside, 16)
    pos, inside = _skip_low(bytes_, pos, inside, 8)
    pos, inside = _skip_low(nibbles, pos, inside, 4)
    pos, inside = _skip_low(pairs, pos, inside, 2)
    pos, _ = _skip_low(half, pos, inside, 1)
    return (pos + tl.where(up, 32, 0)).to(tl.int64)


@triton.jit
def _popcount32(x):
    """Set bits of each uint32 ``x``, as int32."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    return ((((x + (x >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _skip_low(counts, pos, inside, HALF: tl.constexpr):
    """One level of ``select``: past the low ``HALF`` bits of the field at ``pos`` (of the
    half) when ``inside`` is at least their set-bit count (in ``counts``' low bits there)."""
    low = ((counts >> pos.to(tl.uint32)) & (2 * HALF - 1)).to(tl.int32)
    more = inside >= low
    return pos + tl.where(more, HALF, 0), tl.where(more, inside - low, inside)
