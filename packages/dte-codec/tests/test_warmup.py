"""``warm_up``: its tiny syncs launch every codec kernel in every variant a sync uses (on
the CPU under Triton's interpreter, on a GPU compiled), and after it syncs of other
tensors and counts compile nothing."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from kernel_mode import (CODEC_KERNELS, CUDA, DEVICE, compiled_codec_kernels,
                         forget_codec_kernels, kernels, needs_triton)

from dte_codec import apply_, decode, encode_full, warm_up, warmup
from dte_codec.decode import decode_batched
from dte_codec.encode import encode_delta_batched

pytestmark = needs_triton

VARIANTS = {"_gaps": ("WRITE",), "_move": ("TO_FLAT",), "_route": ("NARROW",),
            "_copy": ("ITEMSIZE", "CONTIGUOUS")}
"""The ``constexpr`` arguments that pick a kernel's variant from the data."""
SHAPES = ((1,), (16,), (8, 3), (0,), (24, 7), (40, 61), (0, 5), (1536,), (3, 5), (7,), (64,),
          (2, 2), (33,), (100,), (9, 9), (17,), (48,))
"""``_sizes``' tensors besides an unaligned view: 15 with elements, 2 without."""
COUNTS = ((1,) + (0,) * 17, (16,) * 18, (8,) * 18, (1, 0, 8, 0, 16) * 3 + (1, 0, 1),
          (1, 17, 8, 0, 24, 300, 0, 1000, 1, 2, 32, 3, 1, 99, 80, 16, 47, 5))
"""Changed elements per tensor of ``_sizes`` (at most its size), delta after delta: counts
of 1 and multiples of 8 and 16, as many changed tensors (Triton specialises an int
argument equal to 1 or divisible by 16), and tensors left out."""


def _specialisation(kernel):
    """Triton's key of a launch's arguments, which picks its compiled variant: argument
    types, ints equal to 1 or divisible by 16 (unless ``do_not_specialize``), pointers on
    16 bytes, constexprs; for a CUDA target, from the kernel's own signature."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    binder = create_function_from_signature(jit.signature, jit.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    return lambda *args, **kwargs: tuple(map(str, binder(*args, **kwargs)[1]))


class _Spy:
    """Stands for a kernel and records each launch's variant and Triton specialisation
    before launching it."""

    def __init__(self, kernel, name: str, seen: set, keys: set):
        self.kernel, self.name, self.seen, self.keys = kernel, name, seen, keys
        # on a GPU the compiled variants are counted instead (and Triton's binder may differ)
        self.key = None if CUDA else _specialisation(kernel)

    def __getattr__(self, name: str):  # the kernel's own (``device_caches``)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.seen.add((self.name, *(kwargs[k] for k in VARIANTS.get(self.name.split(".")[1],
                                                                       ()) if k in kwargs)))
            if self.key is not None:
                self.keys.add((self.name, self.key(*args, **kwargs)))
            return launch(*args, **kwargs)
        return run


@pytest.fixture(scope="module")
def spied():
    """Every codec kernel spied on for the module: ``seen`` variants and ``keys``."""
    record = SimpleNamespace(seen=set(), keys=set())
    with pytest.MonkeyPatch.context() as patch:
        for group, (module, names) in CODEC_KERNELS.items():
            module = importlib.import_module(f"dte_codec.{module}")
            for name in names:
                patch.setattr(module, name, _Spy(getattr(module, name), f"{group}.{name}",
                                                 record.seen, record.keys))
        yield record


@pytest.fixture(scope="module")
def warmed(spied):
    """The variants and specialisations of one bf16 warm-up sync."""
    spied.seen.clear()
    spied.keys.clear()
    with kernels():
        warmup._sync(torch.device(DEVICE), torch.bfloat16)
    return SimpleNamespace(seen=set(spied.seen), keys=set(spied.keys))


def test_warm_up_sync_launches_every_variant(warmed):
    """One bf16 warm-up sync launches every kernel, both passes of the decoder's gap
    kernel, gathers and scatters of the undo log, the routes' route (which gathers) and
    scatter, and box copies of word units, of items and of strided rows."""
    expected = {("encode._stats",), ("encode._escape_counts",), ("encode._write",),
                ("digest._digest",), ("decode._fields",), ("decode._gaps", False),
                ("decode._gaps", True), ("decode._stream",), ("decode._check",),
                ("decode._positions",),
                ("values._escaped",), ("values._resolve",), ("scatter._move", True),
                ("scatter._move", False), ("route._route", True), ("route._move",),
                ("box._copy", 2, False), ("box._copy", 2, True),
                ("box._copy", 8, True), ("blocks._owners",)}
    assert expected == warmed.seen


@pytest.mark.skipif(CUDA, reason="on a GPU the next test counts compiled variants")
def test_syncs_after_warm_up_need_no_other_specialisation(warmed, spied):
    """Full and delta syncs of other tensors (empty ones and an unaligned view among
    them), delta after delta with counts of 1, 8 and 16 and tensors left out, launch
    every codec kernel only with specialisations the warm-up met: none would compile."""
    spied.keys.clear()
    with kernels():
        _syncs(torch.device(DEVICE))
    assert set() == spied.keys - warmed.keys


def _sizes(device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2049, generator=gen).to(torch.bfloat16).to(device)
    return {f"w{i}": torch.randn(s, generator=gen).to(torch.bfloat16).to(device)
            for i, s in enumerate(SHAPES)} | {"view": base[1:]}


def _syncs(device: torch.device) -> None:
    """A full sync of ``_sizes`` and then one delta per row of ``COUNTS`` on the batched
    paths (which a GPU takes), each checked."""
    weights = _sizes(device)
    receiver = {n: torch.zeros_like(t) for n, t in weights.items()}
    apply_(receiver, decode(encode_full(weights, stream_id="s", version=1)))
    gen = torch.Generator().manual_seed(6)
    for version, counts in enumerate(COUNTS, start=2):
        changes = {}
        for (name, tensor), count in zip(weights.items(), counts):
            flat = tensor.view(-1)
            picked = torch.randperm(flat.numel(), generator=gen)[:count].sort().values
            indices = picked.to(device)
            old = flat[indices].clone()
            flat.view(torch.int16)[indices] += 1
            changes[name] = SimpleNamespace(indices=indices, base_low=old, base_high=old)
        apply_(receiver, decode_batched(encode_delta_batched(
            weights, changes, stream_id="s", base_version=version - 1, version=version)))
        assert all(torch.equal(receiver[n], t) for n, t in weights.items())


def test_warm_up_compiles_nothing_on_the_cpu(spied):
    """On the CPU (also under the interpreter) there is nothing to compile: no launch."""
    spied.seen.clear()
    with kernels():
        warm_up("cpu")
    assert set() == spied.seen


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="counts compiled CUDA kernels")
def test_first_sync_after_warm_up_compiles_nothing():
    """After ``warm_up``, full and delta syncs of other tensors (other counts, shapes,
    sizes, an unaligned view among them), then deltas with counts of 1, 8 and 16 and
    tensors left out, empty tensors in the set, compile no codec kernel."""
    from dte_codec import encode_delta
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
    _syncs(torch.device("cuda"))
    assert before == compiled_codec_kernels()
