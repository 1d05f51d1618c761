"""Changed elements of a low-precision model copy, recovered by inverting one AdamW step.

After a decoupled AdamW step the optimizer holds the new fp32 master ``p`` and the
moments ``m``, ``v`` that produced it. The update is recomputed from them,
``u = lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``, and the pre-step master is
estimated as ``e = (p + u) / c`` with ``c = 1 - lr * wd``. The model copy changed iff
``cast(p0) != cast(p)`` for the payload dtype's round-to-nearest-even cast.

Soundness (no change ever missed). ``e`` is not ``p0``: both the optimizer's forward
arithmetic and ours round. With ``eps32 = 2**-24`` (fp32 unit roundoff), ``eta = 2**-150``
(the absolute error of one rounding into fp32 subnormals) and ``A = |p| + |u|``:

* the forward rounds ``p1 = p0 * c`` (or ``p0 - lr*wd*p0`` in fused kernels, and ``c``
  itself may be rounded to fp32): relative error <= 2 eps32 of ``|p1| <= A``;
* the forward rounds ``p = p1 - u'`` once (addcdiv, FMA or not): <= eps32 |p| + eta;
* the forward's ``u'`` and our ``u`` come from the same ``m``, ``v`` and scalars through
  at most six rounded operations in possibly different orders (torch's for-loop,
  foreach and fused kernels differ here): ``|u' - u| <= 6 eps32 |u|``; and the bias
  corrections ``1 - beta**t`` may be computed from fp32-rounded betas with an fp32
  ``pow`` (torch's fused CUDA kernel: seen on an H200 as a 1e-5 relative error of ``u``
  at ``beta2 = 0.999``), off by up to ``rho = (t + 2) eps32 beta**t / (1 - beta**t)``
  relatively, so ``|u' - u|`` gains ``kappa |u|`` with ``kappa = rho1 + rho2 / 2``;
* an intermediate of ``u'`` that underflows into fp32 subnormals (torch's CPU addcdiv
  forms ``(-step_size * m) / d``; other kernels ``m / bc1`` or ``lr * m`` first) has an
  absolute error of eta that the later divisions by ``d = sqrt(v) / sqrt(bc2) + eps``
  and ``bc1`` amplify: ``|u' - u|`` gains ``mu = eta / (bc1 d)`` (seen with gradients
  of 1e-33, lr 1e-7, eps 1e-8: a 5e-6 relative error of ``u``; an underflow after the
  last division is within the eta terms);
* our ``p + u`` and ``/ c`` round once each: <= 2 eps32 A / c, plus eta each.

Summing, ``|p0 - e| <= (11 eps32 A + 3 eta + kappa |u| + mu) / c``; the bounds ``e -+ g``
are themselves rounded once more (one eps32). On CUDA, torch divides a tensor by a Python
scalar as a multiplication by the scalar's fp32 reciprocal (``BinaryDivTrueKernel.cu``),
which adds one rounding to ``d`` (so to ``u``) and one to ``e``: 13 eps32 A there, 14 with
the bounds' rounding; the fused kernels (``inversion_kernel.py``) do the same arithmetic.
The default guard ``g = (16 (eps32 A + eta + mu) + 2 kappa |u|) / c`` covers this with
margin. If both ``cast(e - g)`` and ``cast(e + g)`` equal ``cast(p)`` bit for bit then, the
cast being monotone, so does ``cast(p0)``: unchanged. Everything else is reported, so
over-reporting is about ``2 g`` over the width of a cast bucket (1.8e-4 of the elements
for bf16 payloads of ~N(0, 0.02) weights at lr 3e-6 and 1e-5, measured by
``tools/bench_detectors.py``; all elements with a non-zero update for fp32 payloads,
whose bucket is a single value).

Exact cases. ``m == 0`` gives ``u' == +-0`` in every implementation, so with ``c == 1``
and ``p != 0`` the master did not move: unchanged. A zero ``p`` is ``-0`` only if ``p0``
was ``-0`` (a rounded sum or difference is ``-0`` only when both terms are), so
``p == -0`` with ``m == 0`` is unchanged too; ``p == +0`` may come from ``p0 == -0``
(``m == -0`` flips the zero's sign through ``u' == +0``) and goes through the guard band,
which reports it. Any non-finite ``p`` or ``u`` is reported with unknown bounds.

Assumptions: fp32 masters and moments (others raise ``PrecisionError``); IEEE fp32
arithmetic with round-to-nearest and no flush-to-zero in the optimizer (whoever runs the
optimizer checks it with ``torch_adamw.flush_to_zero``); exactly one step between the
reference and now (``previous_step + 1``); decoupled weight decay (``torch.optim.AdamW``, or
``Adam`` with ``decoupled_weight_decay=True``); no AMSGrad; the lr, betas, eps and weight decay that
the step used. The test suite checks the bound adversarially (values placed at and next
to rounding boundaries) against torch's for-loop, foreach and fused AdamW.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import attrs
import torch
from attrs.validators import ge, gt, lt

from .changes import ChangeRun, ChangeSet, index_dtype, int_bits, unknown_bounds

UNIT_ROUNDOFF = 2.0**-24
SUBNORMAL_ROUNDING = 2.0**-150
HALF_ETA = 2.0**-75
GUARD_ULPS = 16.0
"""Default guard width in fp32 unit roundoffs of ``|p| + |u|`` (>= 12 derived above)."""
CHUNK = 1 << 24
"""Elements processed at once, bounding the temporaries to a few hundred MiB."""


def _decay_below_half(instance: AdamWStep, attribute: attrs.Attribute, value: float) -> None:
    if not 0 <= instance.lr * value < 0.5:
        raise ValueError(f"lr * weight_decay must lie in [0, 0.5), got {instance.lr * value}")


@attrs.frozen(kw_only=True)
class AdamWStep:
    """The hyper-parameters one decoupled AdamW step used, and its step count."""

    lr: float = attrs.field(validator=ge(0.0))
    """Learning rate used for that step (before any scheduler moved it)."""
    weight_decay: float = attrs.field(default=0.0, validator=[ge(0.0), _decay_below_half])
    """Decoupled weight decay."""
    beta1: float = attrs.field(default=0.9, validator=[ge(0.0), lt(1.0)])
    """First-moment decay."""
    beta2: float = attrs.field(default=0.999, validator=[ge(0.0), lt(1.0)])
    """Second-moment decay."""
    eps: float = attrs.field(default=1e-8, validator=ge(0.0))
    """Added to the denominator."""
    step: int = attrs.field(validator=gt(0))
    """The optimizer's step count after the step."""
    bias_correction: bool = True
    """Whether the step divided the moments by ``1 - beta**step``."""


