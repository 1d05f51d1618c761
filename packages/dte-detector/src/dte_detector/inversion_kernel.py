"""``invert_adamw`` fused into two Triton kernels, bit for bit the torch reference on CUDA.

Same estimate, same guard band, same ``_zero_outward``, same exact cases and non-finite
handling as ``inversion._invert_chunk``, with the same fp32 roundings in the same order:

* torch's CUDA ops round each elementwise op once, and its division by a Python scalar is
  a multiplication by the scalar's fp32 reciprocal (``BinaryDivTrueKernel.cu``), so the
  kernel multiplies by ``1 / s`` computed in fp32 on the host; every other scalar is the
  Python double rounded to fp32, as torch passes it to its kernels;
* ``sqrt`` and ``/`` are the IEEE-rounded ``tl.sqrt_rn``/``tl.div_rn`` (Triton's plain
  ones are approximate), and the kernels are compiled with ``enable_fp_fusion=False`` so
  that no ``a * b + c`` contracts into an FMA (torch's separate kernels never fuse);
* the payload casts are the hardware's round-to-nearest-even ``cvt.rn`` that torch's CUDA
  casts use too (NaN becomes the canonical ``0x7FFF`` in both).

``_mark`` reads ``p``, ``m``, ``v`` once (12 bytes per element) and writes one changed bit
per element and a count per block; a cumulative sum of the counts gives each block's
first output slot; ``_compact`` turns the bits into sorted indices (as ``torch.nonzero``);
``_bounds`` gathers ``p``, ``m``, ``v`` at the changed indices only and recomputes their
``base_low``/``base_high`` (the arithmetic, not the bytes, would dominate a second pass
over every element).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .changes import ChangeSet, index_dtype
from .inversion import _HALF_ETA, AdamWStep, _corrections, decay_factor, guard_scalars

BLOCK = 4096
"""Elements per program; a multiple of 8 so that each program owns whole bytes of bits."""
WARPS = 8
_FIXED = {"enable_fp_fusion": False, "num_warps": WARPS}


def fp32(value: float) -> float:
    """A Python scalar as torch's CUDA kernels receive it: rounded to fp32."""
    return torch.tensor(value, dtype=torch.float64).to(torch.float32).item()


def reciprocal(value: float) -> float:
    """``1 / value`` in fp32, as torch's CUDA division by a CPU scalar forms it."""
    one = torch.ones((), dtype=torch.float32)
    return (one / torch.tensor(value, dtype=torch.float32)).item()


def _scalars(h: AdamWStep, guard_ulps: float) -> tuple[float, ...]:
    """The kernel's scalar arguments, in ``_verdict``'s order."""
    bc1, bc2 = _corrections(h)
    c = decay_factor(h)
    guard = guard_scalars(h, c, guard_ulps)
    return (reciprocal(math.sqrt(bc2)), fp32(h.eps), fp32(h.lr / bc1), reciprocal(c),
            fp32(guard.relative), fp32(guard.bias), fp32(guard.floor), fp32(guard.underflow),
            fp32(_HALF_ETA))


@triton.jit
def _payload_bits(x, PAYLOAD: tl.constexpr):
    """The 16 bits of ``x`` cast to the payload dtype, zero-extended into int32."""
    return x.to(PAYLOAD).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _finite(x):
    return (x.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay, relative, bias, floor,
             underflow, half_eta, DECAY_IS_ONE: tl.constexpr, PAYLOAD: tl.constexpr):
    """``(changed, low bits, high bits)`` of ``_invert_chunk``, op for op."""
    d = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
    u = tl.div_rn(m, d) * step_size
    e = (p + u) * inv_decay
    size = tl.abs(u)
    guard = (tl.abs(p) + size) * relative
    guard = guard + size * bias
    guard = guard + floor
    guard = guard + tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d) * underflow * half_eta
    low = _payload_bits(e - guard, PAYLOAD)
    high = _payload_bits(e + guard, PAYLOAD)
    low = tl.where((low & 0x7FFF) == 0, 0x8000, low)  # _zero_outward: -0 below
    high = tl.where((high & 0x7FFF) == 0, 0, high)  # and +0 above
    new = _payload_bits(p, PAYLOAD)
    same = (low == new) & (high == new)
    if DECAY_IS_ONE:
        still = (p != 0) | ((p == 0) & (p.to(tl.int32, bitcast=True) < 0))
    else:
        still = (p == 0) & (p.to(tl.int32, bitcast=True) < 0)
    exact = (m == 0) & still
    finite = _finite(p) & _finite(u)
    changed = ((same | exact) & finite) == 0
    low = tl.where(finite, low, 0xFFFF)  # unknown_bounds: lowest and highest patterns
    high = tl.where(finite, high, 0x7FFF)
    return changed, low, high


