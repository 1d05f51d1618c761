"""The bit-field primitives of the kernels (``kernel_bits``: ``put_fields``,
``put_packed``, ``load_uniform``, ``store_uniform``), each in a small Triton kernel of
this module, against the torch writer (``fields.Body``) and torch's casts, word for word.

On a CUDA device the kernels run there; on the CPU under Triton's interpreter
(``kernel_mode``, imported before the kernels).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_mode import CUDA, DEVICE, kernels, needs_triton

from dte_codec.fields import WORD_BITS, Body

pytestmark = needs_triton


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from dte_codec.kernel_bits import load_uniform, put_fields, put_packed, store_uniform

    @triton.jit
    def _loads(address, out, size, n, BLOCK: tl.constexpr):
        k = tl.arange(0, BLOCK)
        width = tl.load(size)
        tl.store(out + k, load_uniform(address, k, width, k < n))

    @triton.jit
    def _stores(first, second, values, size, n, BLOCK: tl.constexpr):
        k = tl.arange(0, BLOCK)
        width = tl.load(size)
        value = tl.load(values + k)
        store_uniform(first, k, value, width, k < n)  # one address
        store_uniform(second + k * 0, k, value, width, k < n)  # an address per element

    @triton.jit
    def _put(words, pos, value, width, n, BLOCK: tl.constexpr):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = k < n
        has_next = (tl.arange(0, BLOCK) < BLOCK - 1) & (k + 1 < n)
        put_fields(words, tl.load(pos + k, mask=valid, other=0),
                   tl.load(value + k, mask=valid, other=0),
                   tl.load(width + k, mask=valid, other=0), valid,
                   tl.load(pos + k + 1, mask=has_next, other=0), has_next)

    @triton.jit
    def _packed(words, pos, value, width, n, BLOCK: tl.constexpr):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = k < n
        put_packed(words, tl.load(pos + k, mask=valid, other=0) +
                   tl.where(valid, 0, (k - n + 1) * tl.load(width)),
                   tl.load(value + k, mask=valid, other=0), tl.load(width), valid, BLOCK)

PUT_BLOCKS = (64, 128)
"""Blocks of one prefix-sum row (``kernel_bits.SCAN_ROW``) and of two."""
PACKED_BLOCK = 64
"""64 fields of any width that divides 64 fill whole words: each block starts a word."""
WIDTHS = (0, 1, 5, 8, 16, 33, 63, 64)


def _stream(width: int, written: list[bool], values: list[int], start: int):
    """Positions, values and widths of one stream starting at bit ``start``: an element
    that writes nothing has width 0 at the position of the stream's next field."""
    widths = torch.tensor([width if w else 0 for w in written], dtype=torch.int64)
    pos = start + torch.cumsum(widths, 0) - widths
    return pos, torch.tensor(values, dtype=torch.int64), widths


