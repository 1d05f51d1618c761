"""Bit packing and the order-preserving keys of float bit patterns."""

from __future__ import annotations

import pytest
import torch
from dte_codec.bits import (bit_length, from_order_keys, order_keys, pack_bits, pack_fields,
                            unpack_bits, unpack_fields)
from hypothesis import given
from hypothesis import strategies as st

ALL_16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
"""Every 16-bit pattern once, as int16."""


def test_pack_bits_is_lsb_first():
    """Bit i goes to bit i % 8 of byte i // 8; the last byte is zero-padded."""
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    assert [0x81, 0x02] == pack_bits(mask).tolist()
    assert torch.uint8 == pack_bits(mask).dtype


def test_pack_bits_empty():
    """No bits pack into no bytes and unpack back to nothing."""
    packed = pack_bits(torch.zeros(0, dtype=torch.bool))
    assert (torch.uint8, 0) == (packed.dtype, packed.numel())
    assert 0 == unpack_bits(packed, 0).numel()


@given(st.lists(st.booleans(), max_size=100))
def test_pack_bits_round_trip(bits):
    """``unpack_bits(pack_bits(m), len(m)) == m`` for every length, in ceil(n/8) bytes."""
    mask = torch.tensor(bits, dtype=torch.bool)
    packed = pack_bits(mask)
    assert -(-len(bits) // 8) == packed.numel()
    assert bits == unpack_bits(packed, len(bits)).tolist()


def test_pack_fields_layout():
    """Each field is stored least significant bit first, fields back to back."""
    # 1 -> bits 1,0; 2 -> 0,1; 3 -> 1,1: 0b00111001
    assert [0x39] == pack_fields(torch.tensor([1, 2, 3]), 2).tolist()


def test_fields_of_width_zero():
    """Width 0 packs into nothing and unpacks to zeros (Elias-Fano with no low bits)."""
    assert 0 == pack_fields(torch.tensor([0, 0, 0]), 0).numel()
    assert [0, 0, 0] == unpack_fields(torch.empty(0, dtype=torch.uint8), 3, 0).tolist()


@given(st.integers(1, 62).flatmap(
    lambda w: st.tuples(st.just(w), st.lists(st.integers(0, 2**w - 1), max_size=40))))
def test_pack_fields_round_trip(case):
    """``unpack_fields`` inverts ``pack_fields`` for every width 1..62, in ceil(n*w/8) bytes."""
    width, values = case
    packed = pack_fields(torch.tensor(values, dtype=torch.int64), width)
    assert -(-len(values) * width // 8) == packed.numel()
    assert values == unpack_fields(packed, len(values), width).tolist()


def test_bit_length_examples():
    """``bit_length`` counts the bits of each value, 0 for 0, exact up to 2**53 - 1."""
    values = [0, 1, 2, 3, 4, 255, 256, 2**31, 2**52, 2**53 - 1]
    assert [v.bit_length() for v in values] == bit_length(torch.tensor(values)).tolist()


@given(st.lists(st.integers(0, 2**53 - 1), max_size=50))
def test_bit_length_matches_python(values):
    """``bit_length`` agrees with ``int.bit_length`` below 2**53."""
    assert [v.bit_length() for v in values] == bit_length(
        torch.tensor(values, dtype=torch.int64)).tolist()


def test_order_keys_bijection_on_all_16_bit_patterns():
    """On all 65,536 patterns the keys are a permutation of 0..65535 and
    ``from_order_keys`` inverts it (both ways)."""
    keys = order_keys(ALL_16, 16)
    assert list(range(2**16)) == sorted(keys.tolist())
    assert (ALL_16.to(torch.int64) & 0xFFFF).tolist() == from_order_keys(keys, 16).tolist()
    every_key = torch.arange(2**16)
    assert every_key.tolist() == order_keys(from_order_keys(every_key, 16), 16).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_order_keys_monotone_on_all_16_bit_patterns(dtype):
    """Sorted by key, the non-NaN values never decrease, -0 sits just below +0, and the
    NaNs sit beyond -inf and +inf."""
    keys = order_keys(ALL_16, 16)
    values = ALL_16.view(dtype).to(torch.float64)[torch.argsort(keys)]
    nan = torch.isnan(values)
    half = int(nan.sum()) // 2
    finite_or_inf = values[~nan]
    assert bool((finite_or_inf[1:] >= finite_or_inf[:-1]).all())
    assert bool(nan[:half].all()) and bool(nan[-half:].all())
    assert [float("-inf"), float("inf")] == [float(finite_or_inf[0]), float(finite_or_inf[-1])]
    negative_zero = int(order_keys(torch.tensor([-0x8000], dtype=torch.int16), 16))
    positive_zero = int(order_keys(torch.tensor([0], dtype=torch.int16), 16))
    assert (2**15 - 1, 2**15) == (negative_zero, positive_zero)


@given(st.lists(st.integers(-2**31, 2**31 - 1), min_size=2, max_size=50))
def test_order_keys_fp32(patterns):
    """For fp32 patterns the keys invert exactly and order the non-NaN values."""
    bits = torch.tensor(patterns, dtype=torch.int32)
    keys = order_keys(bits, 32)
    assert (bits.to(torch.int64) & 0xFFFFFFFF).tolist() == from_order_keys(keys, 32).tolist()
    assert bool(((keys >= 0) & (keys < 2**32)).all())
    values = bits.view(torch.float32).to(torch.float64)
    ok = ~torch.isnan(values)
    by_key = values[ok][torch.argsort(keys[ok])]
    assert bool((by_key[1:] >= by_key[:-1]).all())


def test_order_keys_of_specials():
    """Known keys: -0 and +0 adjacent, +-inf next to the NaN ranges, fp32 width."""
    specials = torch.tensor([float("-inf"), -0.0, 0.0, 1.0, float("inf")])
    keys = order_keys(specials.view(torch.int32), 32).tolist()
    assert [0x007FFFFF, 0x7FFFFFFF, 0x80000000, 0xBF800000, 0xFF800000] == keys
