"""The batched inversion kernels under Triton's interpreter, against the torch reference.

Without a CUDA device the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set
here before the kernel module is first imported), so their tiling, int32 offsets,
staging, dense pass, gather and groups are checked on any machine; ``test_kernels.py``
checks them on the GPU. Only fp16 payloads are compared: the interpreter casts fp32 to
bf16 by truncation, not by the hardware's round-to-nearest-even. The CPU reference
divides by the step's scalars where torch's CUDA kernels multiply by their fp32
reciprocals; the fixed inputs below give the same bits either way (a differing element
fails the test).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from detector_cases import bits_of, midpoints

from dte_detector.inversion import GUARD_ULPS, AdamWStep, _invert_chunk

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="test_kernels.py runs them on the GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from dte_detector.inversion_screen import unchanged

    @triton.jit
    def _screened(p_ptr, m_ptr, v_ptr, out_ptr, beta, gamma, rho, scale_eps, scale_root):
        """The screen's verdict per element of a 4,096-element fp16-payload block."""
        at = tl.arange(0, 4096)
        p, m, v = tl.load(p_ptr + at), tl.load(m_ptr + at), tl.load(v_ptr + at)
        tl.store(out_ptr + at, unchanged(p, m, v, beta, gamma, rho, scale_eps,
                                         scale_root, tl.float16).to(tl.int8))

HYPERS = (AdamWStep(lr=3e-6, weight_decay=0.003, eps=1e-8, step=5),
          AdamWStep(lr=1e-3, weight_decay=0.0, eps=1e-8, step=2),  # no decay: DECAY_IS_ONE
          AdamWStep(lr=1e-4, weight_decay=0.1, eps=0.0, step=1),
          AdamWStep(lr=1e-5, weight_decay=0.01, eps=1e-8, step=1000))
SIZES = (1, 7, 1023, 1024, 1025, 2049, 3001, 5000)
"""Around the tile of 1,024 elements, ragged last tiles, several tiles per member."""


def _specials() -> tuple[torch.Tensor, ...]:
    """Signed zeros with zero moments, NaN and +-inf masters, an overflowing ``p + u``,
    subnormals, fp16's overflow edge, ``v = 0``."""
    midpoint = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32).item()
    master = [midpoint, -0.0, 0.0, 1.0, float("nan"), float("inf"), -float("inf"), 3.4e38,
              -3.4e38, 1e-40, -1e-45, 65504.0, 65520.0, 0.0]
    m = [0.0, 0.0, 0.0, -0.0, 1.0, 1.0, -1.0, 5e32, -5e32, 1e-30, -1e-30, 1.0, -1.0, -0.0]
    v = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1e-60, 1.0, 1.0, 0.0]
    return tuple(torch.tensor(x) for x in (master, m, v))


