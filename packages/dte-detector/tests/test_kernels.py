"""The fused Triton kernels against the torch reference, bit for bit, on a CUDA device.

Marker ``gpu`` (left out of the default run). Each test runs the same inputs through
``dispatch.reference()`` (torch) and through the kernels, and asserts equal indices and
equal bit patterns; the inversion tests also assert no change is missed against the
snapshot diff.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from detector_cases import (adamw_cases, bits_of, midpoint_cases, midpoints, record_all,
                            run_case)
from hypothesis import given
from hypothesis import strategies as st

from dte_detector import (AdamWStep, CastDetector, ChangeSet, Inversion, diff, invert_adamw,
                          invert_adamw_all)
from dte_detector import torch_adamw_states
from dte_detector.dispatch import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

HALF_DTYPES = (torch.bfloat16, torch.float16)
IMPLS = ({"foreach": False}, {"foreach": True}, {"fused": True})
SETTINGS = ((3e-6, 0.003), (1e-5, 0.1), (1e-3, 0.01), (1e-4, 0.0))
LARGE = (1 << 20) + 12345
"""Several hundred kernel blocks and a ragged last one."""


def _assert_same(expected: ChangeSet, actual: ChangeSet) -> None:
    assert expected.indices.dtype == actual.indices.dtype
    assert expected.indices.tolist() == actual.indices.tolist()
    assert bits_of(expected.base_low) == bits_of(actual.base_low)
    assert bits_of(expected.base_high) == bits_of(actual.base_high)


def _both(stepped, dtype: torch.dtype) -> tuple[ChangeSet, ChangeSet]:
    """(torch reference, kernel) change sets of the case's last step."""
    (state,) = torch_adamw_states(stepped.optimizer)
    args = ("w", state.param, state.exp_avg, state.exp_avg_sq, state.hyper)
    with reference():
        expected = invert_adamw(*args, previous_step=state.hyper.step - 1, dtype=dtype)
    return expected, invert_adamw(*args, previous_step=state.hyper.step - 1, dtype=dtype)


def _assert_kernel_is_reference_and_sound(case) -> None:
    stepped = run_case(case, device="cuda")
    expected, actual = _both(stepped, case.dtype)
    _assert_same(expected, actual)
    truth = diff(stepped.old, stepped.new)
    assert [] == truth.indices[~torch.isin(truth.indices, actual.indices)].tolist()


@given(case=adamw_cases(dtypes=HALF_DTYPES))
def test_inversion_kernel_is_the_reference_on_boundary_cases(case):
    """Boundary masters, NaN/inf/+-0 gradients, random hyper-parameters, every torch AdamW
    implementation: the kernel's change set equals the torch reference's bit for bit
    and misses nothing of the snapshot diff."""
    _assert_kernel_is_reference_and_sound(case)


@given(case=midpoint_cases())
def test_inversion_kernel_is_the_reference_next_to_midpoints(case):
    """Every master on or within 2 fp32 ulps of a rounding midpoint: equal to the
    reference bit for bit, nothing missed."""
    _assert_kernel_is_reference_and_sound(case)