def _end(pos: torch.Tensor, widths: torch.Tensor, start: int) -> int:
    """The word-aligned bit where the next section starts."""
    end = int((pos + widths).max()) if pos.numel() else start
    return -(-end // WORD_BITS) * WORD_BITS


def _laid_out(sections, lead: int) -> tuple[list, torch.Tensor]:
    """The streams of ``sections``, each starting the word after the last one's end (the
    first ``lead`` words in), and the words the torch writer makes of them (one spare)."""
    start, parts = lead * WORD_BITS, []
    for width, written, values in sections:
        parts.append(_stream(width, written, values, start))
        start = _end(parts[-1][0], parts[-1][2], start)
    expected = Body(start // 8 + 8, sum(p[0].numel() for p in parts), torch.device("cpu"))
    expected.write(*(torch.cat(column) for column in zip(*parts)))
    return parts, expected.bytes().view(torch.int64)


streams = st.integers(0, 70).flatmap(lambda n: st.tuples(
    st.sampled_from(WIDTHS), st.lists(st.booleans(), min_size=n, max_size=n),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n)))


@settings(max_examples=60 if CUDA else 12, deadline=None)
@given(st.lists(streams, min_size=1, max_size=3), st.integers(0, 3))
@example([(63, [True] * 40, [-1] * 40), (1, [True] * 70, [1] * 70)], 1)
@example([(64, [True, False] * 20, [-1, 5] * 20), (0, [True] * 3, [7] * 3)], 0)
@example([(5, [False] * 17 + [True] * 30, [-1] * 47), (33, [True, False, False] * 20,
                                                          list(range(60)))], 2)
@example([(16, [], []), (8, [False] * 16, [255] * 16)], 0)
def test_put_fields_writes_the_words_of_the_torch_writer(sections, lead):
    """Every word equals the torch writer's (which adds field by field), whatever the
    widths, escapes and block edges; fields of a section never reach the next one."""
    parts, expected = _laid_out(sections, lead)
    for block in PUT_BLOCKS:
        words = torch.zeros_like(expected, device=DEVICE)
        for pos, value, width in parts:
            if pos.numel():
                _put[(triton.cdiv(pos.numel(), block),)](
                    words, pos.to(DEVICE), value.to(DEVICE), width.to(DEVICE), pos.numel(),
                    BLOCK=block)
        assert expected.tolist() == words.cpu().tolist()


@settings(max_examples=40 if CUDA else 10, deadline=None)
@given(st.lists(st.integers(0, 6).flatmap(lambda g: st.integers(0, 200).flatmap(
    lambda n: st.tuples(st.just(64 >> g), st.just([True] * n),
                        st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n)))),
    min_size=1, max_size=3), st.integers(0, 3))
@example([(1, [True] * 130, [-1] * 130), (64, [True] * 3, [-5] * 3)], 1)
@example([(2, [True] * 65, list(range(65))), (32, [True] * 1, [2**40])], 0)
def test_put_packed_writes_the_words_of_the_torch_writer(sections, lead):
    """Streams of consecutive fields of 1 to 64 bits, in blocks that each start a word:
    every word equals the torch writer's, none past a stream's last field is
    written (the next section starts right after it)."""
    parts, expected = _laid_out(sections, lead)
    words = torch.zeros_like(expected, device=DEVICE)
    for (width, _, _), (pos, value, _) in zip(sections, parts):
        if pos.numel():
            _packed[(triton.cdiv(pos.numel(), PACKED_BLOCK),)](
                words, pos.to(DEVICE), value.to(DEVICE),
                torch.tensor([width], device=DEVICE), pos.numel(), BLOCK=PACKED_BLOCK)
    assert expected.tolist() == words.cpu().tolist()



@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_load_uniform_reads_items_as_int64(dtype):
    """Items of 1, 2, 4 and 8 bytes, negative ones included, and masked-off lanes: int64
    values, 1-byte items zero-extended, the others sign-extended, masked lanes 0."""
    info = torch.iinfo(dtype)
    values = torch.tensor([info.min, -1 if info.min else 200, 0, 1, info.max], dtype=dtype)
    out = torch.full((8,), 7, dtype=torch.int64, device=DEVICE)
    values = values.to(DEVICE)
    with kernels():
        _loads[(1,)](values.data_ptr(), out, torch.tensor([values.element_size()],
                     device=DEVICE), values.numel(), BLOCK=8)
    expected = values.to(torch.int64).tolist() + [0] * 3
    assert expected == out.cpu().tolist()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_store_uniform_writes_the_low_bytes(dtype):
    """Items of 1, 2, 4 and 8 bytes from int64 values beyond their range: their low bytes
    stored, through one address or one address per element, masked-off lanes left
    alone."""
    values = torch.tensor([-(1 << 40) - 3, -1, 0, 1, (1 << 40) + 255, 9, 9, 9])
    first = torch.full((8,), 5, dtype=dtype, device=DEVICE)
    second = first.clone()
    with kernels():
        _stores[(1,)](first.data_ptr(), second.data_ptr(), values.to(DEVICE),
                      torch.tensor([first.element_size()], device=DEVICE), 5, BLOCK=8)
    low = values[:5].numpy().astype(torch.empty(0, dtype=dtype).numpy().dtype).tolist()
    assert low + [5, 5, 5] == first.cpu().tolist() == second.cpu().tolist()
