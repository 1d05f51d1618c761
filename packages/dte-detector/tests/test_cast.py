"""CastDetector: exact dirty bits at the fp32 -> low-precision cast, over several steps."""

from __future__ import annotations

import pytest
import torch
from detector_cases import adamw_cases, bits_of, record_all, run_case
from hypothesis import given
from hypothesis import strategies as st

from dte_detector import CastDetector, ChangeSet, diff
from dte_detector.changes import int_bits


def _sync_step(detector: CastDetector, name: str, master: torch.Tensor,
               model: torch.Tensor) -> None:
    """What the trainer does each step: record right before the copy."""
    detector.record(name, master, model)
    model.copy_(master)


def _assert_same(expected: ChangeSet, actual: ChangeSet) -> None:
    assert expected.indices.tolist() == actual.indices.tolist()
    assert expected.indices.dtype == actual.indices.dtype
    assert bits_of(expected.base_low) == bits_of(actual.base_low)
    assert bits_of(expected.base_high) == bits_of(actual.base_high)


def test_one_step_equals_the_snapshot_diff():
    """After one step the change set is diff(old model, new model), with exact bases."""
    model = torch.tensor([1.0, 2.0, -0.0, 0.0, 5.0], dtype=torch.bfloat16)
    old = model.clone()
    master = torch.tensor([1.0 + 2**-10, 2.03125, 0.0, 0.0, float("nan")])
    detector = CastDetector()
    _sync_step(detector, "w", master, model)
    changes = detector.changes("w", model)
    _assert_same(diff(old, model), changes)
    assert [1, 2, 4] == changes.indices.tolist()
    assert [2.0, -0.0, 5.0] == changes.base_low.tolist()


def test_steps_accumulate_until_clear():
    """Over several steps the change set is the diff against the model at the last
    clear, and each base is the value the element had then."""
    model = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    at_clear = model.clone()
    detector = CastDetector()
    _sync_step(detector, "w", torch.tensor([1.0, 2.5, 3.0, 4.0]), model)
    _sync_step(detector, "w", torch.tensor([1.0, 2.75, 3.0, 4.5]), model)
    _sync_step(detector, "w", torch.tensor([1.5, 2.75, 3.0, 4.5]), model)
    changes = detector.changes("w", model)
    _assert_same(diff(at_clear, model), changes)
    assert [1.0, 2.0, 4.0] == changes.base_low.tolist()


def test_a_value_that_returns_is_reported_with_its_old_base():
    """An element that changes and then changes back is over-reported, with the right base
    (the receiver still holds it, so sending it again is harmless)."""
    model = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    detector = CastDetector()
    _sync_step(detector, "w", torch.tensor([1.5, 2.0]), model)
    _sync_step(detector, "w", torch.tensor([1.0, 2.0]), model)
    changes = detector.changes("w", model)
    assert [0] == changes.indices.tolist()
    assert [1.0] == changes.base_low.tolist()
    assert [] == diff(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), model).indices.tolist()


def test_clear_starts_a_new_interval():
    """After clear() only changes recorded later count, against the model at the clear."""
    model = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    detector = CastDetector()
    _sync_step(detector, "w", torch.tensor([1.5, 2.0, 3.0]), model)
    detector.clear()
    assert [] == detector.changes("w", model).indices.tolist()
    at_clear = model.clone()
    _sync_step(detector, "w", torch.tensor([1.5, 2.5, 3.0]), model)
    changes = detector.changes("w", model)
    _assert_same(diff(at_clear, model), changes)
    assert [2.0] == changes.base_low.tolist()


def test_tensors_are_tracked_separately():
    """Dirty bits of one name never leak into another; an unknown name has no changes."""
    a = torch.zeros(3, dtype=torch.bfloat16)
    b = torch.zeros(3, dtype=torch.bfloat16)
    detector = CastDetector()
    _sync_step(detector, "a", torch.tensor([0.0, 1.0, 0.0]), a)
    _sync_step(detector, "b", torch.tensor([0.0, 0.0, 0.0]), b)
    assert [1] == detector.changes("a", a).indices.tolist()
    assert [] == detector.changes("b", b).indices.tolist()
    empty = detector.changes("never", b)
    assert (0, torch.int32, torch.bfloat16) == (len(empty), empty.indices.dtype,
                                                empty.base_low.dtype)


def test_nan_payloads_and_signed_zeros_are_changes():
    """A model NaN under a non-NaN master flips, as does -0 under +0, and NaN over NaN is
    reported whatever the payloads (the copy's NaN pattern depends on the layout)."""
    cast_nan = torch.tensor([float("nan")]).to(torch.bfloat16)
    other_nan = (int_bits(cast_nan) ^ 1).view(torch.bfloat16)
    model = torch.cat([other_nan, torch.tensor([-0.0, 1.0], dtype=torch.bfloat16), cast_nan])
    old = model.clone()
    detector = CastDetector()
    _sync_step(detector, "w", torch.tensor([float("nan"), 0.0, float("nan"), float("nan")]),
               model)
    changes = detector.changes("w", model)
    assert [0, 1, 2, 3] == changes.indices.tolist()
    assert bits_of(old) == bits_of(changes.base_low)
    assert [0, 1, 2] == diff(old, model).indices.tolist()  # 3: the same NaN bits again


