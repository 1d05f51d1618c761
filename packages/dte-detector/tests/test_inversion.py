"""invert_adamw: soundness against the snapshot reference under real torch AdamW steps."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from detector_cases import (AdamWCase, adamw_cases, bits_of, midpoint_cases, midpoints,
                            run_case, width)
from dte_codec.bits import order_keys
from hypothesis import example, given
from hypothesis import strategies as st

from dte_detector import (AdamWStep, ChangeSet, Inversion, diff, invert_adamw, invert_adamw_all,
                          torch_adamw_states)
from dte_detector.changes import int_bits, unknown_bounds
from dte_detector.errors import PrecisionError, StepGapError
from dte_detector.inversion import CHUNK, GUARD_ULPS, fp32, reciprocal


def _invert(stepped, dtype: torch.dtype, **kwargs) -> ChangeSet:
    (state,) = torch_adamw_states(stepped.optimizer)
    return invert_adamw("w", state.param, state.exp_avg, state.exp_avg_sq, state.hyper,
                        previous_step=state.hyper.step - 1, dtype=dtype, **kwargs)


def _missed(reference: ChangeSet, found: ChangeSet) -> torch.Tensor:
    return reference.indices[~torch.isin(reference.indices, found.indices)]


def _keys(values: torch.Tensor) -> torch.Tensor:
    return order_keys(int_bits(values), width(values.dtype))


def _outside_bounds(stepped, found: ChangeSet) -> list[tuple]:
    """Reported elements whose old payload value is not within [base_low, base_high]:
    (index, old, low, high, fp32 master after the step) for each."""
    old = stepped.old.reshape(-1)[found.indices.long()]
    bad = (_keys(old) < _keys(found.base_low)) | (_keys(found.base_high) < _keys(old))
    rows = torch.nonzero(bad).view(-1).tolist()
    master = stepped.param.detach().reshape(-1)
    return [(found.indices[i].item(), old[i].item(), found.base_low[i].item(),
             found.base_high[i].item(), master[found.indices[i]].item()) for i in rows]


# The minus-zero miss fixed in inversion.py: with beta1 = 0, a negative first moment and a
# -0 gradient, torch's lerp leaves exp_avg == -0; the step then adds +0 to a -0 master,
# which becomes +0 (a bit change) although m == 0.
_SIGNED_ZERO = AdamWCase(
    master=torch.tensor([-0.0, -0.0, 0.0]),
    grads=(torch.tensor([-1.0, 1.0, -1.0]), torch.tensor([-0.0, -0.0, -0.0])),
    lr=1e-3, weight_decay=0.0, betas=(0.0, 0.999), eps=1e-8, impl={"foreach": False},
    dtype=torch.bfloat16)


def _tiny_update_case(impl: dict) -> AdamWCase:
    """The underflow fixed in inversion.py: tiny masters on bf16 midpoints and gradients
    of 1e-33, so that torch's ``-step_size * m`` underflows into fp32 subnormals before
    the division by ``d ~ eps``, which amplifies its rounding error beyond the relative
    guard band (without the underflow term: 1 miss and 1178 old values out of bounds)."""
    gen = torch.Generator().manual_seed(0)
    return AdamWCase(
        master=midpoints(torch.randn(4096, generator=gen) * 1e-32, torch.bfloat16),
        grads=(torch.randn(4096, generator=gen) * 1e-33,), lr=1e-7, weight_decay=0.0,
        betas=(0.0, 0.9), eps=1e-8, impl=impl, dtype=torch.bfloat16)


@given(case=adamw_cases())
@example(case=_tiny_update_case({"foreach": False}))
@example(case=attrs.evolve(_tiny_update_case({"foreach": True}), master=torch.zeros(4096),
                           dtype=torch.float32))
@example(case=_SIGNED_ZERO)
@example(case=attrs.evolve(_SIGNED_ZERO, weight_decay=0.1, impl={"fused": True}))
@example(case=attrs.evolve(_SIGNED_ZERO, dtype=torch.float16, impl={"foreach": True}))
def test_inversion_never_misses_and_bounds_the_old_value(case):
    """The change set covers the snapshot diff and brackets each reported old value.

    Real torch AdamW (for-loop, foreach, fused) on boundary-stressing fp32 masters, for
    bf16, fp16 and fp32 payloads: every element whose payload bits changed is reported,
    and for every reported element base_low <= old <= base_high in total bit order.
    """
    stepped = run_case(case)
    reference = diff(stepped.old, stepped.new)
    found = _invert(stepped, case.dtype)
    assert [] == _missed(reference, found).tolist()
    assert found.indices.tolist() == sorted(set(found.indices.tolist()))
    assert torch.int32 == found.indices.dtype
    assert [] == _outside_bounds(stepped, found)


@given(case=midpoint_cases())
def test_inversion_never_misses_next_to_rounding_midpoints(case):
    """Every master on or next to a bf16/fp16 rounding midpoint, where the fp32 round-off
    of the reconstruction decides the cast: still no change is missed and every reported
    old value lies within its bounds."""
    stepped = run_case(case)
    reference = diff(stepped.old, stepped.new)
    found = _invert(stepped, case.dtype)
    assert [] == _missed(reference, found).tolist()
    assert [] == _outside_bounds(stepped, found)


def _midpoint_masters(count: int, seed: int) -> torch.Tensor:
    """fp32 masters exactly at, and 1-2 fp32 ulps on either side of, bf16 rounding midpoints
    (a bf16 pattern shifted into fp32 with bit 15 set) of ~N(0, 0.02) weights."""
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(count, generator=gen) * 0.02).view(torch.int32)
    mids = (weights & ~0xFFFF) | 0x8000
    offsets = torch.arange(-2, 3, dtype=torch.int32)
    return (mids.unsqueeze(1) + offsets).view(torch.float32).reshape(-1)


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_unguarded_inversion_misses_changes_that_the_guard_catches(impl):
    """Acceptance: without the guard band the fp32 round-off of the reconstruction puts
    some pre-step masters that sat on a bf16 rounding midpoint on the wrong side of it,
    and those changes are missed; the default guard misses none.

    The step (lr 3e-5, weight decay 0.1, beta1 0, so each element moves by about lr and
    the decay rescales it by 1 - 3e-6) is a real torch AdamW step; the masters sit at
    and within 2 fp32 ulps of bf16 midpoints, where a one-ulp reconstruction error flips
    the rounding.
    """
    master = _midpoint_masters(1 << 14, seed=0)
    grad = torch.randn(master.shape, generator=torch.Generator().manual_seed(1))
    case = AdamWCase(master=master, grads=(grad,), lr=3e-5, weight_decay=0.1,
                     betas=(0.0, 0.999), eps=1e-8, impl=impl, dtype=torch.bfloat16)
    stepped = run_case(case)
    reference = diff(stepped.old, stepped.new)
    unguarded = _missed(reference, _invert(stepped, torch.bfloat16, guard_ulps=0))
    guarded = _missed(reference, _invert(stepped, torch.bfloat16))
    assert 1 <= unguarded.numel(), "the construction no longer produces a miss"
    assert [] == guarded.tolist()


def _state(master: list[float], exp_avg: list[float], exp_avg_sq: list[float]):
    return (torch.tensor(master), torch.tensor(exp_avg), torch.tensor(exp_avg_sq))


def test_skipped_step_reports_nothing():
    """If the step count did not advance the optimizer skipped the tensor: no change,
    whatever the state says."""
    master, m, v = _state([1.0, 2.0], [1.0, -1.0], [1.0, 1.0])
    hyper = AdamWStep(lr=0.1, step=4)
    changes = invert_adamw("w", master, m, v, hyper, previous_step=4, dtype=torch.bfloat16)
    assert [] == changes.indices.tolist()
    assert (torch.int32, torch.bfloat16) == (changes.indices.dtype, changes.base_low.dtype)


@pytest.mark.parametrize(("previous", "current"), [(3, 5), (5, 3), (0, 2)])
def test_step_gap_raises(previous, current):
    """Anything but exactly one step since the reference raises StepGapError."""
    master, m, v = _state([1.0], [1.0], [1.0])
    with pytest.raises(StepGapError) as info:
        invert_adamw("layers.0.w", master, m, v, AdamWStep(lr=1e-3, step=current),
                     previous_step=previous, dtype=torch.bfloat16)
    assert (f"tensor 'layers.0.w': optimizer step went from {previous} to {current}; "
            "the inversion covers exactly one step, sync this version in full") == str(
                info.value)
    assert ("layers.0.w", previous, current) == (info.value.tensor, info.value.previous,
                                                 info.value.current)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("field", ["master", "exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_non_fp32_state_is_refused(field, dtype):
    """The guard band bounds fp32 round-off: a master or moment in another dtype (AdamW run
    directly on bf16 parameters) raises PrecisionError instead of a change set."""
    state = dict(zip(("master", "exp_avg", "exp_avg_sq"), _state([1.0], [1.0], [1.0])))
    state[field] = state[field].to(dtype)
    with pytest.raises(PrecisionError) as info:
        invert_adamw("w", *state.values(), AdamWStep(lr=1e-3, step=1), previous_step=0,
                     dtype=torch.bfloat16)
    assert (f"tensor 'w': {field} is {dtype}, expected torch.float32; the AdamW inversion's "
            "guard band holds for fp32 masters and moments only (use the cast or snapshot "
            "detector)") == str(info.value)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lr": -1.0, "step": 1}, "'lr' must be >= 0.0: -1.0"),
    ({"lr": 1e-3, "weight_decay": -0.1, "step": 1}, "'weight_decay' must be >= 0.0: -0.1"),
    ({"lr": 1.0, "weight_decay": 0.5, "step": 1},
     "lr * weight_decay must lie in [0, 0.5), got 0.5"),
    ({"lr": 1e-3, "beta1": 1.0, "step": 1}, "'beta1' must be < 1.0: 1.0"),
    ({"lr": 1e-3, "beta2": -0.1, "step": 1}, "'beta2' must be >= 0.0: -0.1"),
    ({"lr": 1e-3, "eps": -1e-8, "step": 1}, "'eps' must be >= 0.0: -1e-08"),
    ({"lr": 1e-3, "step": 0}, "'step' must be > 0: 0"),
])
def test_adamw_step_validates_its_fields(kwargs, message):
    """Out-of-range hyper-parameters raise ValueError naming the field and the value."""
    with pytest.raises(ValueError) as info:
        AdamWStep(**kwargs)
    assert message == str(info.value)


def test_adamw_step_defaults():
    """Defaults are torch's AdamW defaults except lr, which has none, and no decay."""
    hyper = AdamWStep(lr=1e-3, step=1)
    assert (0.0, 0.9, 0.999, 1e-8, True) == (hyper.weight_decay, hyper.beta1, hyper.beta2,
                                             hyper.eps, hyper.bias_correction)


