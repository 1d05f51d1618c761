"""Bitwise comparison of tensors: the only equality the sync promises."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def first_difference(expected: Mapping[str, torch.Tensor],
                     actual: Mapping[str, torch.Tensor]) -> str | None:
    """A description of the first byte that differs, or None when all bytes are equal."""
    if expected.keys() != actual.keys():
        return f"names differ: {sorted(expected)} vs {sorted(actual)}"
    for name in expected:
        want, got = expected[name], actual[name]
        if want.dtype != got.dtype or want.shape != got.shape:
            return f"{name}: {want.dtype}{tuple(want.shape)} vs {got.dtype}{tuple(got.shape)}"
        diff = torch.nonzero(as_bytes(want) != as_bytes(got)).view(-1)
        if diff.numel():
            at = int(diff[0]) // want.element_size()
            return (f"{name}: {diff.numel()} bytes differ, first at element {at}: "
                    f"{want.reshape(-1)[at].item()!r} vs {got.reshape(-1)[at].item()!r}")
    return None


def assert_same_bits(expected: Mapping[str, torch.Tensor],
                     actual: Mapping[str, torch.Tensor]) -> None:
    difference = first_difference(expected, actual)
    assert difference is None, difference
