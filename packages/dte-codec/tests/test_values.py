"""Value encodings: raw bit patterns, and residues resolved against the receiver's base."""

from __future__ import annotations

import pytest
import torch
from dte_codec.bits import from_order_keys, order_keys
from dte_codec.encodings import IndexEncoding, ValueEncoding
from dte_codec.entry import Entry
from dte_codec.errors import EntryError
from dte_codec.values import check_escapes, decode_values, encode_values, int_view
from dte_detector.changes import unknown_bounds
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import PAYLOAD_DTYPES

BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


def _from_keys(keys, dtype: torch.dtype) -> torch.Tensor:
    """Values of ``dtype`` whose order keys are ``keys``."""
    bits = BITS[dtype]
    patterns = from_order_keys(torch.as_tensor(keys, dtype=torch.int64), bits)
    signed = torch.where(patterns >= 2 ** (bits - 1), patterns - 2**bits, patterns)
    return signed.to(int_view(torch.empty(0, dtype=dtype)).dtype).view(dtype)


def _keys(values: torch.Tensor) -> torch.Tensor:
    return order_keys(int_view(values), BITS[values.dtype])


def _entry(encoded, dtype: torch.dtype, count: int) -> Entry:
    return Entry(name="t", dtype=dtype, shape=(count,), count=count,
                 index_encoding=IndexEncoding.INT32, value_encoding=encoded.encoding,
                 value_width=encoded.width, value_escapes=encoded.escapes)


def _round_trip(new, low, high, base) -> tuple[object, torch.Tensor]:
    encoded = encode_values(new, low, high)
    entry = _entry(encoded, new.dtype, new.numel())
    assert entry.value_sections() == tuple(s.numel() for s in encoded.sections)
    check_escapes(entry, encoded.sections)
    return encoded, decode_values(entry, encoded.sections, base)


def _same_bits(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    return expected.dtype == actual.dtype and torch.equal(int_view(expected), int_view(actual))


def test_int_view_by_width():
    """``int_view`` reinterprets 2, 4 and 8-byte values as int16, int32, int64."""
    assert [torch.int16, torch.int16, torch.int32, torch.int64] == [
        int_view(torch.zeros(1, dtype=d)).dtype
        for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)]


def test_raw_for_dtypes_without_residues():
    """Integer, bool and fp64 values always travel raw."""
    new = torch.tensor([1, -5, 7], dtype=torch.int32)
    encoded, decoded = _round_trip(new, new, new, torch.zeros(3, dtype=torch.int32))
    assert (ValueEncoding.RAW, 0, 0) == (encoded.encoding, encoded.width, encoded.escapes)
    assert new.tolist() == decoded.tolist()


def test_raw_when_empty():
    """No values encode raw into no bytes."""
    empty = torch.empty(0, dtype=torch.bfloat16)
    encoded = encode_values(empty, empty, empty)
    assert (ValueEncoding.RAW, 0) == (encoded.encoding, encoded.size)


@pytest.mark.parametrize("dtype", PAYLOAD_DTYPES, ids=str)
def test_residue_of_one_ulp_with_exact_bounds(dtype):
    """+-1 ulp against an exactly known base takes 2 bits per value; one direction 1 bit."""
    base = torch.tensor([1.0, -3.5, 0.0, -0.0, 1e-3, float("inf")]).to(dtype)
    steps = torch.tensor([1, -1, 1, -1, 1, -1])
    new = _from_keys(_keys(base) + steps, dtype)
    encoded, decoded = _round_trip(new, base, base, base)
    assert (ValueEncoding.RESIDUE, 2, 0) == (encoded.encoding, encoded.width, encoded.escapes)
    assert _same_bits(new, decoded)
    down = _from_keys(_keys(base) - 1, dtype)
    assert 1 == encode_values(down, base, base).width


@pytest.mark.parametrize("dtype", PAYLOAD_DTYPES, ids=str)
def test_residue_with_escapes(dtype):
    """Values whose difference does not fit the chosen width travel raw, at their
    positions, and decode exactly."""
    base = torch.linspace(-2, 2, 40).to(dtype)
    steps = torch.ones(40, dtype=torch.int64)
    steps[[3, 17]] = torch.tensor([5000, -4000])
    new = _from_keys(_keys(base) + steps, dtype)
    encoded, decoded = _round_trip(new, base, base, base)
    assert (ValueEncoding.RESIDUE, 2) == (encoded.encoding, encoded.escapes)
    assert [3, 17] == encoded.sections[1].view(torch.int32).tolist()
    assert _same_bits(new[[3, 17]], encoded.sections[2].view(dtype))
    assert _same_bits(new, decoded)


