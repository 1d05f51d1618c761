"""A cheap exact pre-test of the inversion kernel: elements it clears are unchanged.

``inversion_kernel._verdict`` reproduces the torch reference op for op, IEEE ``sqrt`` and
``/`` included, for every element. Most elements (all but the few per cent that change
and those next to a rounding midpoint) sit far inside their payload cast bucket, so
``unchanged`` clears them with a few multiplications and compares, and only the rest go
through ``_verdict``. It never clears an element that ``_verdict`` would report: it
proves that both ``fl(e - g)`` and ``fl(e + g)`` of ``_verdict`` lie strictly inside the
open interval ``(L, H)`` between the rounding midpoints around ``|p|`` (mirrored for a
negative ``p``), where the cast is ``cast(p)``.

Proof. In magnitude coordinates (``x`` times the sign of ``p``) the pre-step estimate is
``|e| = (|p| + sigma |u|) ic`` rounded, with ``sigma = +1`` when ``m`` (so ``u``) has
the sign of ``p`` and ``-1`` otherwise, ``ic = 1 / c`` in ``[1, 2]`` (``c >= 0.5``). With
unit roundoff ``2**-24``, ``_verdict``'s roundings (``e = fl(fl(p + u) * ic)``, the
guard's four or five, the bounds' one) and its guard ``g`` give, with ``PHI = 1 +
2**-16`` covering products of ``(1 + 2**-24)`` factors:

* towards the move (outwards for ``sigma = +1``, inwards otherwise) ``fl(e -+ g)`` lies
  within ``alpha |u| + beta |p| + gamma`` of ``p``; on the other side within
  ``alpha_g |u| + beta |p| + gamma``, where
* ``alpha = PHI ic + alpha_g``, ``alpha_g = PHI (ic 2**-20 + relative + bias)``,
  ``beta = PHI (ic (1 + 2**-20) - 1 + relative)`` (the decay moves outwards: counted on
  both sides),
* ``gamma = PHI (floor + mu0) + (s + 8) 2**-146``, where ``mu0 = underflow * 2**-75 / eps``
  bounds the guard's ``mu`` (``d >= eps``; ``eps == 0``: ``mu0 = inf``, nothing is
  cleared) and the last term the subnormal roundings (``s``: the step size).

Then ``|u| <= s |m| / d (1 + 2**-24)**2``, and ``d >= eps`` when ``v >= 0`` (test A),
``d >= sqrt(v) k (1 - 2**-24)**2`` when ``v`` is positive (test B; ``sqrt(v) >=
2**-74.5`` and ``k >= 1`` keep the products normal). With ``S_up = H - |p|`` and
``S_down = |p| - L`` (exact: Sterbenz) and ``Sb = S - beta |p| - gamma`` on each side,
the element is cleared if ``alpha |u| < Sb_move`` and ``alpha_g |u| < Sb_other``, which
the kernel checks without a division: ``t = fma(|p|, beta', gamma')`` with ``beta' >=
beta (1 + 2**-20)``, ``gamma' >= max(2 gamma, 2**-126)`` is ``>= beta |p| + gamma``;
``Sb' = fl(S - t)`` is then at most ``Sb (1 + 2**-24)`` (exact when subnormal), and
``Sb_move' > 2**-60`` keeps it normal;
A: ``fma(|m|, scale_eps, 2**-126) < Sb_move'`` with ``scale_eps >= PHI s alpha / eps``;
B: ``fma(q, q, 2**-126) < fl(fl(Sb_move' Sb_move') v)`` with ``q = fl(|m| scale_root)``,
``scale_root >= PHI s alpha / k``, where the ``2**-126`` keeps both sides normal so every
rounding is relative, and an overflow of the right side to ``inf`` means a true value
above every finite left side; each margin (``PHI`` over the ``(1 + 2**-22)`` of ``|u|``
and the ``(1 + 2**-24)`` factors of the comparisons) is left over, so that ``alpha |u|
< Sb_move (1 - 2**-21)``; then ``fl(rho' Sb_move') < Sb_other'`` with ``rho' >=
(1 + 2**-20) alpha_g / alpha`` gives ``alpha_g |u| < Sb_other``. NaN anywhere fails a
comparison; ``|p| < LIMIT`` (finite, and for fp16 away from its overflow) and a non-zero
``cast(|p|)`` (``_zero_outward`` never keeps a zero bucket) are required as well. The
scalars are formed in float64 from the fp32 scalars the kernel uses and rounded up to
fp32.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

PHI = 1 + 2.0**-16
_FP32_MAX = torch.finfo(torch.float32).max
_TINY: tl.constexpr = tl.constexpr(2.0**-126)
_SLACK_FLOOR: tl.constexpr = tl.constexpr(2.0**-60)


def _up(value: float) -> float:
    """A non-negative ``value`` rounded up to fp32 (``inf`` past its range)."""
    if value > _FP32_MAX:
        return math.inf
    (rounded,) = struct.unpack("<f", struct.pack("<f", value))  # to nearest
    if rounded < value:  # one fp32 step up: the next bit pattern of a non-negative float
        (bits,) = struct.unpack("<I", struct.pack("<f", rounded))
        (rounded,) = struct.unpack("<f", struct.pack("<I", bits + 1))
    return rounded


def screen_scalars(inv_sqrt_bc2: float, eps: float, step_size: float, inv_decay: float,
                   relative: float, bias: float, floor: float, underflow: float,
                   half_eta: float) -> tuple[float, float, float, float, float]:
    """``(beta', gamma', rho', scale_eps, scale_root)`` of ``unchanged`` from the fp32
    scalars of ``inversion_kernel._verdict`` (in its argument order)."""
    aside = PHI * (inv_decay * 2.0**-20 + relative + bias)
    alpha = PHI * inv_decay + aside
    beta = PHI * (inv_decay * (1 + 2.0**-20) - 1 + relative)
    mu0 = PHI * underflow * half_eta / eps if eps > 0 else math.inf
    gamma = PHI * (floor + mu0) + (step_size + 8) * 2.0**-146
    scale_eps = PHI * step_size * alpha / eps if eps > 0 else math.inf
    scale_root = PHI * step_size * alpha / inv_sqrt_bc2
    return (_up(beta * (1 + 2.0**-20)), _up(max(2 * gamma, 2.0**-126)),
            _up(aside / alpha * (1 + 2.0**-20)), _up(scale_eps), _up(scale_root))


@triton.jit
def _bucket(ap, PAYLOAD: tl.constexpr):
    """The rounding midpoints ``L < H`` around ``ap >= 0`` in the payload's cast, and
    whether its cast is non-zero (bf16: the fp32 patterns half a bf16 step either side;
    fp16: the exact fp32 means of neighbouring fp16 values)."""
    half = ap.to(PAYLOAD).to(tl.int16, bitcast=True).to(tl.int32)
    if PAYLOAD == tl.bfloat16:
        center = half << 16
        low = (center - 0x8000).to(tl.float32, bitcast=True)
        high = (center + 0x8000).to(tl.float32, bitcast=True)
    else:
        value = half.to(tl.int16).to(PAYLOAD, bitcast=True).to(tl.float32)
        below = (half - 1).to(tl.int16).to(PAYLOAD, bitcast=True).to(tl.float32)
        above = (half + 1).to(tl.int16).to(PAYLOAD, bitcast=True).to(tl.float32)
        low = (below + value) * 0.5
        high = (value + above) * 0.5
    return low, high, half != 0


@triton.jit
def unchanged(p, m, v, beta, gamma, rho, scale_eps, scale_root, PAYLOAD: tl.constexpr):
    """Elements that ``_verdict`` certainly finds unchanged (see the module docstring)."""
    ap = tl.abs(p)
    if PAYLOAD == tl.bfloat16:
        within = ap < 2.0**32
    else:
        within = ap < 2.0**15
    low, high, nonzero = _bucket(ap, PAYLOAD)
    taken = tl.fma(ap, beta, gamma)
    up = (high - ap) - taken
    down = (ap - low) - taken
    outwards = (p.to(tl.int32, bitcast=True) ^ m.to(tl.int32, bitcast=True)) >= 0
    move = tl.where(outwards, up, down)
    other = tl.where(outwards, down, up)
    am = tl.abs(m)
    by_eps = (tl.fma(am, scale_eps, _TINY) < move) & (v >= 0)
    root = am * scale_root
    by_root = tl.fma(root, root, _TINY) < move * move * v
    return (within & nonzero & (move > _SLACK_FLOOR) & (rho * move < other)
            & (by_eps | by_root))
