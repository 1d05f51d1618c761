"""Where the batched codec runs: fused Triton kernels for CUDA tensors, torch ops otherwise.

The torch paths are the reference: the per-tensor ones (``encode_delta_per_tensor``,
``decode_per_entry``, ``values.decode_values``) are the ground truth every batched path
matches byte for byte, and the batched torch ops (``flat_encode.TorchFlat`` and friends)
run where the kernels do not. The kernels run on CUDA tensors when ``triton`` imports (an
optional dependency: CPU machines do without it). ``reference()`` forces the torch ops,
for tests and before/after benchmarks; ``interpreted()`` lets the kernels take CPU
tensors, for tests under Triton's interpreter (``TRITON_INTERPRET=1`` set before the
kernels are first imported).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch

_switches = {"reference": False, "cpu": False}


@contextlib.contextmanager
def _switched_on(name: str) -> Iterator[None]:
    before, _switches[name] = _switches[name], True
    try:
        yield
    finally:
        _switches[name] = before


def reference() -> contextlib.AbstractContextManager[None]:
    """Run the torch ops inside the block, also for CUDA tensors."""
    return _switched_on("reference")


def interpreted() -> contextlib.AbstractContextManager[None]:
    """Run the kernels on CPU tensors inside the block (Triton's interpreter)."""
    return _switched_on("cpu")


def fused(device: torch.device) -> bool:
    """Whether the batched codec runs its Triton kernels on ``device``."""
    return (not _switches["reference"] and (device.type == "cuda" or _switches["cpu"])
            and _triton_installed())


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it ``device`` for the block."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