def _large_state(lr: float, weight_decay: float, impl: dict, seed: int):
    """Half N(0, 0.02) masters, half on rounding midpoints, after two real AdamW steps."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    master = torch.randn(LARGE, device="cuda", generator=gen) * 0.02
    master[::2] = midpoints(master[::2].cpu(), torch.bfloat16).cuda()
    param = torch.nn.Parameter(master)
    optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=weight_decay, **impl)
    olds = []
    for _ in range(2):
        olds.append({d: param.detach().to(d) for d in HALF_DTYPES})
        param.grad = torch.randn(LARGE, device="cuda", generator=gen)
        optimizer.step()
    (state,) = torch_adamw_states(optimizer)
    return state, olds[-1]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: next(iter(impl)) + str(
    next(iter(impl.values()))))
@pytest.mark.parametrize(("lr", "weight_decay"), SETTINGS)
def test_inversion_kernel_is_the_reference_at_scale(lr, weight_decay, impl):
    """A million elements per setting and implementation, bf16 and fp16 payloads: bit for
    bit the reference, 0 missed against the snapshot diff."""
    state, olds = _large_state(lr, weight_decay, impl, seed=7)
    for dtype in HALF_DTYPES:
        args = ("w", state.param, state.exp_avg, state.exp_avg_sq, state.hyper)
        with reference():
            expected = invert_adamw(*args, previous_step=state.hyper.step - 1, dtype=dtype)
        actual = invert_adamw(*args, previous_step=state.hyper.step - 1, dtype=dtype)
        _assert_same(expected, actual)
        truth = diff(olds[dtype], state.param.detach().to(dtype))
        assert 0 == (~torch.isin(truth.indices, actual.indices)).sum().item()


@pytest.mark.parametrize("slab_fraction", [1, 8, 4096])
def test_inversion_kernel_stages_or_recomputes_the_same_bounds(monkeypatch, slab_fraction):
    """Slabs that hold every element of a tile, the default eighth, or one element (so
    that nearly every tensor takes the dense path): the same change set."""
    from dte_detector import inversion_kernel

    monkeypatch.setattr(inversion_kernel, "SLAB_FRACTION", slab_fraction)
    state, _ = _large_state(3e-6, 0.003, {"fused": True}, seed=11)
    args = ("w", state.param, state.exp_avg, state.exp_avg_sq, state.hyper)
    with reference():
        expected = invert_adamw(*args, previous_step=state.hyper.step - 1, dtype=torch.bfloat16)
    _assert_same(expected, invert_adamw(*args, previous_step=state.hyper.step - 1,
                                        dtype=torch.bfloat16))


def _specials() -> tuple[torch.Tensor, ...]:
    """Masters and moments for the exact cases and the non-finite paths, including an
    overflowing ``p + u`` whose bounds are NaN casts."""
    midpoint = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32).item()
    big = 3.4e38
    master = [midpoint, -0.0, 0.0, 1.0, float("nan"), float("inf"), -float("inf"), big, -big,
              1e-40, -1e-45, 65504.0, 65520.0, 0.0]
    m = [0.0, 0.0, 0.0, -0.0, 1.0, 1.0, -1.0, 5e32, -5e32, 1e-30, -1e-30, 1.0, -1.0, -0.0]
    v = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1e-60, 1.0, 1.0, 0.0]
    return tuple(torch.tensor(x, device="cuda") for x in (master, m, v))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_inversion_kernel_is_the_reference_on_special_values(dtype, weight_decay, eps):
    """Zero moments with and without decay, signed zeros, NaN and +-inf masters, subnormal
    masters, fp16 overflow, an update that overflows ``p + u``, ``eps = 0`` with
    ``v = 0``: equal to the reference bit for bit."""
    hyper = AdamWStep(lr=1e-3, weight_decay=weight_decay, eps=eps, step=3)
    master, m, v = _specials()
    with reference():
        expected = invert_adamw("w", master, m, v, hyper, previous_step=2, dtype=dtype)
    _assert_same(expected, invert_adamw("w", master, m, v, hyper, previous_step=2,
                                        dtype=dtype))


def _cast_trajectory(count: int, seed: int, steps: int):
    """fp32 masters with NaN, +-inf, +-0 and midpoint values, moving a little each step."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    master = torch.randn(count, device="cuda", generator=gen) * 0.02
    masters = []
    for _ in range(steps):
        master = master + torch.randn(count, device="cuda", generator=gen) * 1e-4
        pick = torch.randint(0, 64, (count,), device="cuda", generator=gen)
        step = master.clone()
        step[pick == 0] = float("nan")
        step[pick == 1] = -0.0
        step[pick == 2] = float("inf")
        step[pick == 3] = midpoints(step[pick == 3].cpu(), torch.bfloat16).cuda()
        masters.append(step)
    return masters


def _run_cast(masters, model: torch.Tensor, *, copy: bool) -> tuple[CastDetector, list]:
    detector = CastDetector()
    for master in masters:
        if copy:
            detector.record_and_copy("w", master, model)
        else:
            detector.record("w", master, model)
            model.copy_(master)
    return detector, detector.changes("w", model)


def _assert_cast_kernel_is_reference(masters, start: torch.Tensor, *, copy: bool):
    """Run the trajectory from ``start`` through the reference and the kernel; assert equal
    model bits, dirty maps and change sets; return the kernel's model and change set."""
    with reference():
        expected_model = start.clone()
        expected, expected_changes = _run_cast(masters, expected_model, copy=copy)
    actual_model = start.clone()
    actual, actual_changes = _run_cast(masters, actual_model, copy=copy)
    assert bits_of(expected_model) == bits_of(actual_model)
    assert expected._dirty["w"].tolist() == actual._dirty["w"].tolist()
    _assert_same(expected_changes, actual_changes)
    return actual_model, actual_changes