@pytest.mark.parametrize("layout", ["strided", "0-d"])
def test_nan_over_nan_in_any_layout_is_not_missed(layout):
    """Pins a miss fixed in cast.py: torch's vectorised bf16 cast writes NaN as 0xFFFF,
    its scalar and strided loops as 0x7FC0. A strided (or 0-d) model holding 0xFFFF under
    a NaN master was predicted unchanged from the contiguous cast, and the copy then
    wrote 0x7FC0."""
    model = (torch.zeros(4, 2, dtype=torch.bfloat16)[:, 0] if layout == "strided"
             else torch.zeros((), dtype=torch.bfloat16))
    model.view(torch.int16).fill_(-1)
    old = model.clone()
    detector = CastDetector()
    _sync_step(detector, "w", torch.full(model.shape, float("nan")), model)
    changes = detector.changes("w", model)
    missed = diff(old, model).indices[~torch.isin(diff(old, model).indices, changes.indices)]
    assert [] == missed.tolist()
    assert bits_of(old) == bits_of(changes.base_low)


def _reported_by_rule(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The documented rule for one copy: the bits changed, or NaN was written over NaN."""
    before, after = before.reshape(-1), after.reshape(-1)
    return (int_bits(before) != int_bits(after)) | (torch.isnan(before) & torch.isnan(after))


def _assert_accumulated(models: list[torch.Tensor], actual: ChangeSet) -> None:
    """Exact over the copies since the clear (``models`` before and after each): every
    element that the rule reports in some copy (the snapshot diff of the whole interval,
    plus elements that came back, plus NaN over NaN), each with its value at the clear
    as the exact base; in particular no element of the snapshot diff is missed."""
    dirty = torch.zeros(models[0].numel(), dtype=torch.bool)
    for before, after in zip(models, models[1:]):
        dirty |= _reported_by_rule(before, after)
    expected = torch.nonzero(dirty).view(-1)
    assert expected.tolist() == actual.indices.tolist()
    reference = diff(models[0], models[-1]).indices
    assert [] == reference[~torch.isin(reference, actual.indices)].tolist()
    assert bits_of(models[0].reshape(-1)[expected]) == bits_of(actual.base_low)
    assert bits_of(models[0].reshape(-1)[expected]) == bits_of(actual.base_high)


@pytest.mark.parametrize("shape", [(), (0,), (13,), (3, 5, 7)])
def test_shapes_that_do_not_fill_a_byte(shape):
    """0-d, empty and odd-sized tensors pack their dirty bits correctly."""
    gen = torch.Generator().manual_seed(0)
    model = torch.randn(shape, generator=gen).to(torch.bfloat16)
    models = [model.clone()]
    detector = CastDetector()
    for _ in range(3):
        _sync_step(detector, "w", model.float() + torch.randn(shape, generator=gen) / 64, model)
        models.append(model.clone())
    _assert_accumulated(models, detector.changes("w", model))


@given(case=adamw_cases())
def test_cast_detector_equals_the_snapshot_after_one_adamw_step(case):
    """Driven by real torch AdamW on boundary-stressing masters, for bf16, fp16 and fp32
    payloads: the change set of the checked step equals the snapshot diff exactly (plus
    NaN over NaN, reported by rule), with exact bases."""
    stepped = run_case(case)
    model = stepped.old.clone()
    detector = CastDetector()
    _sync_step(detector, "w", stepped.param.detach(), model)
    changes = detector.changes("w", model)
    _assert_accumulated([stepped.old, model], changes)
    if not bool(torch.isnan(stepped.old).any()):
        _assert_same(diff(stepped.old, model), changes)


@given(case=adamw_cases(), clear_after=st.integers(0, 3))
def test_cast_detector_accumulates_over_adamw_steps(case, clear_after):
    """Over every step of the trajectory, with a clear somewhere: the change set is the
    union of the per-step snapshot diffs since the clear, with the values at the clear as
    exact bases."""
    param = torch.nn.Parameter(case.master.clone())
    optimizer = case.optimizer(param)
    model = param.detach().to(case.dtype).clone()
    detector = CastDetector()
    models = [model.clone()]
    for step, grad in enumerate(case.grads):
        if step == clear_after:
            detector.clear()
            models = [model.clone()]
        param.grad = grad.clone()
        optimizer.step()
        _sync_step(detector, "w", param.detach(), model)
        models.append(model.clone())
    if clear_after >= len(case.grads):
        detector.clear()
        models = [model.clone()]
    _assert_accumulated(models, detector.changes("w", model))


@pytest.mark.parametrize("copy", [True, False])
def test_recording_all_is_recording_each(copy):
    """``record_and_copy_all`` (or ``record_all``) over several tensors gives each the
    dirty map, change set and model bits of ``record_and_copy`` (``record``) tensor by
    tensor, over two steps; a mapping of masters in fp32 and models in bf16, fp16, fp32."""
    gen = torch.Generator().manual_seed(4)
    dtypes = {"a": torch.bfloat16, "b": torch.float16, "c": torch.float32, "d": torch.bfloat16}
    sizes = {"a": 1000, "b": 17, "c": 9, "d": 0}
    masters = [{n: torch.randn(size, generator=gen) * 0.02 for n, size in sizes.items()}]
    masters.append({n: m + torch.randn(m.shape, generator=gen) * 1e-3 for n, m in
                    masters[0].items()})

    def models() -> dict[str, torch.Tensor]:
        return {n: torch.zeros(size, dtype=dtypes[n]) for n, size in sizes.items()}

    each, each_models = CastDetector(), models()
    every, every_models = CastDetector(), models()
    for step in masters:
        for name, master in step.items():
            if copy:
                each.record_and_copy(name, master, each_models[name])
            else:
                _sync_step(each, name, master, each_models[name])
        record_all(every, {name: (master, every_models[name]) for name, master in step.items()},
                   copy=copy)
    for name in sizes:
        assert bits_of(each_models[name]) == bits_of(every_models[name])
        _assert_same(each.changes(name, each_models[name]), every.changes(name, every_models[name]))
    assert 1000 == len(every.changes("a", every_models["a"]))