def test_empty_tensor():
    """A tensor with no elements has no changes."""
    empty = torch.zeros(0, 3)
    changes = invert_adamw("w", empty, empty, empty, AdamWStep(lr=1e-3, step=1),
                           previous_step=0, dtype=torch.float16)
    assert (0, torch.float16) == (len(changes), changes.base_low.dtype)


def test_chunks_give_the_same_result(monkeypatch):
    """Processing in chunks offsets each chunk's indices: same result as one chunk."""
    gen = torch.Generator().manual_seed(0)
    stepped = run_case(AdamWCase(
        master=_midpoint_masters(40, seed=2), grads=(torch.randn(200, generator=gen),),
        lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, impl={"foreach": False},
        dtype=torch.bfloat16))
    whole = _invert(stepped, torch.bfloat16)
    assert CHUNK >= 200
    monkeypatch.setattr("dte_detector.inversion.CHUNK", 7)
    chunked = _invert(stepped, torch.bfloat16)
    assert whole.indices.tolist() == chunked.indices.tolist()
    assert bits_of(whole.base_low) == bits_of(chunked.base_low)
    assert bits_of(whole.base_high) == bits_of(chunked.base_high)


def test_zero_first_moment_without_decay_is_exact():
    """m == 0 and no decay: the master did not move, so even a master on a bf16 midpoint
    is not reported; a -0 master with m == 0 is unchanged too."""
    midpoint = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32).item()
    master, m, v = _state([midpoint, -0.0, 1.0], [0.0, -0.0, 0.0], [1.0, 0.0, 0.0])
    changes = invert_adamw("w", master, m, v, AdamWStep(lr=1e-3, step=1), previous_step=0,
                           dtype=torch.bfloat16)
    assert [] == changes.indices.tolist()


