"""Triton building blocks of the fused codec kernels: the same bit arithmetic as ``bits.py``
and ``fields.py``, per element inside a kernel.

A kernel program takes ``BLOCK`` consecutive elements of a flat index space cut into
segments (one per payload entry). Per-segment numbers sit in an int64 table of
``columns x segments`` (``column(table, c, segments, seg)``); an element finds its segment
by a binary search over the first column (the segments' flat starts, ``segment_of``), or,
where each block lies inside one segment (the encoder's layout), the program reads its
segment once from a block -> segment table. Tensors of different entries are reached through
their addresses in the table (``load_int``), so one launch covers every tensor.

``put_fields`` writes bit fields into int64 body words: a segmented scan over a block's
fields gives each word its value, stored once by one lane; only the words a block shares
with its neighbours (its first and last, and a spill past its end) take an atomic add.
Elements that write nothing give width 0 at the position of their stream's next field.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_positions(total, BLOCK: tl.constexpr):
    """This program's block, its flat positions, and which of them are inside ``total``."""
    block = tl.program_id(0)
    k = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return block, k, k < total


@triton.jit
def flags_before(before, block, flags):
    """Per element, the flags set before it in the flat space: ``before[block]`` (a prefix
    sum of per-block counts) plus those ahead of it in its block."""
    flags = flags.to(tl.int64)
    return tl.load(before + block) + tl.cumsum(flags, 0) - flags


@triton.jit
def width_mask(width):
    """``2**width - 1`` for int64 widths 0..64 (all ones for 64)."""
    ones = width * 0 + 1
    return tl.where(width >= 64, -ones, (ones << tl.minimum(width, 63)) - 1)


@triton.jit
def shift_right(x, n):
    """Logical right shift of int64 ``x`` by ``n`` in 0..63."""
    return (x.to(tl.uint64, bitcast=True) >> n.to(tl.uint64)).to(tl.int64, bitcast=True)


@triton.jit
def bit_length(x):
    """Bits needed for each non-negative int64 ``x`` (0 for 0)."""
    n = x * 0
    for i in tl.static_range(6):
        big = (x >> (32 >> i)) != 0
        x = tl.where(big, x >> (32 >> i), x)
        n += tl.where(big, 32 >> i, 0)
    return n + (x != 0).to(tl.int64)


@triton.jit
def order_key(bits, width):
    """``bits.order_keys_by_width``: unsigned patterns to keys in the floats' order."""
    top = (bits * 0 + 1) << (width - 1)
    return tl.where((bits & top) != 0, bits ^ width_mask(width), bits | top)


@triton.jit
def from_order_key(keys, width):
    """``bits.from_order_keys_by_width``."""
    top = (keys * 0 + 1) << (width - 1)
    return tl.where((keys & top) != 0, keys ^ top, keys ^ width_mask(width))


@triton.jit
def segment_of(table, segments, k, LOG: tl.constexpr):
    """Per flat position ``k``, the last segment whose start (column 0) is ``<= k``;
    ``LOG`` is ``(segments - 1).bit_length()``."""
    seg = k * 0
    for i in tl.static_range(LOG):
        candidate = seg + (1 << (LOG - 1 - i))
        inside = candidate < segments
        start = tl.load(table + tl.minimum(candidate, segments - 1))
        seg = tl.where(inside & (start <= k), candidate, seg)
    return seg


@triton.jit
def column(table, c, segments, seg):
    return tl.load(table + c * segments + seg)


@triton.jit
def load_int(address, at, size, mask):
    """Element ``at`` of the tensor at ``address`` with ``size``-byte items (1, 2, 4 or 8),
    as int64 (1-byte items zero-extended, the others sign-extended). ``address`` and
    ``size`` may be scalars (``tl.where``, not ``&``: Triton's interpreter types a scalar
    flag ANDed with a block of flags as int64, which a mask refuses)."""
    one = tl.load(address.to(tl.pointer_type(tl.uint8)) + at, mask=tl.where(size == 1, mask, False),
                  other=0)
    two = tl.load(address.to(tl.pointer_type(tl.int16)) + at, mask=tl.where(size == 2, mask, False),
                  other=0)
    four = tl.load(address.to(tl.pointer_type(tl.int32)) + at,
                   mask=tl.where(size == 4, mask, False), other=0)
    eight = tl.load(address.to(tl.pointer_type(tl.int64)) + at,
                    mask=tl.where(size == 8, mask, False), other=0)
    return tl.where(size == 1, one.to(tl.int64),
                    tl.where(size == 2, two.to(tl.int64),
                             tl.where(size == 4, four.to(tl.int64), eight)))