@attrs.frozen(kw_only=True, eq=False)
class Inversion:
    """One tensor's arguments of ``invert_adamw``, for ``invert_adamw_all``."""

    name: str
    """The tensor's name, for errors."""
    master: torch.Tensor
    """The fp32 master after the step."""
    exp_avg: torch.Tensor
    """The fp32 first moment after the step."""
    exp_avg_sq: torch.Tensor
    """The fp32 second moment after the step."""
    hyper: AdamWStep
    """The step's hyper-parameters."""
    previous_step: int
    """The step count of the reference (``hyper.step``: skipped, no change)."""
    dtype: torch.dtype
    """The payload dtype (bf16, fp16 or fp32)."""


def invert_adamw(name: str, master: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, hyper: AdamWStep, *, previous_step: int,
                 dtype: torch.dtype, guard_ulps: float = GUARD_ULPS) -> ChangeSet:
    """Elements of ``master.to(dtype)`` that changed in the step ``previous_step -> hyper.step``.

    Args:
        name: the tensor's name, for errors.
        master, exp_avg, exp_avg_sq: the fp32 master and moments after the step.
        hyper: the step's hyper-parameters.
        previous_step: the step count of the reference; equal to ``hyper.step`` means
            the optimizer skipped this tensor (no change).
        dtype: the payload dtype (bf16, fp16 or fp32).
        guard_ulps: guard band width, see the module docstring; 0 disables it (unsound).

    Raises:
        PrecisionError: the master or a moment is not fp32.
        StepGapError: more than one step since the reference.
    """
    one = Inversion(name=name, master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                    hyper=hyper, previous_step=previous_step, dtype=dtype)
    return invert_adamw_all([one], guard_ulps=guard_ulps)[0]


