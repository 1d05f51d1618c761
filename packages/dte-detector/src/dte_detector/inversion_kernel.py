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

``invert`` takes the tensors of a whole sync at once (``batch.py``: groups of
tensors with the same step and payload, walked as one tile space, one host
synchronisation per group). ``_mark`` reads ``p``, ``m``, ``v`` once (12 bytes per
element), tile by tile (``staging.py``), and writes a count per tile and the offsets and
bounds of its first changes into the tile's slab (``1 / SLAB_FRACTION`` of its elements,
1 byte of scratch per element); ``staging.gather`` moves the slabs into sorted outputs
(as ``torch.nonzero`` would order them). A tile with more changes than its slab holds is
recomputed by ``_dense``, which writes them straight into the outputs (launched only
when such a tile exists). Offsets within a member are int32 where its size allows.

The term ``mu`` needs an IEEE division ``1 / d`` per element; where it is below half an
ulp of the rest of the guard it cannot change the rounded sum, so a tile computes it only
when one of its elements fails that test (a conservative one, without a division, with a
1 % margin and powers of two that keep it in fp32's normal range).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import batch, layout
from .changes import ChangeRun
from .inversion import (HALF_ETA, AdamWStep, bias_corrections, decay_factor, fp32, guard_scalars,
                        reciprocal)
from .staging import (advance, gather, locate, member_offset, narrow, on_device, place,
                      programs, read_limit, stage_counted, tile_elements, tile_offsets)

ROWS = 128
"""Rows of 8 elements per tile (``staging.py``)."""
WARPS = 4
WAVES = 32
"""Programs per multiprocessor (``staging.programs``): more than fit at once (four), so
that the programs' last tiles even out across the multiprocessors (measured against 16,
64 and 128 in docs/benchmarks.md)."""
SLAB_FRACTION = 8
"""A tile stages at most ``1 / SLAB_FRACTION`` of its elements as changed; a denser tile
is recomputed by ``_dense``."""
REGISTERS: int | None = None
"""A cap on registers per thread (``maxnreg``), None: the compiler's choice (caps of 96,
80 and 72 made ``_mark`` slower: docs/benchmarks.md)."""
_FIXED = {"enable_fp_fusion": False}
_FP32_ALIGN = batch.VECTOR_BYTES // 4
# mu * 2**100 < underflow * 2**25 * 1.01 / d + 2**-48 and guard * 2**-25 <= ulp(guard) / 2,
# scaled by 2**100 to stay in fp32's normal range (a proof in ``_verdict``'s docstring).
_MU_SCALE: tl.constexpr = tl.constexpr(2.0**25 * 1.01)
_MU_FLOOR: tl.constexpr = tl.constexpr(2.0**-48)
_GUARD_SCALE: tl.constexpr = tl.constexpr(2.0**75)
_FP32_MAX: tl.constexpr = tl.constexpr(torch.finfo(torch.float32).max)


def _scalars(h: AdamWStep, guard_ulps: float) -> tuple[float, ...]:
    """The kernel's scalar arguments, in ``_verdict``'s order."""
    bc1, bc2 = bias_corrections(h)
    c = decay_factor(h)
    guard = guard_scalars(h, c, guard_ulps)
    return (reciprocal(math.sqrt(bc2)), fp32(h.eps), fp32(h.lr / bc1), reciprocal(c),
            fp32(guard.relative), fp32(guard.bias), fp32(guard.floor), fp32(guard.underflow),
            fp32(HALF_ETA))


@functools.lru_cache(maxsize=64)
def _config(h: AdamWStep, guard_ulps: float) -> tuple[tuple[float, ...], bool]:
    """The kernel's scalars and ``DECAY_IS_ONE`` for a step (kept: every tensor of a sync
    shares a few steps, and each costs a few host tensor operations)."""
    return _scalars(h, guard_ulps), decay_factor(h) == 1.0


@triton.jit
def _payload_bits(x, PAYLOAD: tl.constexpr):
    """The 16 bits of ``x`` cast to the payload dtype, zero-extended into int32."""
    return x.to(PAYLOAD).to(tl.uint16, bitcast=True).to(tl.int32)


@triton.jit
def _finite(x):
    # one float compare (NaN compares false), where an exponent test takes two integer ops
    return tl.abs(x) <= _FP32_MAX


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
    # the reference's (p != 0) | (p is -0) and (p is -0), as one integer compare each
    if DECAY_IS_ONE:
        still = p.to(tl.int32, bitcast=True) != 0
    else:
        still = p.to(tl.int32, bitcast=True) == -2147483648
    exact = (m == 0) & still
    finite = _finite(p) & _finite(u)
    changed = ((same | exact) & finite) == 0
    low = tl.where(finite, low, 0xFFFF)  # unknown_bounds: lowest and highest patterns
    high = tl.where(finite, high, 0x7FFF)
    return changed, low, high


@triton.jit
def _load(p_ptr, m_ptr, v_ptr, offsets_ptr, width, numels_ptr, starts_ptr, member, tile,
          ROWS: tl.constexpr, ALIGN: tl.constexpr, NARROW: tl.constexpr):
    """A tile's ``p``, ``m``, ``v``, its member's size and the member-local offsets
    (int32 with ``NARROW``; the member's base pointers are formed once per tile)."""
    offsets, _, _ = tile_offsets(tile - tl.load(starts_ptr + member), ROWS, NARROW)
    numel = tl.load(numels_ptr + member).to(offsets.dtype)
    inside = offsets < read_limit(numel, ALIGN)
    p = tl.load((p_ptr + member_offset(offsets_ptr, member, ALIGN)) + offsets, mask=inside,
                other=0.0, eviction_policy="evict_first")
    m = tl.load((m_ptr + member_offset(offsets_ptr, width + member, ALIGN)) + offsets,
                mask=inside, other=0.0, eviction_policy="evict_first")
    v = tl.load((v_ptr + member_offset(offsets_ptr, 2 * width + member, ALIGN)) + offsets,
                mask=inside, other=0.0, eviction_policy="evict_first")
    return p, m, v, numel, offsets


@triton.jit(do_not_specialize=["tiles", "width"])
def _mark(p_ptr, m_ptr, v_ptr, offsets_ptr, width, numels_ptr, starts_ptr, counts_ptr,
          dense_ptr, slab_ptr, tiles, inv_sqrt_bc2, eps, step_size, inv_decay, relative, bias,
          floor, underflow, half_eta, DECAY_IS_ONE: tl.constexpr, PAYLOAD: tl.constexpr,
          ROWS: tl.constexpr, SLAB: tl.constexpr, ALIGN: tl.constexpr,
          NARROW: tl.constexpr):
    """Per tile: the count of changed elements and the tile offsets and bounds of the
    first SLAB of them staged in the tile's slab; a tile with more adds one at
    ``dense_ptr``. Reads the next tile first."""
    first, step = tl.program_id(0), tl.num_programs(0)
    member = advance(starts_ptr, first.to(tl.int64) * 0, first)
    p, m, v, numel, offsets = _load(p_ptr, m_ptr, v_ptr, offsets_ptr, width, numels_ptr,
                                    starts_ptr, member, first, ROWS, ALIGN, NARROW)
    _, _, local = tile_offsets(0, ROWS)
    for tile in range(first, tiles, step):
        member = advance(starts_ptr, member, tile + step)
        p_next, m_next, v_next, numel_next, offsets_next = _load(
            p_ptr, m_ptr, v_ptr, offsets_ptr, width, numels_ptr, starts_ptr, member,
            tile + step, ROWS, ALIGN, NARROW)
        changed, low, high = _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay,
                                      relative, bias, floor, underflow, half_eta,
                                      DECAY_IS_ONE, PAYLOAD)
        flags = (changed & (offsets < numel)).to(tl.int32)
        stage_counted(slab_ptr, counts_ptr, dense_ptr, tile, flags, local, low, high, SLAB)
        p, m, v, numel, offsets = p_next, m_next, v_next, numel_next, offsets_next