@given(count=st.integers(1, 3 * 4096 + 17), seed=st.integers(0, 2**16),
       steps=st.integers(1, 3), dtype=st.sampled_from(HALF_DTYPES), copy=st.booleans())
def test_cast_kernel_is_record_then_copy(count, seed, steps, dtype, copy):
    """Over several steps, ``record_and_copy`` (or ``record`` then ``copy_``) through the
    kernel leaves the same model bits, dirty map and change set as the torch reference."""
    masters = _cast_trajectory(count, seed, steps)
    _assert_cast_kernel_is_reference(masters, masters[0].to(dtype), copy=copy)


@pytest.mark.parametrize("slab_fraction", [1, 4, 1024])
def test_cast_kernel_redoes_dense_tiles(monkeypatch, slab_fraction):
    """Slabs that hold a whole tile, the default quarter, or one pair (so that nearly
    every tile is too dense and the dense pass does it again): the same model bits and
    change set as the reference, covering the snapshot diff."""
    from dte_detector import cast_kernel

    monkeypatch.setattr(cast_kernel, "SLAB_FRACTION", slab_fraction)
    masters = _cast_trajectory(LARGE, seed=3, steps=2)
    start = masters[0].to(torch.bfloat16)
    actual_model, actual = _assert_cast_kernel_is_reference(masters, start, copy=True)
    truth = diff(start, actual_model)
    assert 0 == (~torch.isin(truth.indices, actual.indices)).sum().item()


SIZES = (1, 7, 1023, 1024, 1025, 4096 + 3, 3 * 4096, 70001)
"""Sizes around tile boundaries (1024 elements), a ragged tail, several hundred tiles."""


def _unaligned(tensor: torch.Tensor) -> torch.Tensor:
    """The same values in a view one element past a 16-byte boundary (as Megatron's shard
    views of a bucket are): the kernels must not load it as aligned vectors."""
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    storage[1:] = tensor.reshape(-1)
    return storage[1:].view(tensor.shape)


