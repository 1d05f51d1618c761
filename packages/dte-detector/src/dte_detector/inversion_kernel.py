"""``invert_adamw`` as fused Triton kernels, bit for bit the torch reference on CUDA.

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

``_mark`` reads ``p``, ``m``, ``v`` once (12 bytes per element), tile by tile
(``staging.py``), and writes one changed bit per element, a count per tile and, where at
most ``1 / SLAB_FRACTION`` of a tile's elements changed, their offsets and bounds into
the tile's slab (1 byte of scratch per element); ``staging.gather`` moves the slabs
into sorted outputs (as ``torch.nonzero`` would order them). If any tile had more changes
than its slab holds, ``_compact`` turns the bits into sorted indices instead and
``_bounds`` gathers ``p``, ``m``, ``v`` at them to recompute the bounds (dense changes
make that gather cheap per element).

The term ``mu`` needs an IEEE division ``1 / d`` per element; where it is below half an
ulp of the rest of the guard it cannot change the rounded sum, so a tile computes it only
when one of its elements fails that test (a conservative one, without a division, with a
1 % margin and powers of two that keep it in fp32's normal range).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .changes import ChangeSet, index_dtype
from .inversion import _HALF_ETA, AdamWStep, _corrections, decay_factor, guard_scalars
from .staging import gather, programs, slots, stage, tile_offsets

ROWS = 128
"""Bytes of changed bits per tile of ``ROWS * 8`` elements (``staging.py``)."""
WARPS = 4
WAVES = 16
"""Programs per multiprocessor (``staging.programs``)."""
SLAB_FRACTION = 8
"""A tile stages at most ``1 / SLAB_FRACTION`` of its elements as changed; a tensor with
a denser tile takes the two-pass path (``_compact`` + ``_bounds``)."""
_FIXED = {"enable_fp_fusion": False}
# mu * 2**100 < underflow * 2**25 * 1.01 / d + 2**-48 and guard * 2**-25 <= ulp(guard) / 2,
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
    + 2**-150``; if ``underflow * 2**25 * 1.01 <= (guard * 2**75 - 2**-48) * d``
    (evaluated in fp32: the 1 % and the 4x floor cover its three roundings; a zero, NaN
    or negative right side fails it), then ``mu < guard * 2**-25 <= ulp(guard) / 2`` and
    ``fl(guard + mu) == guard``.
    """
    d = tl.sqrt_rn(v) * inv_sqrt_bc2 + eps
    u = tl.div_rn(m, d) * step_size
    e = (p + u) * inv_decay
    size = tl.abs(u)
    guard = (tl.abs(p) + size) * relative
    guard = guard + size * bias
    guard = guard + floor
    # mu < ulp(guard) / 2 leaves guard + mu == guard: skip its IEEE division unless some
    # element of the tile needs it (a conservative test without a division).
    negligible = underflow * _MU_SCALE <= (guard * _GUARD_SCALE - _MU_FLOOR) * d
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
def _load(p_ptr, m_ptr, v_ptr, tile, numel, ROWS: tl.constexpr):
    offsets, _, _ = tile_offsets(tile, ROWS)
    inside = offsets < numel
    return (tl.load(p_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first"),
            tl.load(m_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first"),
            tl.load(v_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first"))


@triton.jit(do_not_specialize=["tiles"])
def _mark(p_ptr, m_ptr, v_ptr, bits_ptr, counts_ptr, slab_ptr, numel, tiles, inv_sqrt_bc2,
          eps, step_size, inv_decay, relative, bias, floor, underflow, half_eta,
          DECAY_IS_ONE: tl.constexpr, PAYLOAD: tl.constexpr, ROWS: tl.constexpr,
          SLAB: tl.constexpr):
    """Per tile: changed bits and count; if at most SLAB changed, their tile offsets and
    bounds staged in the tile's slab. Reads the next tile first."""
    first, step = tl.program_id(0), tl.num_programs(0)
    p, m, v = _load(p_ptr, m_ptr, v_ptr, first, numel, ROWS)
    for tile in range(first, tiles, step):
        p_next, m_next, v_next = _load(p_ptr, m_ptr, v_ptr, tile + step, numel, ROWS)
        offsets, columns, local = tile_offsets(tile, ROWS)
        changed, low, high = _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay,
                                      relative, bias, floor, underflow, half_eta,
                                      DECAY_IS_ONE, PAYLOAD)
        flags = (changed & (offsets < numel)).to(tl.int32)
        tl.store(bits_ptr + tl.cast(tile, tl.int64) * ROWS + tl.arange(0, ROWS),
                 tl.sum(flags << columns, axis=1).to(tl.uint8))
        count = tl.sum(tl.sum(flags, axis=1), axis=0)
        tl.store(counts_ptr + tile, count)
        if count <= SLAB:
            stage(slab_ptr, tile, flags, local, low, high, SLAB)
        p, m, v = p_next, m_next, v_next


@triton.jit
def _compact(bits_ptr, starts_ptr, index_ptr, ROWS: tl.constexpr):
    """Sorted indices of one tile's changed bits (the path for dense changes)."""
    tile = tl.program_id(0)
    offsets, columns, _ = tile_offsets(tile, ROWS)
    packed = tl.load(bits_ptr + tl.cast(tile, tl.int64) * ROWS + tl.arange(0, ROWS)).to(tl.int32)
    flags = (packed[:, None] >> columns) & 1
    at = tl.load(starts_ptr + tile) + slots(flags)
    tl.store(index_ptr + at, offsets.to(index_ptr.dtype.element_ty), mask=flags != 0)


@triton.jit(do_not_specialize=["total"])
def _bounds(p_ptr, m_ptr, v_ptr, index_ptr, low_ptr, high_ptr, total, inv_sqrt_bc2, eps,
            step_size, inv_decay, relative, bias, floor, underflow, half_eta,
            DECAY_IS_ONE: tl.constexpr, PAYLOAD: tl.constexpr, BLOCK: tl.constexpr):
    """Bounds of the changed elements, gathered by index (the path for dense changes)."""
    rank = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = rank < total
    at = tl.load(index_ptr + rank, mask=inside, other=0)
    p = tl.load(p_ptr + at, mask=inside, other=0.0)
    m = tl.load(m_ptr + at, mask=inside, other=0.0)
    v = tl.load(v_ptr + at, mask=inside, other=0.0)
    _, low, high = _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay, relative, bias,
                            floor, underflow, half_eta, DECAY_IS_ONE, PAYLOAD)
    tl.store(low_ptr + rank, low.to(tl.int16), mask=inside)
    tl.store(high_ptr + rank, high.to(tl.int16), mask=inside)


_PAYLOAD = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def invert_flat(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWStep, *,
                dtype: torch.dtype, guard_ulps: float) -> ChangeSet:
    """``invert_adamw`` over flat fp32 CUDA tensors for a bf16 or fp16 payload.

    Synchronises with the host once, to size the outputs.
    """
    assert ROWS * 8 <= 1 << 15, "tile offsets are staged as int16"
    p, m, v = (t.contiguous() for t in (p, m, v))
    numel, device = p.numel(), p.device
    tiles = triton.cdiv(numel, ROWS * 8)
    slab = ROWS * 8 // SLAB_FRACTION
    bits = torch.empty(tiles * ROWS, dtype=torch.uint8, device=device)
    counts = torch.empty(tiles, dtype=torch.int32, device=device)
    staged = torch.empty(tiles * slab, dtype=torch.int64, device=device)
    scalars = _scalars(h, guard_ulps)
    constants = {"DECAY_IS_ONE": decay_factor(h) == 1.0, "PAYLOAD": _PAYLOAD[dtype], **_FIXED}
    with torch.cuda.device(device.index):
        _mark[(programs(tiles, device, waves=WAVES),)](
            p, m, v, bits, counts, staged, numel, tiles, *scalars, ROWS=ROWS, SLAB=slab,
            num_warps=WARPS, **constants)
        ends = torch.cumsum(counts, 0)
        total, dense = torch.stack([ends[-1], (counts > slab).sum()]).tolist()
        if not dense:
            indices, bounds = gather(counts, ends, total, staged, numel, values=2, rows=ROWS,
                                     capacity=slab)
            return ChangeSet(indices, bounds[0].view(dtype), bounds[1].view(dtype))
        indices = torch.empty(total, dtype=index_dtype(numel), device=device)
        low, high = (torch.empty(total, dtype=torch.int16, device=device) for _ in range(2))
        _compact[(tiles,)](bits, ends - counts, indices, ROWS=ROWS, num_warps=WARPS)
        _bounds[(triton.cdiv(total, 1024),)](p, m, v, indices, low, high, total, *scalars,
                                             BLOCK=1024, num_warps=4, **constants)
    return ChangeSet(indices, low.view(dtype), high.view(dtype))
