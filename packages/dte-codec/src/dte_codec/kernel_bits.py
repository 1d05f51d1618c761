"""Triton building blocks of the fused codec kernels: the same bit arithmetic as ``bits.py``
and ``fields.py``, per element inside a kernel.

A kernel program takes ``BLOCK`` consecutive elements of a flat index space cut into
segments (one per payload entry). Per-segment numbers sit in an int64 table of
``columns x segments`` (``column(table, c, segments, seg)``). Each segment takes whole
blocks, so a program reads its segment once from a block -> segment table
(``fields.block_segments``; ``owned_block``): no per-element search, and no kernel is
compiled per segment count. Tensors of different entries are reached through
their addresses in the table (``load_uniform``/``store_uniform``: a block's items share
one size), so one launch covers every tensor.

``put_fields`` adds bit fields into int64 body words with two atomic adds per run of
elements of a warp that share a word (a field that straddles two words adds its high part
to the next one). Elements that write nothing give width 0 at a position inside the body, next
to their stream's fields, so runs stay long. ``put_packed`` stores the words of a stream
of consecutive fields whose width divides 64, each word once, with no atomics.
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl

SCAN_ROW = tl.constexpr(64)
"""Elements per prefix sum of ``put_fields``: with 2 elements per thread, one warp's, so
the scan needs shuffles only (a scan over the whole block crosses warps through shared
memory, with barriers); a run of fields sharing a word ends at a row's end too."""


def rows_of(table: Sequence[str], *names: str) -> tuple[tl.constexpr, ...]:
    """The rows ``names`` of a table whose rows are ``table``, as kernel constants: every
    table's row order is defined once, where the table is built."""
    return tuple(tl.constexpr(table.index(name)) for name in names)


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
def column(table, c, segments, seg):
    return tl.load(table + c * segments + seg)