def _batch_states(seed: int):
    """AdamW states of tensors of ``SIZES`` after two real steps, in two optimizers with
    different lr and weight decay, half of them midpoints; the bf16 and fp16 weights
    before the last step."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for n in SIZES:
        master = torch.randn(n, device="cuda", generator=gen) * 0.02
        master[::2] = midpoints(master[::2].cpu(), torch.bfloat16).cuda()
        params.append(torch.nn.Parameter(master))
    optimizers = [torch.optim.AdamW(params[0::2], lr=3e-6, weight_decay=0.003, fused=True),
                  torch.optim.AdamW(params[1::2], lr=1e-4, weight_decay=0.1, foreach=True)]
    for step in range(2):
        olds = [{d: p.detach().to(d) for d in HALF_DTYPES} for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        for optimizer in optimizers:
            optimizer.step()
    states = {id(s.param): s for opt in optimizers for s in torch_adamw_states(opt)}
    return [states[id(p)] for p in params], olds


@pytest.mark.parametrize("group_elements", [5000, 1 << 28])
def test_batched_inversion_is_the_reference_per_tensor(monkeypatch, group_elements):
    """``invert_adamw_all`` over tensors of many sizes, two steps' hyper-parameters, bf16
    and fp16 payloads, aligned and unaligned tensors, in one group or in many (a host
    synchronisation each, pipelined): each change set is the torch reference's bit for
    bit and misses nothing of the snapshot diff."""
    from dte_detector import batch

    monkeypatch.setattr(batch, "GROUP_ELEMENTS", group_elements)
    states, olds = _batch_states(seed=5)
    inversions = []
    for i, s in enumerate(states):
        tensors = [s.param.detach(), s.exp_avg, s.exp_avg_sq]
        if i % 3 == 1:
            tensors = [_unaligned(t) for t in tensors]
        inversions.append(Inversion(name=str(i), master=tensors[0], exp_avg=tensors[1],
                                    exp_avg_sq=tensors[2], hyper=s.hyper,
                                    previous_step=s.hyper.step - 1,
                                    dtype=HALF_DTYPES[i % 2]))
    with reference():
        expected = invert_adamw_all(inversions)
    actual = invert_adamw_all(inversions)
    for one, e, a, old in zip(inversions, expected, actual, olds):
        _assert_same(e, a)
        truth = diff(old[one.dtype], one.master.to(one.dtype))
        assert 0 == (~torch.isin(truth.indices, a.indices)).sum().item()


@pytest.mark.parametrize(("group_elements", "slab_fraction"), [(5000, 4), (1 << 28, 4),
                                                               (1 << 28, 1024)])
@pytest.mark.parametrize("copy", [True, False])
def test_batched_cast_is_the_reference_per_tensor(monkeypatch, group_elements, slab_fraction,
                                                  copy):
    """``record_and_copy_all`` (or ``record_all`` then the copies) over tensors of many
    sizes, bf16 and fp16, some of them unaligned views of one buffer, over three steps,
    in one group or many, with the default slabs or slabs so small that the dense pass
    does most tiles: the same model bits, dirty maps and change sets as the reference."""
    from dte_detector import batch, cast_kernel

    monkeypatch.setattr(batch, "GROUP_ELEMENTS", group_elements)
    monkeypatch.setattr(cast_kernel, "SLAB_FRACTION", slab_fraction)
    trajectories = [_cast_trajectory(n, seed=n, steps=3) for n in SIZES]
    dtypes = [HALF_DTYPES[i % 2] for i in range(len(SIZES))]

    def run() -> tuple[CastDetector, dict[str, torch.Tensor]]:
        detector = CastDetector()
        models = {str(i): t[0].to(dtypes[i]) for i, t in enumerate(trajectories)}
        for name in ("2", "5"):
            models[name] = _unaligned(models[name])
        for step in range(3):
            record_all(detector, {name: (trajectories[int(name)][step], model)
                                  for name, model in models.items()}, copy=copy)
        return detector, models

    with reference():
        expected, expected_models = run()
    actual, actual_models = run()
    for name, model in actual_models.items():
        assert bits_of(expected_models[name]) == bits_of(model)
        assert expected._dirty[name].tolist() == actual._dirty[name].tolist()
        _assert_same(expected.changes(name, expected_models[name]), actual.changes(name, model))


def _compilations(mode: str) -> dict:
    probe = Path(__file__).with_name("warm_up_probe.py")
    done = subprocess.run([sys.executable, str(probe), mode], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_warm_up_compiles_every_kernel_a_sync_needs():
    """In a fresh process, a detection workload (both payloads, aligned and unaligned
    groups, decay one and not, staged and dense tiles, cast with and without copy)
    compiles kernels on its own, and one over other sizes and group shapes compiles none
    more; after ``warm_up`` the first workload compiles none either."""
    cold = _compilations("cold")
    assert cold["first"] > cold["before"] == 0
    assert cold["first"] == cold["second"]
    warm = _compilations("warm")
    assert warm["before"] == warm["first"] == warm["second"] > 0


def test_pipelined_sizes_arrive_intact_through_the_reused_landing_buffer():
    """Group sizes copied behind a long kernel, over calls that reuse the pinned landing
    buffer, one of them nested in another's ``finish`` and one with more sizes than the
    buffer holds: every ``finish`` sees exactly its group's sizes."""
    from dte_detector import batch

    seen: list[tuple[int, list[int]]] = []

    def run(groups: list[int], width: int, nested: bool = False) -> None:
        def launch(group: int) -> torch.Tensor:
            torch.cuda._sleep(20_000_000)  # the copy stays queued while the host moves on
            return torch.arange(width, device="cuda") + group * width

        def finish(group: int, launched: torch.Tensor, sizes: list[int]) -> None:
            seen.append((group, sizes))
            if nested and group == groups[0]:
                run([100, 101], 3)

        batch.pipelined(groups, launch, lambda launched: launched, finish)

    run([0, 1, 2], 5, nested=True)
    run([3, 4], 7)
    run([5, 6], batch.LANDING_WORDS // 2 + 1)
    expected = {g: list(range(g * w, (g + 1) * w)) for g, w in
                [(0, 5), (1, 5), (2, 5), (100, 3), (101, 3), (3, 7), (4, 7),
                 (5, batch.LANDING_WORDS // 2 + 1), (6, batch.LANDING_WORDS // 2 + 1)]}
    assert expected == dict(seen)
    assert len(seen) == len(expected)
