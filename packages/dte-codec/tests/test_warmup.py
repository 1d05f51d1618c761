"""``warm_up``: its tiny syncs launch every codec kernel in every variant a sync uses (on
the CPU under Triton's interpreter, on a GPU compiled), and after it a first sync of
other tensors compiles nothing."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from kernel_mode import (CODEC_KERNELS, CUDA, DEVICE, compiled_codec_kernels,
                         forget_codec_kernels, kernels, needs_triton)

from dte_codec import warm_up, warmup

pytestmark = needs_triton

VARIANTS = {"_gaps": ("WRITE",), "_move": ("TO_FLAT", "TO_VALUES"), "_route": ("NARROW",),
            "_copy": ("ITEMSIZE", "CONTIGUOUS")}
"""The ``constexpr`` arguments that pick a kernel's variant from the data."""


class _Spy:
    """Stands for a kernel and records each launch's variant before launching it."""

    def __init__(self, kernel, name: str, seen: set):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.seen.add((self.name, *(kwargs[k] for k in VARIANTS.get(self.name.split(".")[1],
                                                                       ()) if k in kwargs)))
            return launch(*args, **kwargs)
        return run


def _launched(monkeypatch, sync) -> set:
    seen: set = set()
    for group, (module, names) in CODEC_KERNELS.items():
        module = importlib.import_module(f"dte_codec.{module}")
        for name in names:
            monkeypatch.setattr(module, name, _Spy(getattr(module, name), f"{group}.{name}", seen))
    sync()
    return seen


def test_warm_up_sync_launches_every_variant(monkeypatch):
    """One bf16 warm-up sync launches every kernel, both passes of the decoder's gap
    kernel, gathers and scatters of the undo log and of the routes, and box copies of
    word units, of items and of strided rows."""
    with kernels():
        seen = _launched(monkeypatch, lambda: warmup._sync(torch.device(DEVICE), torch.bfloat16))
    expected = {("encode._stats",), ("encode._escape_counts",), ("encode._write",),
                ("digest._digest",), ("decode._fields",), ("decode._gaps", False),
                ("decode._gaps", True), ("decode._stream",), ("decode._check",),
                ("values._escaped",), ("values._resolve",), ("scatter._move", True),
                ("scatter._move", False), ("route._route", True), ("route._move", True),
                ("route._move", False), ("box._copy", 2, False), ("box._copy", 2, True),
                ("box._copy", 8, True)}
    assert expected == seen


def test_warm_up_compiles_nothing_on_the_cpu(monkeypatch):
    """On the CPU (also under the interpreter) there is nothing to compile: no launch."""
    with kernels():
        assert set() == _launched(monkeypatch, lambda: warm_up("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="counts compiled CUDA kernels")
def test_first_sync_after_warm_up_compiles_nothing():
    """After ``warm_up``, full and delta syncs of other tensors (other counts, shapes,
    sizes, an unaligned view among them) compile no codec kernel."""
    from dte_codec import apply_, decode, encode_delta, encode_full
    forget_codec_kernels()
    warm_up("cuda", payloads=[torch.bfloat16, torch.float32])
    before = compiled_codec_kernels()
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        base = torch.randn(70001, generator=gen).to(dtype).cuda()
        weights = {f"w{i}": torch.randn(97 + 31 * i, 61, generator=gen).to(dtype).cuda()
                   for i in range(37)} | {"view": base[1:]}
        receiver = {n: torch.zeros_like(t) for n, t in weights.items()}
        apply_(receiver, decode(encode_full(weights, stream_id="s", version=1)))
        changes = {}
        for i, (name, tensor) in enumerate(weights.items()):
            flat = tensor.view(-1)
            indices = torch.arange(i % 5, flat.numel(), 3 + 40 * (i % 4), device="cuda")
            old = flat[indices].clone()
            bits = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
            flat.view(bits)[indices] += 1
            changes[name] = SimpleNamespace(indices=indices, base_low=old, base_high=old)
        apply_(receiver, decode(encode_delta(weights, changes, stream_id="s", base_version=1,
                                             version=2)))
        assert all(torch.equal(receiver[n], t) for n, t in weights.items())
    assert before == compiled_codec_kernels()