@triton.jit(do_not_specialize=["total", "width", "steps"])
def _dense(p_ptr, m_ptr, v_ptr, offsets_ptr, width, numels_ptr, starts_ptr, counts_ptr,
           ends_ptr, index_ptr, bounds_ptr, total, steps, inv_sqrt_bc2, eps, step_size,
           inv_decay, relative, bias, floor, underflow, half_eta, DECAY_IS_ONE: tl.constexpr,
           PAYLOAD: tl.constexpr, ROWS: tl.constexpr, SLAB: tl.constexpr,
           ALIGN: tl.constexpr, NARROW: tl.constexpr):
    """The tiles ``_mark`` could not stage: recomputed, written straight into the outputs
    from the tile's first slot (its end less its count)."""
    tile = tl.program_id(0)
    count = tl.load(counts_ptr + tile)
    if count > SLAB:
        p, m, v, numel, offsets = _load(p_ptr, m_ptr, v_ptr, offsets_ptr, width, numels_ptr,
                                        starts_ptr, locate(starts_ptr, tile, steps), tile, ROWS,
                                        ALIGN, NARROW)
        changed, low, high = _verdict(p, m, v, inv_sqrt_bc2, eps, step_size, inv_decay,
                                      relative, bias, floor, underflow, half_eta,
                                      DECAY_IS_ONE, PAYLOAD)
        flags = (changed & (offsets < numel)).to(tl.int32)
        place(index_ptr, bounds_ptr, total, tl.load(ends_ptr + tile) - count, flags, offsets,
              low, high, VALUES=2)