@triton.jit
def owned_block(table, block_seg, segments, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """For a space where each segment takes whole blocks from the block in its column
    ``FIRST`` on: this program's block, its segment (one load from the block -> segment
    table ``block_seg``), and the ranks of the block's elements inside the segment."""
    block = tl.program_id(0)
    seg = tl.load(block_seg + block)
    rank = (block - column(table, FIRST, segments, seg)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return block, seg, rank


@triton.jit
def load_uniform(address, at, size, mask):
    """Element ``at`` of the tensor at ``address`` with ``size``-byte items (1, 2, 4 or 8, a
    scalar; ``address`` a scalar or one per element), as int64 (1-byte items zero-extended,
    the others sign-extended): a branch on the size, the same in every thread, runs one
    load."""
    out = tl.zeros(at.shape, tl.int64)
    if size == 1:
        out = tl.load(address.to(tl.pointer_type(tl.uint8)) + at, mask=mask, other=0).to(tl.int64)
    elif size == 2:
        out = tl.load(address.to(tl.pointer_type(tl.int16)) + at, mask=mask, other=0).to(tl.int64)
    elif size == 4:
        out = tl.load(address.to(tl.pointer_type(tl.int32)) + at, mask=mask, other=0).to(tl.int64)
    else:
        out = tl.load(address.to(tl.pointer_type(tl.int64)) + at, mask=mask, other=0)
    return out


@triton.jit
def store_uniform(address, at, value, size, mask):
    """Store the low ``size`` bytes of int64 ``value`` as element ``at`` of the tensor at
    ``address`` (``size`` 1, 2, 4 or 8, a scalar; ``address`` a scalar or one per element):
    a branch on the size, the same in every thread, runs one store."""
    if size == 1:
        tl.store(address.to(tl.pointer_type(tl.uint8)) + at, value.to(tl.uint8), mask=mask)
    elif size == 2:
        tl.store(address.to(tl.pointer_type(tl.int16)) + at, value.to(tl.int16), mask=mask)
    elif size == 4:
        tl.store(address.to(tl.pointer_type(tl.int32)) + at, value.to(tl.int32), mask=mask)
    else:
        tl.store(address.to(tl.pointer_type(tl.int64)) + at, value, mask=mask)


@triton.jit
def put_fields(words, pos, value, width, valid, next_pos, has_next):
    """Add the low ``width`` bits (0..64) of each valid element's ``value`` into the body
    ``words`` at bit ``pos``; ``next_pos``: the next element's position in the same field
    stream (if ``has_next``, i.e. it is valid and in this block). A 64-bit field must
    start on a word boundary.

    Fields never overlap, so adding is OR-ing. The elements of a row (``SCAN_ROW``
    consecutive elements of the block) that share a word and follow each other form a
    run; its sum is the difference of the row's prefix sums at its last element and at
    the last element before it (none at the row's start). So each run's last
    element adds the prefix sum at itself to its word and subtracts it from the next
    run's word: two atomic adds per run, whatever the number of fields in it, and every
    word ends up as the sum (wrapping int64, exact) of its fields. Nothing else may write
    the words with another operation while fields are added. The adds commute and nothing
    reads the words before the kernel ends, so they are relaxed (Triton's default,
    acquire-release, orders every add against all other memory traffic).
    """
    n: tl.constexpr = pos.shape[0]
    tl.static_assert(n % SCAN_ROW == 0, "put_fields takes whole rows of SCAN_ROW elements")
    word = pos >> 6
    shift = pos & 63
    field = value & width_mask(width)
    total = tl.reshape(tl.cumsum(tl.reshape(tl.where(valid, field << shift, 0),
                                            [n // SCAN_ROW, SCAN_ROW]), 1), [n])
    has_next = has_next & (tl.arange(0, n) % SCAN_ROW != SCAN_ROW - 1)
    ends = valid & ~(has_next & ((next_pos >> 6) == word))
    add_pairs(words, word, total, ends)
    add_pairs(words, next_pos >> 6, -total, ends & has_next)
    straddles = valid & (shift + width > 64)
    high = shift_right(field, tl.where(straddles, 64 - shift, 0))
    add_pairs(words, word + 1, high, straddles & (high != 0))


@triton.jit
def add_pairs(words, at, value, mask):
    """Relaxed atomic adds of ``value`` into ``words[at]`` where ``mask``, for 1-D blocks
    held two elements per thread: issued as two adds of one element per thread (even and
    odd elements), the layout Triton gives atomics, so no operand is moved through shared
    memory first (one add of the whole block moves the addresses, values and mask, each
    with barriers)."""
    n: tl.constexpr = at.shape[0]
    at_even, at_odd = tl.split(tl.reshape(at, [n // 2, 2]))
    value_even, value_odd = tl.split(tl.reshape(value, [n // 2, 2]))
    mask_even, mask_odd = tl.split(tl.reshape(mask.to(tl.int8), [n // 2, 2]))
    tl.atomic_add(words + at_even, value_even, mask=mask_even != 0, sem="relaxed")
    tl.atomic_add(words + at_odd, value_odd, mask=mask_odd != 0, sem="relaxed")


@triton.jit
def packs(width):
    """Whether fields of ``width`` bits fill whole words (``put_packed``): 1, 2, 4, ..., 64."""
    return (width > 0) & ((64 % tl.maximum(width, 1)) == 0)


@triton.jit
def put_packed(words, pos, value, width, valid, BLOCK: tl.constexpr):
    """Write the low ``width`` bits of each valid element's ``value`` at bit ``pos`` of the
    zeroed ``words``, where the block's elements are consecutive fields (``pos`` grows by
    ``width`` per element), ``packs(width)``, and the block's first field starts a word.

    Then every word holds the fields of ``64 / width`` consecutive elements of this block
    and of no other: their sum (their OR) is stored once, with no scan and no atomics.
    Words past the valid elements are not written.
    """
    field = tl.where(valid, (value & width_mask(width)) << (pos & 63), 0)
    for g in tl.static_range(7):
        if width == (64 >> g):
            packed = tl.sum(tl.reshape(field, [BLOCK >> g, 1 << g]), 1)
            # -1 for a word without valid fields: one reduction gives the word and its use
            word = tl.max(tl.reshape(tl.where(valid, pos >> 6, -1), [BLOCK >> g, 1 << g]), 1)
            tl.store(words + word, packed, mask=word >= 0)


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