def test_unknown_bounds_go_raw():
    """With bounds that admit any base no residue is provably decodable: raw."""
    new = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    low, high = unknown_bounds(torch.bfloat16, 3, torch.device("cpu"))
    encoded, decoded = _round_trip(new, low, high, torch.zeros(3, dtype=torch.bfloat16))
    assert ValueEncoding.RAW == encoded.encoding
    assert _same_bits(new, decoded)


@st.composite
def residue_cases(draw):
    """A payload dtype, base patterns of every kind, new values mostly a few keys away,
    bounds (exact or an interval around the base) and a receiver base inside them."""
    dtype = draw(st.sampled_from(PAYLOAD_DTYPES))
    bits = BITS[dtype]
    count = draw(st.integers(1, 60))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    top = 2**bits - 1
    base_keys = torch.randint(0, 2**bits, (count,), generator=gen)
    specials = _keys(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                                   1e-40, -1e-45]).to(dtype))
    pick = torch.rand(count, generator=gen) < 0.3
    base_keys[pick] = specials[torch.randint(0, len(specials), (int(pick.sum()),),
                                             generator=gen)]
    spread = draw(st.sampled_from([1, 3, 40, 2**bits]))
    steps = torch.randint(-spread, spread + 1, (count,), generator=gen)
    new_keys = (base_keys + steps).clamp(0, top)
    slack = draw(st.sampled_from([0, 0, 1, 5, 300]))
    below = torch.randint(0, slack + 1, (count,), generator=gen)
    above = torch.randint(0, slack + 1, (count,), generator=gen)
    low_keys, high_keys = (base_keys - below).clamp(0, top), (base_keys + above).clamp(0, top)
    where = torch.rand(count, generator=gen)
    receiver_keys = low_keys + (where * (high_keys - low_keys + 1)).long().minimum(
        high_keys - low_keys)
    return tuple(_from_keys(k, dtype) for k in (new_keys, low_keys, high_keys, receiver_keys))


@given(residue_cases())
@example((torch.tensor([-0.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0])))
def test_any_base_inside_the_bounds_decodes_exactly(case):
    """Whatever base in ``[low, high]`` the receiver holds, it recovers the new bits, and
    the encoding is never larger than raw."""
    new, low, high, receiver = case
    encoded, decoded = _round_trip(new, low, high, receiver)
    assert _same_bits(new, decoded)
    assert encoded.size <= new.numel() * new.element_size()


@pytest.mark.parametrize(("base_key", "new_key", "receiver_key", "width"), [
    (2, 1, 0, 1),  # residue 1 means d = -1 from key 0: key -1
    (2**16 - 5, 2**16 - 4, 2**16 - 1, 2),  # residue 0 means d = +1 from the top key
], ids=["below-0", "above-top"])
def test_residue_that_does_not_fit_the_base(base_key, new_key, receiver_key, width):
    """A residue resolved against a base it was not made for, leaving the dtype's range,
    raises ``EntryError``."""
    base = _from_keys([base_key], torch.bfloat16)
    new = _from_keys([new_key], torch.bfloat16)
    encoded = encode_values(new, base, base)
    assert (ValueEncoding.RESIDUE, width) == (encoded.encoding, encoded.width)
    with pytest.raises(EntryError) as info:
        decode_values(_entry(encoded, torch.bfloat16, 1), encoded.sections,
                      _from_keys([receiver_key], torch.bfloat16))
    assert ("tensor 't': values: expected residues that decode inside the dtype's range, "
            "got a residue that does not fit this receiver's base") == str(info.value)


def _residue_entry(count: int, escapes: int) -> Entry:
    return Entry(name="t", dtype=torch.bfloat16, shape=(10,), count=count,
                 index_encoding=IndexEncoding.INT32, value_encoding=ValueEncoding.RESIDUE,
                 value_width=2, value_escapes=escapes)


@pytest.mark.parametrize(("positions", "message"), [
    ([0, 5], "value escape positions: expected inside [0, 3), got [0, 5]"),
    ([2, 1], "value escape positions: expected strictly increasing, got 1 after 2 at 1"),
    ([1, 1], "value escape positions: expected strictly increasing, got 1 after 1 at 1"),
    ([-1, 2], "value escape positions: expected inside [0, 3), got [-1, 2]"),
])
def test_check_escapes_rejects(positions, message):
    """Escape positions must strictly increase inside ``[0, count)``."""
    sections = (torch.zeros(1, dtype=torch.uint8),
                torch.tensor(positions, dtype=torch.int32).view(torch.uint8),
                torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(EntryError) as info:
        check_escapes(_residue_entry(3, 2), sections)
    assert f"tensor 't': {message}" == str(info.value)


def test_check_escapes_ignores_raw():
    """Raw values have no escape list to check."""
    entry = Entry(name="t", dtype=torch.bfloat16, shape=(4,), count=2,
                  index_encoding=IndexEncoding.INT32)
    check_escapes(entry, (torch.zeros(4, dtype=torch.uint8),))
