"""The batched inversion kernels under Triton's interpreter, against the torch reference.

Without a CUDA device the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set
here before the kernel module is first imported), so their tiling, int32 offsets,
staging, dense pass, gather and groups are checked on any machine; ``test_kernels.py``
checks them on the GPU. Only fp16 payloads are compared: the interpreter casts fp32 to
bf16 by truncation, not by the hardware's round-to-nearest-even. The CPU reference
divides by the step's scalars where torch's CUDA kernels multiply by their fp32
reciprocals; the fixed inputs below give the same bits either way (a differing element
fails the test).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from detector_cases import bits_of, midpoints

from dte_detector.inversion import GUARD_ULPS, AdamWStep, _invert_chunk, per_tensor

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="test_kernels.py runs them on the GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HYPERS = (AdamWStep(lr=3e-6, weight_decay=0.003, eps=1e-8, step=5),
          AdamWStep(lr=1e-3, weight_decay=0.0, eps=1e-8, step=2),  # no decay: DECAY_IS_ONE
          AdamWStep(lr=1e-4, weight_decay=0.1, eps=0.0, step=1),
          AdamWStep(lr=1e-5, weight_decay=0.01, eps=1e-8, step=1000))
SIZES = (1, 7, 1023, 1024, 1025, 2049, 3001, 5000)
"""Around the tile of 1,024 elements, ragged last tiles, several tiles per member."""


def _specials() -> tuple[torch.Tensor, ...]:
    """Signed zeros with zero moments, NaN and +-inf masters, an overflowing ``p + u``,
    subnormals, fp16's overflow edge, ``v = 0``."""
    midpoint = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32).item()
    master = [midpoint, -0.0, 0.0, 1.0, float("nan"), float("inf"), -float("inf"), 3.4e38,
              -3.4e38, 1e-40, -1e-45, 65504.0, 65520.0, 0.0]
    m = [0.0, 0.0, 0.0, -0.0, 1.0, 1.0, -1.0, 5e32, -5e32, 1e-30, -1e-30, 1.0, -1.0, -0.0]
    v = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1e-60, 1.0, 1.0, 0.0]
    return tuple(torch.tensor(x) for x in (master, m, v))