@triton.jit
def store_int(address, at, value, size, mask):
    """Store the low ``size`` bytes of int64 ``value`` as element ``at`` of the tensor at
    ``address`` (``size`` 1, 2, 4 or 8)."""
    tl.store(address.to(tl.pointer_type(tl.uint8)) + at, value.to(tl.uint8), mask=mask & (size == 1))
    tl.store(address.to(tl.pointer_type(tl.int16)) + at, value.to(tl.int16), mask=mask & (size == 2))
    tl.store(address.to(tl.pointer_type(tl.int32)) + at, value.to(tl.int32), mask=mask & (size == 4))
    tl.store(address.to(tl.pointer_type(tl.int64)) + at, value, mask=mask & (size == 8))


@triton.jit
def _word_scan(word_a, low_a, spill_a, word_b, low_b, spill_b):
    """Combine two runs of fields whose words never decrease: the later one's last word,
    every bit the pair puts into it (its fields' low parts, the high parts of fields
    that start one word before) and the high parts it spills into the word after."""
    same = word_a == word_b
    before = word_a + 1 == word_b
    return (word_b, low_b | tl.where(same, low_a, tl.where(before, spill_a, 0)),
            spill_b | tl.where(same, spill_a, 0))


@triton.jit
def put_fields(words, pos, value, width, valid, next_pos, has_next):
    """Write the low ``width`` bits (0..64) of each valid element's ``value`` into the
    zeroed body ``words`` at bit ``pos``; ``next_pos``: the next element's position in
    the same field stream (if ``has_next``, i.e. it is valid and in this block).
    Positions never decrease along a block's valid elements, fields never overlap, a
    64-bit field starts on a word boundary, and a stream's section starts on one
    (``header.ALIGNMENT``), so a word holds fields of one stream only.

    An inclusive segmented scan (``_word_scan``) gives the last element of each run of
    elements that share a word the whole word as far as this block writes it, including
    the high parts of fields that straddle into it from the word before. That element
    stores it with one plain store when the word is inside the block's range (no other
    block writes it); the block's first and last words, which a neighbouring block may
    share, and a spill past the block's last field take an atomic add instead (fields
    are disjoint, so adding is OR-ing). Words this block leaves empty are not written.
    """
    shift = pos & 63
    field = value & width_mask(width)
    live = valid & (width > 0)
    # past the valid elements, a word no valid element has: they join no run
    word = tl.where(valid, pos >> 6, 0x3FFFFFFFFFFFFFFF)
    low = tl.where(live, field << shift, 0)
    straddles = live & (shift + width > 64)
    spill = tl.where(straddles, shift_right(field, tl.where(straddles, 64 - shift, 0)), 0)
    _, bits, spills = tl.associative_scan((word, low, spill), 0, _word_scan)
    next_word = tl.where(has_next, next_pos >> 6, -1)
    ends = valid & (next_word != word)
    first = tl.min(word, 0)
    last = tl.max(tl.where(valid, word, -1), 0)
    shared = (word == first) | (word == last)
    tl.store(words + word, bits, mask=ends & ~shared & (bits != 0))
    tl.atomic_add(words + word, bits, mask=ends & shared & (bits != 0), sem="relaxed")
    # a spill into a word the next element starts in is in that element's run already
    tl.atomic_add(words + word + 1, spills, mask=ends & (next_word != word + 1) & (spills != 0),
                  sem="relaxed")


@triton.jit
def get_fields(words, pos, width, last):
    """The ``width``-bit unsigned fields at bit ``pos`` of ``words`` (``fields.read_fields``);
    a field of width 0 reads nothing, and words past ``last`` read as the last one, so
    untrusted positions never fault."""
    shift = pos & 63
    word = tl.minimum(tl.maximum(pos >> 6, 0), last)
    used = width > 0
    low = shift_right(tl.load(words + word, mask=used, other=0), shift)
    upper = tl.load(words + tl.minimum(word + 1, last), mask=used & (shift > 0), other=0)
    return (low | (upper << tl.where(shift > 0, 64 - shift, 0))) & width_mask(width)