_PAYLOAD = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def configurations(hypers: Sequence[AdamWStep], dtypes: Sequence[torch.dtype],
                   guard_ulps: float) -> list[tuple]:
    """Per tensor its kernel configuration and payload dtype (``invert``'s keys).
    Neighbours mostly share a parameter group (and ``torch_adamw_states`` then one step
    object), so a key equal to the previous tensor's is that same tuple: an identity
    test, or one comparison, instead of a cache lookup (a hash and a comparison), and
    ``batch.key_ids`` then matches keys by identity."""
    keys = []
    key = last = last_dtype = None
    for hyper, dtype in zip(hypers, dtypes):
        if hyper is not last or dtype is not last_dtype:
            # not ``!=``: attrs' ``__ne__`` calls ``__eq__`` and negates it, a call more
            if not (hyper == last and dtype == last_dtype):
                key = (*_config(hyper, guard_ulps), dtype)
            last, last_dtype = hyper, dtype
        keys.append(key)
    return keys


def invert(flats: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
           keys: Sequence[tuple], kept: layout.Fused) -> list[ChangeRun]:
    """``invert_adamw`` over non-empty contiguous fp32 CUDA tensors ``(p, m, v)`` of one
    device (any shape: the kernels read them flat; ``kept.pick``'s members of a call),
    each with its ``configurations`` key: one run per group of ``kept``'s plan (planned
    here when it does not fit: ``ROWS`` is read at the call, ``tools/gpu/tune_kernels.py``
    sets it), its members keyed by their positions in ``flats`` (every tensor is in one
    run, with or without changes).

    Synchronises with the host once per ``batch.GROUP_ELEMENTS`` elements, to size the
    outputs, while the device works on the next group.
    """
    tile = tile_elements(ROWS)
    groups = kept.groups(flats, keys, tile_elements=tile)
    found: list[ChangeRun] = []
    slab = tile // SLAB_FRACTION
    device = flats[0][0].device

    def launch(group: batch.Group):
        scalars, decay_is_one, dtype = keys[group.members[0]]
        counts, sizes = batch.scratch(group, device)
        staged = torch.empty(group.tiles * slab, dtype=torch.int64, device=device)
        config = {"DECAY_IS_ONE": decay_is_one, "PAYLOAD": _PAYLOAD[dtype], "ROWS": ROWS,
                  "SLAB": slab, "ALIGN": _FP32_ALIGN if group.aligned else 1,
                  "NARROW": narrow(group.numel, ROWS), **_FIXED,
                  "maxnreg": REGISTERS}
        tables = (*flats[group.members[0]], group.offsets, group.offsets.shape[1], group.numels,
                  group.starts, counts)
        _mark[(programs(group.tiles, device, waves=WAVES),)](
            *tables, sizes, staged, group.tiles, *scalars, num_warps=WARPS, **config)
        return tables, config, counts, batch.tile_ends(group, counts, sizes), staged, sizes

    def finish(group: batch.Group, launched, sizes: list[int]) -> None:
        tables, config, counts, ends, staged, _ = launched
        dense, *member_ends = sizes
        total = member_ends[-1]
        indices, bounds = gather(counts, ends, total, staged, group.starts,
                                 steps=group.steps, numel=group.numel, values=2, rows=ROWS,
                                 capacity=slab)
        if dense:
            _dense[(group.tiles,)](*tables, ends, indices, bounds, total, group.steps,
                                   *keys[group.members[0]][0], num_warps=WARPS, **config)
        dtype = keys[group.members[0]][2]
        found.append(ChangeRun(group.members, tuple(batch.member_counts(member_ends)), indices,
                               bounds[0].view(dtype), bounds[1].view(dtype)))

    with on_device(device):
        batch.pipelined(groups, launch, lambda launched: launched[-1], finish)
    return found