def test_positive_zero_with_zero_moment_is_reported_with_both_zeros():
    """+0 after a step with m == 0 may have been -0 before (see the minus-zero example
    above): it is reported with bounds that hold both zeros."""
    master, m, v = _state([0.0], [0.0], [0.0])
    changes = invert_adamw("w", master, m, v, AdamWStep(lr=1e-3, weight_decay=0.1, step=1),
                           previous_step=0, dtype=torch.bfloat16)
    assert [0] == changes.indices.tolist()
    zeros = _keys(torch.tensor([-0.0, 0.0], dtype=torch.bfloat16))
    assert bool(_keys(changes.base_low) <= zeros[0])
    assert bool(zeros[1] <= _keys(changes.base_high))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_values_are_reported_with_unknown_bounds(dtype):
    """A NaN or infinite master, or an infinite update, is reported with bounds that admit
    any old value."""
    master, m, v = _state([float("nan"), float("inf"), 1.0, 1.0],
                          [1.0, 1.0, float("inf"), 0.0], [1.0, 1.0, 1.0, 1.0])
    changes = invert_adamw("w", master, m, v, AdamWStep(lr=1e-3, step=1), previous_step=0,
                           dtype=dtype)
    assert [0, 1, 2] == changes.indices.tolist()
    low, high = unknown_bounds(dtype, 3, torch.device("cpu"))
    assert bits_of(low) == bits_of(changes.base_low)
    assert bits_of(high) == bits_of(changes.base_high)


