"""ChangeSet and its helpers: the one result type every detector returns."""

from __future__ import annotations

import attrs
import pytest
import torch
from detector_cases import bits_of, width
from dte_codec.bits import order_keys
from hypothesis import given
from hypothesis import strategies as st

from dte_detector import ChangeRun, ChangeSet, FlatChanges
from dte_detector.changes import int_bits, unknown_bounds

_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_exact_uses_one_base_for_both_bounds():
    """An exact change set's low and high bounds are the same values."""
    base = torch.tensor([1.0, -0.0], dtype=torch.bfloat16)
    changes = ChangeSet.exact(torch.tensor([2, 7], dtype=torch.int32), base)
    assert [2, 7] == changes.indices.tolist()
    assert changes.base_low is base
    assert changes.base_high is base
    assert 2 == len(changes)


@pytest.mark.parametrize("dtype", _DTYPES)
def test_empty_matches_the_tensor(dtype):
    """empty() has no indices, int32 indices and bounds in the tensor's dtype."""
    changes = ChangeSet.empty(torch.zeros(3, 4, dtype=dtype))
    assert 0 == len(changes)
    assert torch.int32 == changes.indices.dtype
    assert (dtype, dtype) == (changes.base_low.dtype, changes.base_high.dtype)
    assert (0, 0) == (changes.base_low.numel(), changes.base_high.numel())


def test_change_sets_are_frozen():
    """A ChangeSet cannot be modified after construction."""
    changes = ChangeSet.empty(torch.zeros(1))
    with pytest.raises(AttributeError):
        changes.indices = torch.zeros(0)


@pytest.mark.parametrize(("dtype", "low", "high"), [
    (torch.bfloat16, [-1, -1], [0x7FFF, 0x7FFF]),
    (torch.float16, [-1, -1], [0x7FFF, 0x7FFF]),
    (torch.float32, [-1, -1], [0x7FFFFFFF, 0x7FFFFFFF]),
])
def test_unknown_bounds_are_the_extreme_nan_patterns(dtype, low, high):
    """The lowest bound is the all-ones pattern (negative NaN, largest payload), the
    highest the positive NaN with the largest payload: first and last in total order."""
    lower, upper = unknown_bounds(dtype, 2, torch.device("cpu"))
    assert (dtype, dtype) == (lower.dtype, upper.dtype)
    assert low == bits_of(lower)
    assert high == bits_of(upper)
    assert [0, 0] == order_keys(int_bits(lower), width(dtype)).tolist()
    top = 2 ** width(dtype) - 1
    assert [top, top] == order_keys(int_bits(upper), width(dtype)).tolist()


def test_unknown_bounds_of_no_elements():
    """A count of zero gives empty bounds."""
    lower, upper = unknown_bounds(torch.bfloat16, 0, torch.device("cpu"))
    assert (0, 0) == (lower.numel(), upper.numel())


@given(dtype=st.sampled_from(_DTYPES), seed=st.integers(0, 2**31 - 1))
def test_unknown_bounds_admit_every_pattern(dtype, seed):
    """Every bit pattern of the dtype lies between the unknown bounds in total order."""
    gen = torch.Generator().manual_seed(seed)
    ints = {16: torch.int16, 32: torch.int32}[width(dtype)]
    info = torch.iinfo(ints)
    patterns = torch.randint(info.min, info.max, (200,), generator=gen, dtype=torch.int64)
    patterns = torch.cat([patterns, torch.tensor([info.min, info.max, -1, 0])]).to(ints)
    lower, upper = unknown_bounds(dtype, 1, torch.device("cpu"))
    keys = order_keys(patterns, width(dtype))
    assert bool((order_keys(int_bits(lower), width(dtype)) <= keys).all())
    assert bool((keys <= order_keys(int_bits(upper), width(dtype))).all())


@pytest.mark.parametrize(("dtype", "ints"), [
    (torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32),
    (torch.float64, torch.int64),
])
def test_int_bits_views_the_same_bytes(dtype, ints):
    """int_bits reinterprets the bytes as the signed integer of equal width, no copy."""
    values = torch.tensor([1.0, -0.0], dtype=dtype)
    view = int_bits(values)
    assert ints == view.dtype
    assert values.data_ptr() == view.data_ptr()
    assert -(1 << (8 * values.element_size() - 1)) == view[1].item()


def test_flat_changes_read_as_per_tensor_change_sets():
    """A ``FlatChanges`` maps each name, in the given order, to its views of its run
    (members with no change included) or to its loose change set."""
    run = ChangeRun(("b", "c", "d"), (2, 0, 1), torch.tensor([1, 4, 0], dtype=torch.int32),
                    torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
                    torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16))
    loose = ChangeSet.empty(torch.zeros(3, dtype=torch.bfloat16))
    flat = FlatChanges(("a", "b", "c", "d"), [run], {"a": loose})
    assert ["a", "b", "c", "d"] == list(flat)
    assert 4 == len(flat) and "c" in flat and "e" not in flat
    assert flat["a"] is loose
    assert [1, 4] == flat["b"].indices.tolist()
    assert [2.5] == flat["b"].base_high[1:].tolist()
    assert 0 == len(flat["c"])
    assert flat["b"] is flat["b"]  # built once
    assert ([0], [3.0], [3.5]) == tuple(t.tolist() for t in attrs.astuple(flat["d"],
                                                                          recurse=False))
    with pytest.raises(KeyError):
        flat["e"]