def invert_adamw_all(inversions: Sequence[Inversion], *, guard_ulps: float = GUARD_ULPS
                     ) -> list[ChangeSet]:
    """``invert_adamw`` of many tensors, in their order, with the same results.

    Where the fused kernels run (``dispatch``), the tensors of one device go through them
    together: a few launches over all of them and one host synchronisation per
    ``batch.GROUP_ELEMENTS`` elements, instead of one per tensor. Every argument is
    checked before anything runs.

    Raises:
        PrecisionError: a master or a moment is not fp32.
        StepGapError: more than one step since a tensor's reference.
    """
    return invert_columns([one.name for one in inversions],
                          [(one.master, one.exp_avg, one.exp_avg_sq) for one in inversions],
                          [one.hyper for one in inversions],
                          [one.previous_step for one in inversions],
                          [one.dtype for one in inversions], guard_ulps=guard_ulps)


def invert_columns(names: Sequence[str],
                   states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   hypers: Sequence[AdamWStep], previous: Sequence[int],
                   dtypes: Sequence[torch.dtype], *, guard_ulps: float = GUARD_ULPS
                   ) -> list[ChangeSet]:
    """``invert_adamw_all`` with its arguments as columns (``Inversion``'s fields, the
    master and moments as one ``(master, exp_avg, exp_avg_sq)`` per tensor): a caller
    that inverts every tensor of a model each sync builds no object per tensor (the
    Python in front of the first kernel launch is time the device waits for).

    Raises:
        PrecisionError: a master or a moment is not fp32 (the first such tensor, in order).
        StepGapError: more than one step since a tensor's reference.
    """
    return per_tensor(*invert_runs(names, states, hypers, previous, dtypes,
                                   guard_ulps=guard_ulps))


def per_tensor(found: list[ChangeSet | None], runs: Sequence[ChangeRun]) -> list[ChangeSet]:
    """``invert_runs``' results as one change set per tensor: ``found`` with the runs'
    members' change sets put in at their positions (in place)."""
    for run in runs:
        for k, at in enumerate(run.names):
            found[at] = run.change_set(k)
    return found


def invert_runs(names: Sequence[str],
                states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                hypers: Sequence[AdamWStep], previous: Sequence[int],
                dtypes: Sequence[torch.dtype], *, guard_ulps: float = GUARD_ULPS
                ) -> tuple[list[ChangeSet | None], list[ChangeRun]]:
    """``invert_columns`` as the fused kernels leave it: per tensor its change set, or
    None for the members of the runs (keyed by position), whose change sets are views of
    the runs' buffers. Same checks and errors."""
    from .inverter import Inverter
    return Inverter().runs(names, states, hypers, previous, dtypes, guard_ulps=guard_ulps)


def _invert_reference(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: AdamWStep,
                      dtype: torch.dtype, guard_ulps: float) -> ChangeSet:
    """The torch reference over flat tensors, in chunks of ``CHUNK`` elements."""
    parts = [_invert_chunk(p[s:s + CHUNK], m[s:s + CHUNK], v[s:s + CHUNK], hyper, dtype,
                           guard_ulps) for s in range(0, p.numel(), CHUNK)]
    offsets = range(0, p.numel(), CHUNK)
    indices = torch.cat([part[0] + o for part, o in zip(parts, offsets)])
    return ChangeSet(indices.to(index_dtype(p.numel())), torch.cat([part[1] for part in parts]),
                     torch.cat([part[2] for part in parts]))


def bias_correction_error(h: AdamWStep) -> float:
    """``kappa``: bound on the relative error of ``u`` from how ``1 - beta**t`` was computed."""
    if not h.bias_correction:
        return 0.0

    def rho(beta: float) -> float:
        power = beta**h.step
        return (h.step + 2) * UNIT_ROUNDOFF * power / (1 - power) if power else 0.0

    return rho(h.beta1) + rho(h.beta2) / 2


def decay_factor(h: AdamWStep) -> float:
    """``c = 1 - lr * wd`` rounded to fp32, as the optimizer's kernels hold it."""
    return fp32(1 - h.lr * h.weight_decay)


