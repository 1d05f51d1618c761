"""A cheap exact pre-test of the inversion kernel: elements it clears are unchanged.

``inversion_kernel._verdict`` reproduces the torch reference op for op, IEEE ``sqrt`` and
``/`` included, for every element. Most elements (all but the few per cent that change
and those next to a rounding midpoint) sit far inside their payload cast bucket, so
``unchanged`` clears them with a few multiplications and compares, and only the rest go
through ``_verdict``. It never clears an element that ``_verdict`` would report: it
proves that both ``fl(e - g)`` and ``fl(e + g)`` of ``_verdict`` lie strictly inside the
open interval ``(L, H)`` between the rounding midpoints around ``|p|`` (mirrored for a
negative ``p``), where the cast is ``cast(p)``.

Proof. With ``A = |p| + |u|`` and unit roundoff ``2**-24``, ``_verdict``'s roundings
(``e = fl(fl(p + u) * ic)``, the guard's four or five, the bounds' one) give
``|fl(e -+ g) - p| <= alpha |u| + beta |p| + gamma`` with

* ``alpha = PHI (ic (1 + 2**-20) + relative + bias)``,
* ``beta = PHI (ic (1 + 2**-20) - 1 + relative)`` (``ic = 1 / c >= 1``),
* ``gamma = PHI (floor + mu0) + (s + 8) 2**-146``, where ``mu0 = underflow * 2**-75 / eps``
  bounds the guard's ``mu`` (``d >= eps``; ``eps == 0``: ``mu0 = inf``, nothing is
  cleared) and the last term the subnormal roundings (``ic <= 2`` as ``c >= 0.5``),

``PHI = 1 + 2**-16`` covering the products of ``(1 + 2**-24)`` factors. Then
``|u| <= s |m| / d (1 + 2**-24)**2`` (``s``: the step size; its absolute rounding terms
are in ``gamma``), and ``d >= eps`` when ``v >= 0`` (test A), ``d >= sqrt(v) k
(1 - 2**-24)**2`` when ``v`` is positive (test B; ``sqrt(v) >= 2**-74.5`` and ``k >= 1``
keep the products normal). So the element is cleared if

    alpha |u| < Sb = S - beta |p| - gamma,    S = min(H - |p|, |p| - L) (exact: Sterbenz),

which the kernel checks without a division: ``t = fma(|p|, beta', gamma')`` with
``beta' >= beta (1 + 2**-20)``, ``gamma' >= max(2 gamma, 2**-126)`` is ``>= beta |p| +
gamma``; ``Sb' = fl(S - t) > 2**-60`` is then at most ``Sb (1 + 2**-24)`` and normal;
A: ``fma(|m|, scale_eps, 2**-126) < Sb'`` with ``scale_eps >= PHI s alpha / eps``;
B: ``fma(q, q, 2**-126) < fl(fl(Sb' Sb') v)`` with ``q = fl(|m| scale_root)``,
``scale_root >= PHI s alpha / k``, where the ``2**-126`` keeps both sides normal so every
rounding is relative, and an overflow of the right side to ``inf`` means a true value
above every finite left side. Each margin (``PHI`` over the ``(1 + 2**-22)`` of ``|u|``
and the ``(1 + 2**-24)`` factors of the comparisons) is left over, so ``alpha |u| < Sb``.
NaN anywhere fails a comparison; ``|p| < LIMIT`` (finite, and for fp16 away from its
overflow) and a non-zero ``cast(|p|)`` (``_zero_outward`` never keeps a zero bucket)
are required as well. The scalars are formed in float64 from the fp32 scalars the kernel
uses and rounded up to fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

PHI = 1 + 2.0**-16
_TINY: tl.constexpr = tl.constexpr(2.0**-126)
_SLACK_FLOOR: tl.constexpr = tl.constexpr(2.0**-60)


def _up(value: float) -> float:
    """``value`` rounded up to fp32 (``inf`` past its range)."""
    rounded = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if rounded.item() < value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf))
    return rounded.item()


def screen_scalars(inv_sqrt_bc2: float, eps: float, step_size: float, inv_decay: float,
                   relative: float, bias: float, floor: float, underflow: float,
                   half_eta: float) -> tuple[float, float, float, float]:
    """``(beta', gamma', scale_eps, scale_root)`` of ``unchanged`` from the fp32 scalars
    of ``inversion_kernel._verdict`` (in its argument order)."""
    alpha = PHI * (inv_decay * (1 + 2.0**-20) + relative + bias)
    beta = PHI * (inv_decay * (1 + 2.0**-20) - 1 + relative)
    mu0 = PHI * underflow * half_eta / eps if eps > 0 else math.inf
    gamma = PHI * (floor + mu0) + (step_size + 8) * 2.0**-146
    scale_eps = PHI * step_size * alpha / eps if eps > 0 else math.inf
    scale_root = PHI * step_size * alpha / inv_sqrt_bc2
    return (_up(beta * (1 + 2.0**-20)), _up(max(2 * gamma, 2.0**-126)), _up(scale_eps),
            _up(scale_root))


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
def unchanged(p, m, v, beta, gamma, scale_eps, scale_root, PAYLOAD: tl.constexpr):
    """Elements that ``_verdict`` certainly finds unchanged (see the module docstring)."""
    ap = tl.abs(p)
    if PAYLOAD == tl.bfloat16:
        within = ap < 2.0**32
    else:
        within = ap < 2.0**15
    low, high, nonzero = _bucket(ap, PAYLOAD)
    slack = tl.minimum(high - ap, ap - low) - tl.fma(ap, beta, gamma)
    am = tl.abs(m)
    by_eps = (tl.fma(am, scale_eps, _TINY) < slack) & (v >= 0)
    root = am * scale_root
    by_root = tl.fma(root, root, _TINY) < slack * slack * v
    return within & nonzero & (slack > _SLACK_FLOOR) & (by_eps | by_root)