@triton.jit(do_not_specialize=["numel"])
def _mark(p_ptr, m_ptr, v_ptr, bits_ptr, counts_ptr, numel, inv_sqrt_bc2, eps, step_size,
          inv_decay, relative, bias, floor, underflow, half_eta, DECAY_IS_ONE: tl.constexpr,
          PAYLOAD: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    p = tl.load(p_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    m = tl.load(m_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    v = tl.load(v_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    changed, _, _ = _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay, relative, bias,
                             floor, underflow, half_eta, DECAY_IS_ONE, PAYLOAD)
    flags = (changed & inside).to(tl.int32)
    packed = tl.sum(tl.reshape(flags, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
    tl.store(bits_ptr + block * (BLOCK // 8) + tl.arange(0, BLOCK // 8), packed.to(tl.uint8))
    tl.store(counts_ptr + block, tl.sum(flags, axis=0))


@triton.jit
def _compact(bits_ptr, starts_ptr, index_ptr, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    packed = tl.load(bits_ptr + block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)).to(tl.int32)
    flags = tl.reshape((packed[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,))
    slots = tl.load(starts_ptr + block) + tl.cumsum(flags, axis=0) - 1
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    tl.store(index_ptr + slots, offsets.to(index_ptr.dtype.element_ty), mask=flags != 0)


@triton.jit(do_not_specialize=["total"])
def _bounds(p_ptr, m_ptr, v_ptr, index_ptr, low_ptr, high_ptr, total, inv_sqrt_bc2, eps,
            step_size, inv_decay, relative, bias, floor, underflow, half_eta,
            DECAY_IS_ONE: tl.constexpr, PAYLOAD: tl.constexpr, BLOCK: tl.constexpr):
    slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = slots < total
    at = tl.load(index_ptr + slots, mask=inside, other=0)
    p = tl.load(p_ptr + at, mask=inside, other=0.0)
    m = tl.load(m_ptr + at, mask=inside, other=0.0)
    v = tl.load(v_ptr + at, mask=inside, other=0.0)
    _, low, high = _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay, relative, bias,
                            floor, underflow, half_eta, DECAY_IS_ONE, PAYLOAD)
    tl.store(low_ptr + slots, low.to(tl.int16), mask=inside)
    tl.store(high_ptr + slots, high.to(tl.int16), mask=inside)


_PAYLOAD = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def invert_flat(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWStep, *,
                dtype: torch.dtype, guard_ulps: float) -> ChangeSet:
    """``invert_adamw`` over flat fp32 CUDA tensors for a bf16 or fp16 payload.

    Synchronises once with the host, to size the outputs.
    """
    p, m, v = (t.contiguous() for t in (p, m, v))
    numel = p.numel()
    blocks = triton.cdiv(numel, BLOCK)
    bits = torch.empty(blocks * BLOCK // 8, dtype=torch.uint8, device=p.device)
    counts = torch.empty(blocks, dtype=torch.int32, device=p.device)
    scalars = _scalars(h, guard_ulps)
    constants = {"DECAY_IS_ONE": decay_factor(h) == 1.0, "PAYLOAD": _PAYLOAD[dtype],
                 "BLOCK": BLOCK, **_FIXED}
    with torch.cuda.device(p.device.index):
        _mark[(blocks,)](p, m, v, bits, counts, numel, *scalars, **constants)
        ends = torch.cumsum(counts, 0)
        total = int(ends[-1])
        indices = torch.empty(total, dtype=index_dtype(numel), device=p.device)
        low, high = (torch.empty(total, dtype=torch.int16, device=p.device) for _ in range(2))
        if total:
            _compact[(blocks,)](bits, ends - counts, indices, BLOCK=BLOCK, num_warps=WARPS)
            _bounds[(triton.cdiv(total, BLOCK),)](p, m, v, indices, low, high, total, *scalars,
                                                  **constants)
    return ChangeSet(indices, low.view(dtype), high.view(dtype))