def fp32(value: float) -> float:
    """A Python scalar as torch's kernels receive it: rounded to fp32 (to nearest even,
    subnormals kept, beyond fp32's range infinite), without a tensor op per scalar."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # struct refuses what torch's cast makes infinite
        return math.copysign(math.inf, value)


def reciprocal(value: float) -> float:
    """``1 / value`` in fp32, as torch's CUDA division by a CPU scalar forms it: the
    quotient of the fp32 operands in double, rounded once more to fp32, is the correctly
    rounded fp32 quotient (double has more than twice fp32's precision plus two bits)."""
    divisor = fp32(value)
    if divisor == 0:
        return math.copysign(math.inf, divisor)
    return fp32(1.0 / divisor)


def bias_corrections(h: AdamWStep) -> tuple[float, float]:
    """``bc1`` and ``bc2``, the bias corrections of the step (1 when switched off)."""
    if not h.bias_correction:
        return 1.0, 1.0
    return 1 - h.beta1**h.step, 1 - h.beta2**h.step


@attrs.frozen
class Estimate:
    """The pre-step master ``previous`` (``e``), the update ``u``, the decay factor ``c``
    and the update's denominator ``d = sqrt(v) / sqrt(bc2) + eps``."""

    previous: torch.Tensor
    update: torch.Tensor
    decay: float
    denominator: torch.Tensor


def estimate_previous(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWStep
                      ) -> Estimate:
    """Recompute the step's update from its post-step state and undo it."""
    bc1, bc2 = bias_corrections(h)
    c = decay_factor(h)
    d = v.sqrt() / math.sqrt(bc2) + h.eps
    u = m / d * (h.lr / bc1)
    return Estimate((p + u) / c, u, c, d)


@attrs.frozen
class GuardScalars:
    """The Python scalars of ``guard_band``, in the order it applies them (the kernels
    apply the same ones, rounded to fp32 as torch rounds a scalar operand)."""

    relative: float
    """Times ``|p| + |u|``."""
    bias: float
    """Times ``|u|``: the bias corrections' error ``kappa``."""
    floor: float
    """Added: the subnormal roundings ``eta``."""
    underflow: float
    """Times ``1 / d``, then times ``HALF_ETA``: ``mu``."""


def guard_scalars(h: AdamWStep, c: float, guard_ulps: float) -> GuardScalars:
    """The guard band's scalars for the step ``h`` with decay factor ``c``."""
    bc1, _ = bias_corrections(h)
    return GuardScalars(relative=guard_ulps * UNIT_ROUNDOFF / c,
                        bias=guard_ulps / GUARD_ULPS * 2 * bias_correction_error(h) / c,
                        floor=guard_ulps * SUBNORMAL_ROUNDING / c,
                        underflow=guard_ulps / c / bc1 * HALF_ETA)


def guard_band(p: torch.Tensor, estimate: Estimate, h: AdamWStep, *,
               guard_ulps: float = GUARD_ULPS) -> torch.Tensor:
    """``g``: the half-width around ``e`` that holds ``p0`` (see the module docstring).

    The last term is ``mu``, an underflow inside the forward's update amplified by its
    divisions; eta = 2**-150 is below fp32's range, so it is applied as two 2**-75.
    """
    u = estimate.update.abs()
    scalars = guard_scalars(h, estimate.decay, guard_ulps)
    guard = (p.abs() + u) * scalars.relative
    guard += u * scalars.bias
    guard += scalars.floor
    mu = estimate.denominator.reciprocal() * scalars.underflow * HALF_ETA
    return guard + mu


def _invert_chunk(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamWStep,
                  dtype: torch.dtype, guard_ulps: float):
    estimate = estimate_previous(p, m, v, h)
    u, c = estimate.update, estimate.decay
    guard = guard_band(p, estimate, h, guard_ulps=guard_ulps)
    low, high = _zero_outward((estimate.previous - guard).to(dtype),
                              (estimate.previous + guard).to(dtype))
    new = int_bits(p.to(dtype))
    same = (int_bits(low) == new) & (int_bits(high) == new)
    still = (p != 0) & (c == 1.0) | (p == 0) & torch.signbit(p)
    exact = (m == 0) & still
    finite = torch.isfinite(p) & torch.isfinite(u)
    changed = ~((same | exact) & finite)
    indices = torch.nonzero(changed).view(-1)
    finite = finite[indices]
    unknown = unknown_bounds(dtype, indices.numel(), p.device)
    low, high = (torch.where(finite, int_bits(b[indices]), int_bits(any_)).view(dtype)
                 for b, any_ in zip((low, high), unknown))
    return indices, low, high


def _zero_outward(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Widen zero bounds to the outer zero: -0 as the low bound, +0 as the high one.

    A real interval touching 0 may hold an old value of either sign of zero, and the two
    zeros are distinct bit patterns.
    """
    return (torch.where(low == 0, torch.full_like(low, -0.0), low),
            torch.where(high == 0, torch.zeros_like(high), high))