def _members() -> list[tuple[tuple[torch.Tensor, ...], AdamWStep]]:
    """Masters next to fp16 rounding midpoints (within 2 fp32 ulps) and elsewhere, moments
    from subnormal to large with exact zeros, each size aligned and one element off a
    16-byte boundary (scalar loads)."""
    gen = torch.Generator().manual_seed(0)
    members = []
    for k, (n, offset) in enumerate((n, offset) for n in SIZES for offset in (0, 1)):
        count = n + offset
        p = torch.randn(count, generator=gen) * (0.02, 1.0, 1e-30, 300.0)[k % 4]
        near = (midpoints(p, torch.float16).view(torch.int32)
                + torch.randint(-2, 3, (count,), generator=gen, dtype=torch.int32))
        p = torch.where(torch.rand(count, generator=gen) < 0.3, near.view(torch.float32), p)
        m = torch.randn(count, generator=gen) * (1e-3, 1e-8, 1.0, 1e-20)[k % 4]
        v = torch.rand(count, generator=gen) * (1e-6, 1e-16, 1.0, 1e-40)[k // 2 % 4]
        m[torch.rand(count, generator=gen) < 0.1] = 0.0
        v[torch.rand(count, generator=gen) < 0.05] = 0.0
        if count >= 14:
            for tensor, special in zip((p, m, v), _specials()):
                tensor[:14] = special
        members.append(((p[offset:], m[offset:], v[offset:]), HYPERS[k % len(HYPERS)]))
    return members


@pytest.mark.parametrize("waves", [None, 1])
@pytest.mark.parametrize("slab_fraction,group_elements,wide",
                         [(8, 1 << 28, False), (1, 5000, False), (4096, 5000, False),
                          (8, 5000, True)])
def test_interpreted_batched_inversion_is_the_reference(monkeypatch, slab_fraction,
                                                        group_elements, wide, waves):
    """Every member's indices and fp16 bounds equal the reference's bit for bit, through
    the sync's path (``Inverter``, every tensor through the kernels): one group or many,
    the default slab, slabs that hold every element, no slab (every tile with a change
    through the dense pass), and the int64 offsets of members past 2**31 elements; with
    the default programs, and with one program walking every tile (the interpreter is
    one multiprocessor: the default gives most tiles a program of their own)."""
    from triton.runtime.interpreter import InterpretedFunction

    from dte_detector import batch, dispatch, inversion_kernel
    from dte_detector.inverter import Inverter

    assert isinstance(inversion_kernel._mark, InterpretedFunction), \
        "the kernel module was imported before TRITON_INTERPRET was set"
    monkeypatch.setattr(inversion_kernel, "SLAB_FRACTION", slab_fraction)
    monkeypatch.setattr(inversion_kernel, "WAVES", waves or inversion_kernel.WAVES)
    monkeypatch.setattr(batch, "GROUP_ELEMENTS", group_elements)
    monkeypatch.setattr(dispatch, "kernels_for", lambda *tensors, payload: True)
    if wide:
        monkeypatch.setattr(inversion_kernel, "narrow", lambda numel, rows: False)
    members = _members()
    loose, found = Inverter().runs([f"t{k}" for k in range(len(members))],
                                   [flat for flat, _ in members], [h for _, h in members],
                                   [h.step - 1 for _, h in members],
                                   [torch.float16] * len(members))
    assert [None] * len(members) == loose
    runs = {at: run.change_set(k) for run in found for k, at in enumerate(run.names)}
    changed = 0
    for (flat, hyper), actual in zip(members, [runs[at] for at in range(len(members))]):
        indices, low, high = _invert_chunk(*flat, hyper, torch.float16, GUARD_ULPS)
        assert indices.tolist() == actual.indices.tolist()
        assert bits_of(low) == bits_of(actual.base_low)
        assert bits_of(high) == bits_of(actual.base_high)
        changed += indices.numel()
    assert 0 < changed < sum(flat[0].numel() for flat, _ in members)


@pytest.mark.parametrize("fused", ["all", "odd", "first half"])
def test_interpreted_columns_mix_kernels_and_reference(monkeypatch, fused):
    """``invert_columns`` hands each tensor its own change set, in order, whether every
    tensor went through the kernels, every other one, or a leading run of them (the
    kernels' runs keyed by their positions among all tensors)."""
    from dte_detector import dispatch
    from dte_detector.inversion import invert_columns

    members = _members()
    n = len(members)
    picked = {"all": range(n), "odd": range(1, n, 2), "first half": range(n // 2)}[fused]
    chosen = {id(members[k][0][0]) for k in picked}
    monkeypatch.setattr(dispatch, "kernels_for", lambda p, *rest, payload: id(p) in chosen)
    found = invert_columns([f"t{k}" for k in range(n)], [flat for flat, _ in members],
                           [hyper for _, hyper in members], [h.step - 1 for _, h in members],
                           [torch.float16] * n, guard_ulps=GUARD_ULPS)
    for (flat, hyper), actual in zip(members, found, strict=True):
        indices, low, high = _invert_chunk(*flat, hyper, torch.float16, GUARD_ULPS)
        assert indices.tolist() == actual.indices.tolist()
        assert bits_of(low) == bits_of(actual.base_low)
        assert bits_of(high) == bits_of(actual.base_high)


def test_interpreted_inverter_replans_a_replaced_resized_retyped_or_strided_tensor(
        monkeypatch):
    """``Inverter`` keeps its layout across calls only while every tensor keeps its
    address, size, dtype and contiguity: a master replaced by another tensor, resized in
    place, given another dtype in place (a typed error, as on a first call) or made
    non-contiguous in place gives the reference's change sets again, bit for bit; the
    same tensors again are not planned again; a moment shortened in place is a typed
    refusal."""
    from dte_detector import batch, dispatch
    from dte_detector.errors import PrecisionError, StateSizeError
    from dte_detector.inverter import Inverter

    monkeypatch.setattr(dispatch, "kernels_for", lambda *tensors, payload: True)
    plans = []
    planned = batch.plan
    monkeypatch.setattr(batch, "plan", lambda *args, **kwargs: plans.append(1) or planned(
        *args, **kwargs))
    members = [list(flat) for flat, _ in _members()[6:12]]
    hypers = [hyper for _, hyper in _members()[6:12]]
    inverter = Inverter()

    def runs():
        return inverter.runs([f"t{k}" for k in range(len(members))],
                             [tuple(m) for m in members], hypers,
                             [h.step - 1 for h in hypers], [torch.float16] * len(members))

    def check() -> None:
        found = per_tensor(*runs())
        for (p, m, v), hyper, actual in zip(members, hypers, found, strict=True):
            flat = (p.reshape(-1), m.reshape(-1), v.reshape(-1))
            indices, low, high = _invert_chunk(*flat, hyper, torch.float16, GUARD_ULPS)
            assert indices.tolist() == actual.indices.tolist()
            assert bits_of(low) == bits_of(actual.base_low)
            assert bits_of(high) == bits_of(actual.base_high)

    check()
    check()
    assert 1 == len(plans)  # the same tensors: nothing planned again
    members[1][0] = members[1][0].clone() * 1.5  # replaced
    check()
    p, m, v = members[2]
    p.data, m.data, v.data = p.data[:700], m.data[:700], v.data[:700]  # resized in place
    check()
    assert 3 == len(plans)
    p, m, v = members[0]  # 1024 elements: transposed in place, same address and size
    p.data, m.data, v.data = (t.data.view(32, 32).t() for t in (p, m, v))
    check()
    m = members[5][1]
    whole = m.data
    for kept in (m.numel() // 2, 1):  # one element: the torch reference would broadcast it
        m.data = whole[:kept]  # a moment shorter than its master
        with pytest.raises(StateSizeError, match=f"'t5': exp_avg has {kept} elements"):
            runs()
    m.data = whole
    check()
    members[4][0].data = members[4][0].data.view(torch.int32)  # same address and size
    with pytest.raises(PrecisionError):
        check()


@pytest.mark.parametrize("waves", [None, 1])
@pytest.mark.parametrize("slab_fraction", [1, 4, 1024])
@pytest.mark.parametrize("copy", [True, False])
def test_interpreted_cast_is_the_reference(monkeypatch, slab_fraction, copy, waves):
    """``record_and_copy_all`` (or ``record_all`` then the copies) through the cast
    kernels, over fp16 tensors around the tile size that move by much or little (NaN,
    -0 and inf among them), two steps, with slabs that hold a whole tile, the default
    quarter, or one pair (nearly every tile dense: counted by the first pass, done again
    by the dense pass): the reference's model bits, dirty maps and change sets; with the
    default programs (one per tile here) and with one program walking every tile, which
    reads each next tile ahead (its dirty bytes with the rest)."""
    from detector_cases import record_all

    from dte_detector import CastDetector, cast_kernel, dispatch

    monkeypatch.setattr(cast_kernel, "SLAB_FRACTION", slab_fraction)
    monkeypatch.setattr(cast_kernel, "WAVES", waves or cast_kernel.WAVES)
    gen = torch.Generator().manual_seed(7)
    trajectories = []
    for n, scale in ((7, 1e-3), (1025, 1e-3), (3001, 1e-6), (2048, 3e-5)):
        master = torch.randn(n, generator=gen) * 0.02
        steps = []
        for _ in range(2):
            master = master + torch.randn(n, generator=gen) * scale
            step = master.clone()
            pick = torch.randint(0, 64, (n,), generator=gen)
            step[pick == 0], step[pick == 1], step[pick == 2] = float("nan"), -0.0, float("inf")
            steps.append(step)
        trajectories.append(steps)

    def run() -> tuple[CastDetector, dict[str, torch.Tensor]]:
        detector = CastDetector()
        models = {str(i): t[0].to(torch.float16) for i, t in enumerate(trajectories)}
        for step in range(2):
            record_all(detector, {name: (trajectories[int(name)][step], model)
                                  for name, model in models.items()}, copy=copy)
        return detector, models

    expected, expected_models = run()
    monkeypatch.setattr(dispatch, "kernels_for", lambda *tensors, payload: True)
    actual, actual_models = run()
    assert 2 == actual._fused_passes
    for name, model in actual_models.items():
        assert bits_of(expected_models[name]) == bits_of(model)
        assert expected._dirty[name].tolist() == actual._dirty[name].tolist()
        want, got = expected.changes(name, expected_models[name]), actual.changes(name, model)
        assert want.indices.tolist() == got.indices.tolist()
        assert bits_of(want.base_low) == bits_of(got.base_low)
        assert bits_of(want.base_high) == bits_of(got.base_high)


def _cast_syncs(edits, made: list) -> tuple[list, list[int]]:
    """Syncs of a ``CastDetector`` over four fp16 models (one of 32 x 32), each after its
    edit of the masters and models (in place, or replacing a list entry) and a small
    step of the fp32 masters (``"alone"``: the second model is recorded alone first, then
    all again). Per sync: the model bits and change sets; and ``len(made)`` by then."""
    from dte_detector import CastDetector

    gen = torch.Generator().manual_seed(3)
    masters = [torch.randn(n, generator=gen) * 0.02 for n in (7, 1025, 2048)]
    masters.append(torch.randn(32, 32, generator=gen) * 0.02)
    models = [master.to(torch.float16) for master in masters]
    detector = CastDetector()
    trace, plans = [], []
    for edit in edits:
        if edit == "alone":
            detector.record_and_copy("1", masters[1].detach(), models[1])
        elif edit is not None:
            edit(masters, models)
        for master in masters:
            if master.dtype == torch.float32:
                master.add_(torch.randn(master.shape, generator=gen) * 3e-4)
        # new tensor objects each sync, as a trainer's hook builds them
        detector.record_and_copy_all({str(k): (master.detach(), model)
                                      for k, (master, model) in enumerate(zip(masters, models))})
        found = [detector.changes(str(k), model) for k, model in enumerate(models)]
        trace.append(([bits_of(model) for model in models],
                      [(c.indices.tolist(), bits_of(c.base_low), bits_of(c.base_high))
                       for c in found]))
        plans.append(len(made))
        detector.clear()
    return trace, plans


def test_interpreted_cast_keeps_its_layout_only_while_its_tensors_keep_theirs(monkeypatch):
    """``CastDetector`` keeps its layout, plan and dirty maps across ``clear`` only while
    every master and model keeps its address, size, dtype and contiguity: a sync over new
    views of the same tensors plans nothing again; a model replaced, a pair resized in
    place, a master transposed in place and back (same address and size), a model
    recorded alone before a call over all (and the sync after it, whose kept maps ``clear``
    zeroed, that one's too), and a master re-typed in place each give the torch
    reference's model bits and change sets, bit for bit."""
    from dte_detector import batch, dispatch

    monkeypatch.setattr(dispatch, "kernels_for", lambda *tensors, payload: (
        not dispatch.forced() and payload in dispatch.KERNEL_PAYLOADS))

    def replace(masters, models):
        models[1] = models[1].clone()

    def resize(masters, models):
        masters[2].data, models[2].data = masters[2].data[:700], models[2].data[:700]

    def transpose(masters, models):
        masters[3].data = masters[3].data.t()

    def retype(masters, models):
        masters[0].data = masters[0].data.view(torch.int32)

    edits = [None, None, replace, resize, transpose, transpose, "alone", None, retype, None]
    with dispatch.reference():
        expected, _ = _cast_syncs(edits, [])
    made = []
    planned = batch.plan
    monkeypatch.setattr(batch, "plan", lambda *args, **kwargs: made.append(1) or planned(
        *args, **kwargs))
    actual, plans = _cast_syncs(edits, made)
    for want, got in zip(expected, actual, strict=True):
        assert want == got
    # kept over the second sync, the one after the model recorded alone and the last; a
    # transposed master is copied and planned each call; a model recorded alone and then
    # with the others: two layouts (the second takes the first's map)
    assert [1, 1, 2, 3, 4, 5, 7, 7, 8, 8] == plans


def _two_records(names, edit=None):
    """A ``CastDetector`` over two fp16 models of 1,025 elements: one step recorded and
    copied under ``names[0]``, a second under ``names[1]`` (after ``edit`` of the pairs,
    if given), without a clear between them; the detector, models and pairs."""
    from dte_detector import CastDetector

    gen = torch.Generator().manual_seed(11)
    masters = [torch.randn(1025, generator=gen) * 0.02 for _ in range(2)]
    models = [master.to(torch.float16) for master in masters]
    detector = CastDetector()
    for step, keys in enumerate(names):
        if step and edit is not None:
            edit(masters, models)
        for master in masters:
            master.add_(torch.randn(master.shape, generator=gen) * 3e-4)
        detector.record_and_copy_all({key: (master.detach(), model)
                                      for key, master, model in zip(keys, masters, models)})
    return detector, models


def test_interpreted_cast_dirty_bits_follow_names(monkeypatch):
    """The same tensors recorded again under swapped names before a ``clear``: each
    name's first-seen pairs are read against that name's dirty bits, as the reference
    does (a layout kept by position alone would read them against the other tensor's)."""
    from dte_detector import dispatch

    names = [("a", "b"), ("b", "a")]
    with dispatch.reference():
        expected, expected_models = _two_records(names)
    monkeypatch.setattr(dispatch, "kernels_for", lambda *tensors, payload: True)
    actual, actual_models = _two_records(names)
    for want_model, got_model in zip(expected_models, actual_models, strict=True):
        assert bits_of(want_model) == bits_of(got_model)
    for name, model in zip("ab", actual_models):
        want, got = expected.changes(name, model), actual.changes(name, model)
        assert want.indices.tolist() == got.indices.tolist()
        assert bits_of(want.base_low) == bits_of(got.base_low)


@pytest.mark.parametrize("numel,resized", [(1025, 1000), (1024, 1020)])
@pytest.mark.parametrize("kernels", [False, True])
def test_a_tensor_resized_within_an_interval_is_refused_before_anything_is_written(
        monkeypatch, kernels, numel, resized):
    """A pair resized in place after its first record and before the ``clear`` (also
    within the same bytes of dirty bits): a typed ``ResizedError`` naming it, with no
    model written (the other pair's neither), through the reference or the kernels; after
    the ``clear`` the same tensors record again."""
    from dte_detector import CastDetector, dispatch
    from dte_detector.errors import ResizedError

    if kernels:
        monkeypatch.setattr(dispatch, "kernels_for", lambda *tensors, payload: True)
    gen = torch.Generator().manual_seed(5)
    masters = [torch.randn(numel, generator=gen) * 0.02 for _ in range(2)]
    models = [master.to(torch.float16) for master in masters]
    detector = CastDetector()

    def record() -> None:
        for master in masters:
            master.add_(torch.randn(master.shape, generator=gen) * 3e-4)
        detector.record_and_copy_all({name: (master.detach(), model)
                                      for name, master, model in zip("ab", masters, models)})

    record()
    masters[1].data, models[1].data = masters[1].data[:resized], models[1].data[:resized]
    before = [bits_of(model) for model in models]
    with pytest.raises(ResizedError, match=f"'b': {resized} elements, but {numel}"):
        record()
    assert before == [bits_of(model) for model in models]
    with pytest.raises(ResizedError):  # refused until the clear
        record()
    detector.clear()
    record()
    for model, master in zip(models, masters, strict=True):
        assert bits_of(master.to(torch.float16)) == bits_of(model)
