"""Where detection runs: fused Triton kernels for CUDA tensors, the torch reference otherwise.

The torch code in ``inversion.py`` and ``cast.py`` is the reference: every CPU run uses
it, and the GPU tests compare the kernels with it bit for bit. The kernels run when all
tensors are on CUDA, the payload is 16-bit (bf16 or fp16) and ``triton`` imports (it is
an optional dependency: CPU machines do without it). ``reference()`` forces the torch
path, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch

KERNEL_PAYLOADS = (torch.bfloat16, torch.float16)
"""Payload dtypes the kernels handle; fp32 payloads stay on the torch path."""

_forced = False


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """Run the torch reference inside the block, also for CUDA tensors."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


def forced() -> bool:
    """Whether a ``reference()`` block is active (what ``kernels_for`` answers changes)."""
    return _forced


def kernels_for(*tensors: torch.Tensor, payload: torch.dtype) -> bool:
    """Whether the fused kernels handle these tensors and this payload dtype."""
    if _forced or payload not in KERNEL_PAYLOADS or not _triton_installed():
        return False
    for tensor in tensors:  # a loop, not all(): called per tensor of a model, each sync
        if not tensor.is_cuda:
            return False
    return True


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