def test_fp32_payloads_report_every_moving_element():
    """An fp32 payload's cast bucket is one value, so any element whose master may have
    moved is reported; its bounds still contain the old value."""
    gen = torch.Generator().manual_seed(3)
    stepped = run_case(AdamWCase(
        master=torch.randn(64, generator=gen) * 0.02, grads=(torch.randn(64, generator=gen),),
        lr=3e-6, weight_decay=0.003, betas=(0.9, 0.999), eps=1e-8, impl={"foreach": True},
        dtype=torch.float32))
    changes = _invert(stepped, torch.float32)
    assert list(range(64)) == changes.indices.tolist()
    assert bool((_keys(changes.base_low) <= _keys(stepped.old)).all())
    assert bool((_keys(stepped.old) <= _keys(changes.base_high)).all())


def test_default_guard_is_at_least_the_derived_bound():
    """The default guard width covers the 12 unit roundoffs derived in the docstring."""
    assert 12 <= GUARD_ULPS
    assert math.isclose(16.0, GUARD_ULPS)


def _inversion(name: str, values: list[float], *, step: int = 3, previous: int = 2,
               dtype: torch.dtype = torch.bfloat16) -> Inversion:
    master, m, v = _state(values, [1e-2] * len(values), [1e-4] * len(values))
    return Inversion(name=name, master=master, exp_avg=m, exp_avg_sq=v,
                     hyper=AdamWStep(lr=1e-2, weight_decay=0.1, step=step),
                     previous_step=previous, dtype=dtype)


def test_inverting_all_is_inverting_each():
    """``invert_adamw_all`` gives each tensor's ``invert_adamw`` result, in order: mixed
    payload dtypes, a skipped tensor and an empty one included."""
    inversions = [_inversion("a", [0.5, -1.0, 3.0]),
                  _inversion("b", [1.0, 2.0], dtype=torch.float16),
                  _inversion("c", [1.0, 2.0], step=2),
                  _inversion("d", [], dtype=torch.float32)]
    expected = [invert_adamw(i.name, i.master, i.exp_avg, i.exp_avg_sq, i.hyper,
                             previous_step=i.previous_step, dtype=i.dtype) for i in inversions]
    actual = invert_adamw_all(inversions)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert e.indices.tolist() == a.indices.tolist()
        assert bits_of(e.base_low) == bits_of(a.base_low)
        assert bits_of(e.base_high) == bits_of(a.base_high)
    assert [1, 2, 0, 0] == [len(a) for a in actual]


@pytest.mark.parametrize("bad", ["precision", "gap"])
def test_inverting_all_checks_every_tensor_first(monkeypatch, bad):
    """A bad tensor anywhere in the list raises its error naming it before any tensor is
    inverted."""
    from dte_detector import inversion

    inverted = []
    monkeypatch.setattr(inversion, "_invert_reference",
                        lambda *args: inverted.append(args) or ChangeSet.empty(args[0]))
    last = _inversion("layers.9.w", [1.0], step=4 if bad == "gap" else 3)
    if bad == "precision":
        last = attrs.evolve(last, exp_avg=last.exp_avg.double())
    error = StepGapError if bad == "gap" else PrecisionError
    with pytest.raises(error) as info:
        invert_adamw_all([_inversion("a", [1.0]), last])
    assert "layers.9.w" == info.value.tensor
    assert [] == inverted


_SCALARS = (1.0, 0.999, 1 - 3e-6 * 0.003, 1 + 2.0**-24, 1 + 3 * 2.0**-25, 2.0**-149,
            2.0**-150, 3 * 2.0**-151, 1e-45, 1e-40, 3.4028235677973366e38, 3.5e38, 1e300, -0.0,
            -1e-8, math.inf, -math.inf, math.nan)
"""Ties to even, subnormals, the edge of fp32's range and beyond, signed zero, NaN."""


def _fp32_bits(value: float | torch.Tensor) -> int:
    return torch.as_tensor(value, dtype=torch.float32).view(torch.int32).item()


@given(st.floats(width=64))
@example(value=0.1)
def test_fp32_scalars_are_torchs(value):
    """``fp32`` and ``reciprocal`` (the kernels' scalars, formed without tensor ops) give
    torch's own fp32 cast and fp32 division, bit for bit."""
    for x in (value, *_SCALARS) if value == 0.1 else (value,):
        cast = torch.tensor(x, dtype=torch.float64).to(torch.float32)
        quotient = torch.ones((), dtype=torch.float32) / torch.tensor(x, dtype=torch.float32)
        assert _fp32_bits(fp32(x)) == _fp32_bits(cast), x
        assert _fp32_bits(reciprocal(x)) == _fp32_bits(quotient), x
