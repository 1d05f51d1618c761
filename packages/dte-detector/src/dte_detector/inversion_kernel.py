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
per element, a count per program and, where at most ``1 / SLAB_FRACTION`` of the
program's elements changed, their offsets and bounds into the program's slab (0.75 bytes
of scratch per element); a cumulative sum of the counts gives each program's first output
slot, and ``_gather`` moves the slabs there, in index order (as ``torch.nonzero``). If
any program had more changes than its slab holds, ``_compact`` turns the bits into sorted
indices instead and ``_bounds`` gathers ``p``, ``m``, ``v`` at them to recompute the
bounds (dense changes make that gather cheap per element).

The term ``mu`` needs an IEEE division ``1 / d`` per element; where it is below half an
ulp of the rest of the guard it cannot change the rounded sum, so a tile computes it only
when one of its elements fails that test (a conservative one, through the approximate
quotient with a 1 % margin and powers of two that keep it in fp32's normal range).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .changes import ChangeSet, index_dtype
from .inversion import _HALF_ETA, AdamWStep, _corrections, decay_factor, guard_scalars

ROWS = 512
"""Bytes of changed bits per program: a program owns ``ROWS * 8`` elements as a
``[ROWS, 8]`` tile, so that packing bits and counting are reductions along rows."""
WARPS = 8
SLAB_FRACTION = 8
"""A program stages at most ``1 / SLAB_FRACTION`` of its elements as changed; a tensor
with a denser program takes the two-pass path (``_compact`` + ``_bounds``)."""
_FIXED = {"enable_fp_fusion": False}
# mu * 2**100 < (underflow * 2**25 * 1.01) / d + 2**-48 and guard * 2**-25 <= ulp(guard) / 2,
# scaled by 2**100 to stay in fp32's normal range (a proof in ``_verdict``'s docstring).
_MU_SCALE: tl.constexpr = tl.constexpr(2.0**25 * 1.01)
_MU_FLOOR: tl.constexpr = tl.constexpr(2.0**-48)
_GUARD_SCALE: tl.constexpr = tl.constexpr(2.0**75)


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
    """``(changed, low bits, high bits)`` of ``_invert_chunk``, op for op.

    ``mu = fl(fl(fl(1 / d) * underflow) * half_eta) <= underflow * 2**-75 / d * (1 + 2**-22)
    + 2**-150``; if ``underflow * 2**25 * 1.01 / d + 2**-48 <= guard * 2**75`` (evaluated
    in fp32 with an approximate quotient: the 1 % and the 4x floor cover its roundings),
    then ``mu < guard * 2**-25 <= ulp(guard) / 2`` and ``fl(guard + mu) == guard``.
    """
    d = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
    u = tl.div_rn(m, d) * step_size
    e = (p + u) * inv_decay
    size = tl.abs(u)
    guard = (tl.abs(p) + size) * relative
    guard = guard + size * bias
    guard = guard + floor
    # mu < ulp(guard) / 2 leaves guard + mu == guard: skip its IEEE division unless some
    # element of the tile needs it (the approximate quotient's 1 % covers its 2 ulps).
    negligible = underflow * _MU_SCALE / d + _MU_FLOOR <= guard * _GUARD_SCALE
    if tl.min(negligible.to(tl.int32)) == 0:
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


@triton.jit
def _tile(block, ROWS: tl.constexpr):
    """Flat offsets of a program's ``[ROWS, 8]`` tile, its column numbers and offsets in it."""
    local = tl.arange(0, ROWS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    return block * (ROWS * 8) + local, tl.arange(0, 8)[None, :], local


@triton.jit(do_not_specialize=["numel"])
def _mark(p_ptr, m_ptr, v_ptr, bits_ptr, counts_ptr, slab_ptr, numel, inv_sqrt_bc2, eps,
          step_size, inv_decay, relative, bias, floor, underflow, half_eta,
          DECAY_IS_ONE: tl.constexpr, PAYLOAD: tl.constexpr, ROWS: tl.constexpr,
          SLAB: tl.constexpr):
    """Changed bits and count of one tile; if at most SLAB changed, their tile offsets and
    bounds staged as three int16 rows of the program's slab."""
    block = tl.program_id(0).to(tl.int64)
    offsets, columns, local = _tile(block, ROWS)
    inside = offsets < numel
    p = tl.load(p_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    m = tl.load(m_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    v = tl.load(v_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    changed, low, high = _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay, relative,
                                  bias, floor, underflow, half_eta, DECAY_IS_ONE, PAYLOAD)
    flags = (changed & inside).to(tl.int32)
    tl.store(bits_ptr + block * ROWS + tl.arange(0, ROWS),
             tl.sum(flags << columns, axis=1).to(tl.uint8))
    per_row = tl.sum(flags, axis=1)
    count = tl.sum(per_row, axis=0)
    tl.store(counts_ptr + block, count)
    if count <= SLAB:
        slots = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(flags, axis=1) - flags
        slab = slab_ptr + block * (3 * SLAB) + slots
        tl.store(slab, local.to(tl.int16), mask=flags != 0)
        tl.store(slab + SLAB, low.to(tl.int16), mask=flags != 0)
        tl.store(slab + 2 * SLAB, high.to(tl.int16), mask=flags != 0)


@triton.jit
def _gather(counts_ptr, starts_ptr, slab_ptr, index_ptr, low_ptr, high_ptr,
            ROWS: tl.constexpr, SLAB: tl.constexpr):
    """Move one program's staged changes to their sorted place in the outputs."""
    block = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, SLAB)
    staged = slots < tl.load(counts_ptr + block)
    at = tl.load(starts_ptr + block) + slots
    slab = slab_ptr + block * (3 * SLAB) + slots
    local = tl.load(slab, mask=staged, other=0).to(tl.int64)
    tl.store(index_ptr + at, (block * (ROWS * 8) + local).to(index_ptr.dtype.element_ty),
             mask=staged)
    tl.store(low_ptr + at, tl.load(slab + SLAB, mask=staged), mask=staged)
    tl.store(high_ptr + at, tl.load(slab + 2 * SLAB, mask=staged), mask=staged)


@triton.jit
def _compact(bits_ptr, starts_ptr, index_ptr, ROWS: tl.constexpr):
    """Sorted indices of one tile's changed bits (the path for dense changes)."""
    block = tl.program_id(0).to(tl.int64)
    offsets, columns, _ = _tile(block, ROWS)
    packed = tl.load(bits_ptr + block * ROWS + tl.arange(0, ROWS)).to(tl.int32)
    flags = (packed[:, None] >> columns) & 1
    per_row = tl.sum(flags, axis=1)
    slots = (tl.load(starts_ptr + block) + tl.cumsum(per_row, axis=0) - per_row)[:, None] + (
        tl.cumsum(flags, axis=1) - flags)
    tl.store(index_ptr + slots, offsets.to(index_ptr.dtype.element_ty), mask=flags != 0)


@triton.jit(do_not_specialize=["total"])
def _bounds(p_ptr, m_ptr, v_ptr, index_ptr, low_ptr, high_ptr, total, inv_sqrt_bc2, eps,
            step_size, inv_decay, relative, bias, floor, underflow, half_eta,
            DECAY_IS_ONE: tl.constexpr, PAYLOAD: tl.constexpr, BLOCK: tl.constexpr):
    """Bounds of the changed elements, gathered by index (the path for dense changes)."""
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
    assert ROWS * 8 <= 1 << 15, "tile offsets are staged as int16"
    p, m, v = (t.contiguous() for t in (p, m, v))
    numel, device = p.numel(), p.device
    blocks = triton.cdiv(numel, ROWS * 8)
    slab = ROWS * 8 // SLAB_FRACTION
    bits = torch.empty(blocks * ROWS, dtype=torch.uint8, device=device)
    counts = torch.empty(blocks, dtype=torch.int32, device=device)
    staged = torch.empty(blocks * 3 * slab, dtype=torch.int16, device=device)
    scalars = _scalars(h, guard_ulps)
    constants = {"DECAY_IS_ONE": decay_factor(h) == 1.0, "PAYLOAD": _PAYLOAD[dtype], **_FIXED}
    with torch.cuda.device(device.index):
        _mark[(blocks,)](p, m, v, bits, counts, staged, numel, *scalars, ROWS=ROWS, SLAB=slab,
                         num_warps=WARPS, **constants)
        ends = torch.cumsum(counts, 0)
        total, dense = torch.stack([ends[-1], (counts > slab).sum()]).tolist()
        indices = torch.empty(total, dtype=index_dtype(numel), device=device)
        low, high = (torch.empty(total, dtype=torch.int16, device=device) for _ in range(2))
        if total and not dense:
            _gather[(blocks,)](counts, ends - counts, staged, indices, low, high, ROWS=ROWS,
                               SLAB=slab, num_warps=WARPS)
        elif total:
            _compact[(blocks,)](bits, ends - counts, indices, ROWS=ROWS, num_warps=WARPS)
            _bounds[(triton.cdiv(total, 1024),)](p, m, v, indices, low, high, total, *scalars,
                                                 BLOCK=1024, num_warps=4, **constants)
    return ChangeSet(indices, low.view(dtype), high.view(dtype))
