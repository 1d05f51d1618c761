"""Index encodings: exact round trips, the smallest one chosen, strict validation."""

from __future__ import annotations

import pytest
import torch
from dte_codec.encodings import IndexEncoding
from dte_codec.entry import Entry
from dte_codec.errors import EncodeError, EntryError
from dte_codec.indices import (_bitmap, _elias_fano, _gap8, _raw, check_sorted_positions,
                               decode_indices, encode_indices)
from hypothesis import example, given
from hypothesis import strategies as st

ENCODERS = {IndexEncoding.INT32: _raw, IndexEncoding.BITMAP: _bitmap,
            IndexEncoding.GAP8: _gap8, IndexEncoding.ELIAS_FANO: _elias_fano}


def _entry(encoded, numel: int, count: int) -> Entry:
    return Entry(name="t", dtype=torch.bfloat16, shape=(numel,), count=count,
                 index_encoding=encoded.encoding, index_width=encoded.width,
                 index_escapes=encoded.escapes)


def _decode(encoded, numel: int, count: int) -> torch.Tensor:
    return decode_indices(_entry(encoded, numel, count), encoded.sections)


def _u8(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).view(torch.uint8)


@st.composite
def index_sets(draw, max_numel: int = 3000):
    """A tensor size and a sorted, non-empty set of indices into it, dense or sparse,
    clustered or spread, with gaps below and above 255."""
    numel = draw(st.integers(1, max_numel))
    style = draw(st.sampled_from(["uniform", "dense", "runs", "spread"]))
    if style == "spread":
        step = draw(st.integers(1, 600))
        picked = set(range(draw(st.integers(0, step - 1)), numel, step))
    else:
        rate = {"uniform": 0.03, "dense": 0.6, "runs": 0.2}[style]
        seed = draw(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        mask = torch.rand(numel, generator=gen) < rate
        if style == "runs":
            mask = mask.repeat_interleave(4)[:numel]
        picked = set(torch.nonzero(mask).view(-1).tolist())
    picked |= set(draw(st.lists(st.integers(0, numel - 1), min_size=1, max_size=5)))
    return numel, torch.tensor(sorted(picked), dtype=torch.int64)


@pytest.mark.parametrize("encoding", list(ENCODERS), ids=lambda e: e.name)
@given(case=index_sets())
@example(case=(1, torch.tensor([0])))
@example(case=(300, torch.tensor([0, 299])))
@example(case=(8, torch.arange(8)))
def test_each_encoding_round_trips(encoding, case):
    """Every encoding decodes back to the exact indices, and its section sizes are the
    ones the header derives from its fields."""
    numel, indices = case
    encoded = ENCODERS[encoding](indices, numel)
    entry = _entry(encoded, numel, indices.numel())
    assert entry.index_sections() == tuple(s.numel() for s in encoded.sections)
    assert indices.tolist() == decode_indices(entry, encoded.sections).tolist()


def test_int64_for_huge_tensors():
    """Raw indices into >= 2**31 elements are INT64 (8 bytes each) and round-trip."""
    indices = torch.tensor([5, 2**31 - 1, 2**31 + 7])
    encoded = _raw(indices, 2**31 + 8)
    assert (IndexEncoding.INT64, 24) == (encoded.encoding, encoded.size)
    assert indices.tolist() == _decode(encoded, 2**31 + 8, 3).tolist()


def test_gap8_escapes_for_huge_tensors_are_int64():
    """GAP8 escapes are int64 for tensors of >= 2**31 elements."""
    indices = torch.tensor([3, 2**31 + 7])
    encoded = _gap8(indices, 2**31 + 8)
    assert (1, 2 + 8) == (encoded.escapes, encoded.size)
    assert indices.tolist() == _decode(encoded, 2**31 + 8, 2).tolist()


@given(index_sets())
def test_encode_picks_the_smallest(case):
    """``encode_indices`` returns a smallest candidate (bitmap only when it can pay)."""
    numel, indices = case
    chosen = encode_indices(indices, numel)
    sizes = [enc(indices, numel).size for enc in ENCODERS.values()]
    assert min(sizes) == chosen.size
    assert indices.tolist() == _decode(chosen, numel, indices.numel()).tolist()


@pytest.mark.parametrize(("numel", "indices", "expected"), [
    (2**17, [100_000], IndexEncoding.INT32),  # 4 bytes; Elias-Fano ties, GAP8 needs 5
    (1000, list(range(0, 1000, 2)), IndexEncoding.BITMAP),
    (6000, list(range(100, 6000, 190)), IndexEncoding.GAP8),
    (3000, list(range(7, 3000, 37)), IndexEncoding.ELIAS_FANO),
], ids=["one-in-2**17", "half", "evenly-spaced", "sparse"])
def test_encode_choices(numel, indices, expected):
    """Typical densities get the expected encoding."""
    assert expected == encode_indices(torch.tensor(indices), numel).encoding


def _entry_of(encoding: IndexEncoding, numel: int, count: int, **fields) -> Entry:
    return Entry(name="t", dtype=torch.float32, shape=(numel,), count=count,
                 index_encoding=encoding, **fields)


@pytest.mark.parametrize(("entry", "sections", "message"), [
    (_entry_of(IndexEncoding.INT32, 10, 2), (_u8([3, 3]),),
     "indices: expected strictly increasing, got 3 after 3 at 1"),
    (_entry_of(IndexEncoding.INT32, 10, 3), (_u8([1, 5, 4]),),
     "indices: expected strictly increasing, got 4 after 5 at 2"),
    (_entry_of(IndexEncoding.INT32, 10, 2), (_u8([2, 10]),),
     "indices: expected inside [0, 10), got [2, 10]"),
    (_entry_of(IndexEncoding.INT32, 10, 2), (_u8([-1, 4]),),
     "indices: expected inside [0, 10), got [-1, 4]"),
    (_entry_of(IndexEncoding.INT64, 10, 4),
     (_u8([0, 2**63 - 1, -2**63 + 10, 5], torch.int64),),
     "indices: expected inside [0, 10), got [-9223372036854775798, 9223372036854775807]"),
    (_entry_of(IndexEncoding.BITMAP, 10, 1), (torch.tensor([1, 4], dtype=torch.uint8),),
     "bitmap padding: expected zero bits past numel, got set bits"),
    (_entry_of(IndexEncoding.BITMAP, 10, 2), (torch.tensor([1, 0], dtype=torch.uint8),),
     "bitmap: expected 2 set bits, got 1"),
    (_entry_of(IndexEncoding.GAP8, 1000, 2, index_escapes=1),
     (torch.tensor([3, 4], dtype=torch.uint8), _u8([300])),
     "index_escapes: expected 1 escape bytes, got 0"),
    (_entry_of(IndexEncoding.GAP8, 1000, 2, index_escapes=1),
     (torch.tensor([3, 0], dtype=torch.uint8), _u8([200])),
     "escaped gaps: expected in (255, 1000], got [200, 200]"),
    (_entry_of(IndexEncoding.GAP8, 1000, 2, index_escapes=1),
     (torch.tensor([3, 0], dtype=torch.uint8), _u8([1001])),
     "escaped gaps: expected in (255, 1000], got [1001, 1001]"),
    (_entry_of(IndexEncoding.GAP8, 1000, 3, index_escapes=2),
     (torch.tensor([0, 0, 1], dtype=torch.uint8), _u8([600, 500])),
     "indices: expected inside [0, 1000), got [599, 1100]"),
    (_entry_of(IndexEncoding.ELIAS_FANO, 16, 2, index_width=2),
     (torch.tensor([0], dtype=torch.uint8), torch.tensor([0b111], dtype=torch.uint8)),
     "elias-fano upper bits: expected 2 set bits, zero padding, got 3 set bits"),
    (_entry_of(IndexEncoding.ELIAS_FANO, 16, 2, index_width=2),
     (torch.tensor([0], dtype=torch.uint8), torch.tensor([0b1000_0001], dtype=torch.uint8)),
     "elias-fano upper bits: expected 2 set bits, zero padding, got 2 set bits"),
    (_entry_of(IndexEncoding.ELIAS_FANO, 16, 2, index_width=2),
     (torch.tensor([0b0111], dtype=torch.uint8), torch.tensor([0b011], dtype=torch.uint8)),
     "indices: expected strictly increasing, got 1 after 3 at 1"),
], ids=["repeat", "decrease", "past-end", "negative", "int64-wrap", "bitmap-padding",
        "bitmap-count", "gap8-escape-count", "gap8-small-escape", "gap8-big-escape",
        "gap8-sum-past-end", "ef-count", "ef-padding", "ef-order"])
def test_decode_rejects(entry, sections, message):
    """Invalid index sections raise ``EntryError`` naming the tensor and the field."""
    with pytest.raises(EntryError) as info:
        decode_indices(entry, sections)
    assert f"tensor 't': {message}" == str(info.value)


def test_check_sorted_positions_error_type():
    """The caller chooses the error type (``EncodeError`` on the sending side)."""
    with pytest.raises(EncodeError) as info:
        check_sorted_positions(torch.tensor([4, 2]), 8, field="indices", tensor="w",
                               error=EncodeError)
    assert "tensor 'w': indices: expected strictly increasing, got 2 after 4 at 1" == str(
        info.value)
    check_sorted_positions(torch.empty(0, dtype=torch.int64), 0, field="f", tensor="w")
