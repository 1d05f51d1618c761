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


CODEC_KERNELS = {"encode": ("encode_kernel", ("_stats", "_escape_counts", "_write")),
                 "digest": ("body_digest_kernel", ("_digest",)),
                 "decode": ("decode_kernel",
                            ("_fields", "_gaps", "_stream", "_check", "_positions")),
                 "values": ("values_kernel", ("_escaped", "_resolve")),
                 "scatter": ("scatter_kernel", ("_move",)),
                 "route": ("route_kernel", ("_route", "_move")),
                 "box": ("box_copy_kernel", ("_copy",)),
                 "blocks": ("block_kernel", ("_owners",))}
"""Every Triton kernel of ``dte_codec``: per group, its module and kernel names."""


def _codec_kernels() -> dict[str, object]:
    return {f"{group}.{name}": getattr(importlib.import_module(f"dte_codec.{module}"), name)
            for group, (module, names) in CODEC_KERNELS.items() for name in names}


def compiled_codec_kernels() -> dict[str, int]:
    """Compiled variants of every codec kernel (``CODEC_KERNELS``), over all devices."""
    return {name: sum(len(caches[0]) for caches in kernel.device_caches.values())
            for name, kernel in _codec_kernels().items()}


def forget_codec_kernels() -> None:
    """Drop every codec kernel's compiled variants from memory (Triton's disk cache
    keeps them): what earlier tests compiled then hides nothing from a count."""
    for kernel in _codec_kernels().values():
        kernel.device_caches.clear()
