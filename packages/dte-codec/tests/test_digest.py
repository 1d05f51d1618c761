"""Tensor digests for end-to-end verification: dtype, shape and exact bytes."""

from __future__ import annotations

import torch
from dte_codec import digests
from dte_codec.digest import digest


def test_pinned_value():
    """The digest of a known tensor is pinned, so sender and receiver of different
    builds agree (xxh3-128 over ``f"{dtype}{shape}"`` then the bytes)."""
    assert "2f12276a4c4130689568d277102ed035" == digest(
        torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16))


def test_equal_bytes_equal_digest():
    """Copies, non-contiguous views and tensors requiring grad digest by their values."""
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = tensor.t()
    assert digest(tensor) == digest(tensor.clone())
    assert digest(transposed.contiguous()) == digest(transposed)
    assert digest(tensor) == digest(tensor.clone().requires_grad_())


def test_bits_not_values():
    """-0.0 and +0.0, and NaNs with different payloads, digest differently."""
    nan_a = torch.tensor([0x7FC0], dtype=torch.int16).view(torch.bfloat16)
    nan_b = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    assert digest(nan_a) != digest(nan_b)


def test_dtype_and_shape_count():
    """The same bytes under another dtype or shape digest differently."""
    tensor = torch.zeros(4, dtype=torch.int16)
    assert digest(tensor) != digest(tensor.view(torch.bfloat16))
    assert digest(tensor) != digest(tensor.reshape(2, 2))
    assert digest(torch.empty(0)) != digest(torch.empty(0, 3))


def test_digests_by_name():
    """``digests`` maps every name to its tensor's digest."""
    tensors = {"a": torch.ones(2), "b": torch.tensor(3, dtype=torch.int64)}
    assert {name: digest(t) for name, t in tensors.items()} == digests(tensors)
    assert {} == digests({})
