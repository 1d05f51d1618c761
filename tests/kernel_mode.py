"""Where tests run the codec's Triton kernels: on the CUDA device when there is one, else
on the CPU under Triton's interpreter, which importing this module switches on (before
any kernel is first imported)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

from dte_codec.dispatch import interpreted

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton")


def kernels() -> contextlib.AbstractContextManager[None]:
    """Inside: the kernels take this device's tensors."""
    return contextlib.nullcontext() if CUDA else interpreted()
