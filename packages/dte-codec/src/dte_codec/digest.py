"""Digests of tensors for verifying a sync end to end (dtype, shape and exact bytes)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash


def digest(tensor: torch.Tensor) -> str:
    """xxh3-128 hex digest of a tensor's dtype, shape and bytes."""
    hasher = xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    if data.numel():
        hasher.update(data.numpy())
    return hasher.hexdigest()


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``digest`` of every tensor, by name."""
    return {name: digest(tensor) for name, tensor in tensors.items()}
