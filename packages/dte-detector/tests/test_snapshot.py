"""diff and Snapshot: the bitwise reference every other detector is checked against."""

from __future__ import annotations

import pytest
import torch
from detector_cases import bits_of
from hypothesis import given
from hypothesis import strategies as st

from dte_detector import DetectorError, Snapshot, diff
from dte_detector.changes import INDEX32_LIMIT, index_dtype
from dte_detector.errors import NoReferenceError

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _from_bits(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(patterns, dtype=_BITS[dtype]).view(dtype)


@pytest.mark.parametrize("dtype", list(_BITS))
def test_diff_counts_the_sign_of_zero(dtype):
    """-0.0 and +0.0 compare equal as values but are different bits: a change."""
    old = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=dtype)
    new = torch.tensor([-0.0, 0.0, 0.0, -0.0], dtype=dtype)
    changes = diff(old, new)
    assert [0, 1] == changes.indices.tolist()
    assert bits_of(old[:2]) == bits_of(changes.base_low)


@pytest.mark.parametrize(("dtype", "quiet", "payload"), [
    (torch.bfloat16, 0x7FC0, 0x7FC1),
    (torch.float16, 0x7E00, 0x7E01),
    (torch.float32, 0x7FC00000, 0x7FC00001),
])
def test_diff_counts_nan_payloads(dtype, quiet, payload):
    """A NaN whose payload or sign changes is a change; the same NaN bits are not."""
    sign = -(1 << (8 * torch.empty((), dtype=dtype).element_size() - 1))
    old = _from_bits([quiet, quiet, quiet, quiet], dtype)
    new = _from_bits([quiet, payload, sign | quiet, quiet], dtype)
    changes = diff(old, new)
    assert [1, 2] == changes.indices.tolist()
    assert [quiet, quiet] == bits_of(changes.base_low)


def test_diff_reports_old_values_as_exact_bases():
    """Bases are the old values at the changed indices; low and high bounds coincide."""
    old = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    new = torch.tensor([[1.0, 2.5], [3.0, -4.0]], dtype=torch.bfloat16)
    changes = diff(old, new)
    assert [1, 3] == changes.indices.tolist()
    assert [2.0, 4.0] == changes.base_low.tolist()
    assert changes.base_low is changes.base_high
    assert torch.bfloat16 == changes.base_low.dtype
    assert 2 == len(changes)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)])
def test_diff_handles_scalars_and_empty_tensors(shape):
    """0-d tensors and tensors with a zero-sized dimension give well-typed results."""
    old = torch.zeros(shape, dtype=torch.bfloat16)
    changes = diff(old, old.clone())
    assert [] == changes.indices.tolist()
    assert torch.int32 == changes.indices.dtype
    assert torch.bfloat16 == changes.base_low.dtype


def test_diff_of_a_changed_scalar():
    """A 0-d tensor that changed is reported at flat index 0."""
    changes = diff(torch.tensor(1.0, dtype=torch.float16), torch.tensor(2.0, dtype=torch.float16))
    assert [0] == changes.indices.tolist()
    assert [1.0] == changes.base_low.tolist()


def test_index_dtype_is_int32_below_two_to_the_31_elements():
    """Indices are int32 when the tensor has fewer than 2**31 elements, else int64."""
    assert 2**31 == INDEX32_LIMIT
    assert torch.int32 == index_dtype(0)
    assert torch.int32 == index_dtype(2**31 - 1)
    assert torch.int64 == index_dtype(2**31)
    assert torch.int64 == index_dtype(2**40)


def test_diff_uses_the_index_dtype_rule():
    """diff's indices have the dtype the rule gives for the tensor's element count."""
    old = torch.zeros(5, dtype=torch.bfloat16)
    assert index_dtype(old.numel()) == diff(old, old + 1).indices.dtype


@pytest.mark.parametrize(("old", "new", "message"), [
    (torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2),
     "diff needs equal dtype and shape, got torch.bfloat16(2,) and torch.float32(2,)"),
    (torch.zeros(2, 3), torch.zeros(3, 2),
     "diff needs equal dtype and shape, got torch.float32(2, 3) and torch.float32(3, 2)"),
])
def test_diff_rejects_mismatched_tensors(old, new, message):
    """Different dtypes or shapes are a caller error, not an empty or full change set."""
    with pytest.raises(ValueError) as info:
        diff(old, new)
    assert message == str(info.value)


@given(seed=st.integers(0, 2**31 - 1), count=st.integers(0, 300),
       dtype=st.sampled_from(list(_BITS)))
def test_diff_is_the_bitwise_inequality_of_random_patterns(seed, count, dtype):
    """Over arbitrary bit patterns (NaNs, infinities, zeros, subnormals) diff is exactly
    the set of positions whose integer views differ."""
    gen = torch.Generator().manual_seed(seed)
    ints = _BITS[dtype]
    info = torch.iinfo(ints)
    old_bits = torch.randint(info.min, info.max, (count,), generator=gen, dtype=torch.int64)
    flip = torch.randint(0, 2, (count,), generator=gen, dtype=torch.int64) << torch.randint(
        0, 8 * torch.empty((), dtype=dtype).element_size() - 1, (count,), generator=gen)
    new_bits = torch.where(torch.rand(count, generator=gen) < 0.5, old_bits ^ flip, old_bits)
    old = old_bits.to(ints).view(dtype)
    new = new_bits.to(ints).view(dtype)
    changes = diff(old, new)
    assert torch.nonzero(old_bits.to(ints) != new_bits.to(ints)).view(-1).tolist() == (
        changes.indices.tolist())
    assert bits_of(old[changes.indices.long()]) == bits_of(changes.base_low)


def test_snapshot_diffs_against_the_retained_copy():
    """changes() compares with the copy taken at retain(), not with the live tensor."""
    snapshot = Snapshot()
    weights = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    snapshot.retain("w", weights)
    weights[1] = -0.0
    weights[2] = 3.0
    changes = snapshot.changes("w", weights)
    assert [1] == changes.indices.tolist()
    assert [2.0] == changes.base_low.tolist()


def test_snapshot_retain_moves_the_reference():
    """After retain() of the current values nothing has changed."""
    snapshot = Snapshot()
    weights = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    snapshot.retain("w", weights)
    weights += 1
    snapshot.retain("w", weights)
    assert [] == snapshot.changes("w", weights).indices.tolist()


def test_snapshot_without_reference_raises():
    """A tensor never retained (or forgotten) raises NoReferenceError naming it."""
    snapshot = Snapshot()
    snapshot.retain("w", torch.zeros(1))
    snapshot.forget()
    with pytest.raises(NoReferenceError) as info:
        snapshot.changes("w", torch.zeros(1))
    assert "tensor 'w': no retained copy; sync it in full first" == str(info.value)
    assert "w" == info.value.tensor
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, DetectorError)