def _members() -> list[tuple[tuple[torch.Tensor, ...], AdamWStep]]:
    """Masters next to fp16 rounding midpoints (within 2 fp32 ulps) and elsewhere, moments
    from subnormal to large with exact zeros, each size aligned and one element off a
    16-byte boundary (scalar loads)."""
    gen = torch.Generator().manual_seed(0)
    members = []
    for k, (n, offset) in enumerate((n, offset) for n in SIZES for offset in (0, 1)):
        count = n + offset
        p = torch.randn(count, generator=gen) * (0.02, 1.0, 1e-30, 300.0)[k % 4]
        near = (midpoints(p, torch.float16).view(torch.int32)
                + torch.randint(-2, 3, (count,), generator=gen, dtype=torch.int32))
        p = torch.where(torch.rand(count, generator=gen) < 0.3, near.view(torch.float32), p)
        m = torch.randn(count, generator=gen) * (1e-3, 1e-8, 1.0, 1e-20)[k % 4]
        v = torch.rand(count, generator=gen) * (1e-6, 1e-16, 1.0, 1e-40)[k // 2 % 4]
        m[torch.rand(count, generator=gen) < 0.1] = 0.0
        v[torch.rand(count, generator=gen) < 0.05] = 0.0
        if count >= 14:
            for tensor, special in zip((p, m, v), _specials()):
                tensor[:14] = special
        members.append(((p[offset:], m[offset:], v[offset:]), HYPERS[k % len(HYPERS)]))
    return members


@pytest.mark.parametrize("slab_fraction,group_elements,wide",
                         [(8, 1 << 28, False), (1, 5000, False), (4096, 5000, False),
                          (8, 5000, True)])
def test_interpreted_batched_inversion_is_the_reference(monkeypatch, slab_fraction,
                                                        group_elements, wide):
    """Every member's indices and fp16 bounds equal the reference's bit for bit: one group
    or many, the default slab, slabs that hold every element, no slab (every tile with a
    change through the dense pass), and the int64 offsets of members past 2**31
    elements."""
    from triton.runtime.interpreter import InterpretedFunction

    from dte_detector import batch, inversion_kernel

    assert isinstance(inversion_kernel._mark, InterpretedFunction), \
        "the kernel module was imported before TRITON_INTERPRET was set"
    monkeypatch.setattr(inversion_kernel, "SLAB_FRACTION", slab_fraction)
    monkeypatch.setattr(batch, "GROUP_ELEMENTS", group_elements)
    if wide:
        monkeypatch.setattr(inversion_kernel, "narrow", lambda numel, rows: False)
    members = _members()
    found = inversion_kernel.invert_batch([flat for flat, _ in members],
                                          [hyper for _, hyper in members],
                                          [torch.float16] * len(members),
                                          guard_ulps=GUARD_ULPS)
    changed = 0
    for (flat, hyper), actual in zip(members, found):
        indices, low, high = _invert_chunk(*flat, hyper, torch.float16, GUARD_ULPS)
        assert indices.tolist() == actual.indices.tolist()
        assert bits_of(low) == bits_of(actual.base_low)
        assert bits_of(high) == bits_of(actual.base_high)
        changed += indices.numel()
    assert 0 < changed < sum(flat[0].numel() for flat, _ in members)


def _placed(count: int, hyper: AdamWStep, seed: int) -> tuple[torch.Tensor, ...]:
    """~N(0, 0.02) masters with gradient-like moments (a few per cent change at lr 3e-6),
    and one element in 16 placed so that ``e`` lands within a few fp32 ulps of a fp16
    rounding midpoint (the screen's own boundary cases), half of them decay-only."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(count, generator=gen) * 0.02
    m = torch.randn(count, generator=gen) * 1e-3
    v = m * m * 2 + 1e-12
    m[torch.rand(count, generator=gen) < 0.1] = 0.0  # rows that saw no gradient
    placed = torch.rand(count, generator=gen) < 1 / 16
    mid = midpoints(p, torch.float16).double()
    ulp = (mid.float().view(torch.int32) + 1).view(torch.float32).double() - mid
    c = 1 - hyper.lr * hyper.weight_decay
    bc1 = 1 - hyper.beta1**hyper.step
    bc2 = 1 - hyper.beta2**hyper.step
    target = mid + ulp * torch.randint(-40, 41, (count,), generator=gen).double()
    moved = p.double() + ulp * torch.randint(-600, 601, (count,), generator=gen).double()
    decay_only = torch.rand(count, generator=gen) < 0.5
    d = v.double().sqrt() / bc2**0.5 + hyper.eps
    update = target * c - moved  # e = (p + u) / c lands on target
    m_placed = update * d / (hyper.lr / bc1)
    p = torch.where(placed, torch.where(decay_only, target * c, moved).float(), p)
    m = torch.where(placed, torch.where(decay_only, 0.0, m_placed).float(), m)
    return p, m, v


@pytest.mark.parametrize(("hyper", "share"), [(HYPERS[0], 0.95), (HYPERS[1], 0.8),
                                              (HYPERS[3], 0.9)], ids=["decay", "no-decay", "late"])
def test_interpreted_screen_changes_nothing(monkeypatch, hyper, share):
    """The screen before ``_verdict`` clears most elements of a sparse step and changes no
    output bit: the screened kernel equals the unscreened one and the torch reference on
    elements placed at and around the screen's boundary (``e`` next to a midpoint,
    decay-only elements), with tiles through the screen's path and through the whole-tile
    path (a slab of 32)."""
    from dte_detector import inversion_kernel

    flat = _placed(4096, hyper, seed=hyper.step)
    indices, low, high = _invert_chunk(*flat, hyper, torch.float16, GUARD_ULPS)
    cleared = torch.empty(4096, dtype=torch.int8)
    _screened[(1,)](*flat, cleared, *inversion_kernel._config(hyper, GUARD_ULPS)[1])
    assert 0 == cleared[indices.long()].sum().item()  # nothing changed is cleared
    assert cleared.sum().item() >= share * (4096 - indices.numel())  # and most of the rest
    for slab_fraction in (8, 32):
        monkeypatch.setattr(inversion_kernel, "SLAB_FRACTION", slab_fraction)
        runs = []
        for screen in (True, False):
            monkeypatch.setattr(inversion_kernel, "SCREEN", screen)
            (found,) = inversion_kernel.invert_batch([flat], [hyper], [torch.float16],
                                                     guard_ulps=GUARD_ULPS)
            runs.append((found.indices.tolist(), bits_of(found.base_low),
                         bits_of(found.base_high)))
        assert runs[0] == runs[1]
        assert (indices.tolist(), bits_of(low), bits_of(high)) == runs[0]
