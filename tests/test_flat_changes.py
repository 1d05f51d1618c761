"""A batched detection's flat change sets (``dte_detector.FlatChanges``) encode to the
bytes of the same change sets given one by one, and to the reference's.

The detection kernels and the encoder's kernels run here on CPU tensors under Triton's
interpreter (or on the GPU where there is one), so the runs are the kernels' own
outputs. The detectors' results are not compared with their references here (the
interpreter casts fp32 to bf16 by truncation): both forms are read from one detection.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from kernel_mode import CUDA, DEVICE, kernels

from dte_codec.change_table import changed_elements
from dte_codec.encode import encode_delta_batched, encode_delta_per_tensor
from dte_codec.errors import EncodeError
from dte_codec.flat_encode import encode_delta_flat
from dte_codec.header import Header
from dte_detector import CastDetector, ChangeRun, ChangeSet, FlatChanges
from dte_detector import dispatch as detector_dispatch
from dte_detector.steps import AdamWSteps

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton")

SHAPES = {"embed": (40, 30), "norm": (7,), "frozen": (300,), "proj": (3000,),
          "column_major": (30, 20), "empty": (0,)}
"""``frozen`` gets no gradient (no change), ``column_major``'s weight is a transposed
view (not contiguous), ``empty`` has no elements."""


@pytest.fixture(autouse=True)
def _detector_kernels(monkeypatch):
    """The detectors' fused kernels for CPU tensors too (the interpreter runs them)."""
    if not CUDA:
        monkeypatch.setattr(detector_dispatch, "kernels_for",
                            lambda *tensors, payload: payload in detector_dispatch.KERNEL_PAYLOADS)

def _masters() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=gen).to(DEVICE) for name, shape in SHAPES.items()}


def _weights(masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bf16 model; ``column_major`` as the transpose of a contiguous tensor."""
    model = {name: m.to(torch.bfloat16) for name, m in masters.items()}
    model["column_major"] = model["column_major"].t().contiguous().t()
    assert not model["column_major"].is_contiguous()
    return model


def _assert_forms_agree(model: dict[str, torch.Tensor], flat: FlatChanges) -> None:
    """Flat form, per-tensor form and the reference: the same bytes; the flat form read
    as runs, not sent down the reference path; the same count of changed elements."""
    assert flat.runs and flat.loose
    one_by_one = {name: flat[name] for name in flat}
    with kernels():
        as_runs = encode_delta_flat(model, flat, stream_id="s", base_version=1, version=2)
        as_sets = encode_delta_flat(model, one_by_one, stream_id="s", base_version=1,
                                    version=2)
    reference = encode_delta_per_tensor(model, one_by_one, stream_id="s", base_version=1,
                                        version=2)
    assert as_runs is not None and as_sets is not None
    assert bytes(reference) == bytes(as_sets)
    assert bytes(reference) == bytes(as_runs)
    assert len(Header.unpack(memoryview(bytes(reference)))[0].entries) >= 3
    assert sum(len(c) for c in one_by_one.values()) == changed_elements(flat)


def test_adamw_runs_encode_as_the_change_sets():
    """``AdamWSteps.changes_all`` after a real AdamW step: runs for the stepped tensors,
    loose empty change sets for the one without a gradient; same bytes either way."""
    masters = _masters()
    params = {name: torch.nn.Parameter(m) for name, m in masters.items()}
    names = {id(p): (name,) for name, p in params.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=3e-2, weight_decay=0.01)
    steps = AdamWSteps(lambda p: names.get(id(p), ()))
    gen = torch.Generator().manual_seed(4)
    for name, p in params.items():
        if name != "frozen":
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
    optimizer.step()
    steps.record(optimizer)
    model = _weights({name: p.detach() for name, p in params.items()})
    flat = steps.changes_all(model)
    assert {"frozen", "empty"} <= set(flat.loose)
    assert 0 == len(flat["frozen"])
    _assert_forms_agree(model, flat)


def test_cast_runs_encode_as_the_change_sets():
    """``CastDetector.changes_all`` after one fused pass: runs for the contiguous models,
    the column-major one recorded by the reference (loose); same bytes either way."""
    masters = _masters()
    model = _weights(masters)
    old = {name: w.clone() for name, w in model.items()}
    gen = torch.Generator().manual_seed(5)
    moved = {name: m + 0.05 * torch.randn(m.shape, generator=gen).to(DEVICE)
             for name, m in masters.items()}
    moved["frozen"] = model["frozen"].float()  # casts back to itself under any rounding
    detector = CastDetector()
    detector.record_and_copy_all({name: (moved[name], model[name]) for name in model})
    flat = detector.changes_all(model)
    assert "column_major" in flat.loose
    assert 0 == len(flat["frozen"])
    assert all(int(old[n].reshape(-1)[flat[n].indices.long()].view(torch.int16).ne(
        flat[n].base_low.view(torch.int16)).sum()) == 0 for n in flat)
    _assert_forms_agree(model, flat)


def test_cast_passes_merged_are_loose():
    """Two fused passes before a sync: a tensor with flips in both gets them merged (the
    per-tensor ``changes``), so no run is passed on."""
    masters = _masters()
    model = _weights(masters)
    detector = CastDetector()
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        masters = {n: m + 0.05 * torch.randn(m.shape, generator=gen).to(DEVICE)
                   for n, m in masters.items()}
        detector.record_and_copy_all({n: (masters[n], model[n]) for n in model})
    flat = detector.changes_all(model)
    assert () == flat.runs
    for name in model:
        expected = detector.changes(name, model[name])
        assert expected.indices.tolist() == flat[name].indices.tolist()


def _int64_runs(model: dict[str, torch.Tensor]) -> FlatChanges:
    """Every third element of each tensor but ``norm`` (loose), as one run with int64
    indices; the old values bounded on both sides of the new (the wider side sets the
    residue width)."""
    names = [n for n in model if n != "norm"]
    sets = []
    for name in names:
        at = torch.arange(0, model[name].numel(), 3, device=DEVICE)
        new = model[name].reshape(-1)[at]
        sets.append(ChangeSet(at, new - 0.01, new + 1))
    run = ChangeRun(tuple(names), tuple(len(c) for c in sets),
                    *(torch.cat([getattr(c, k) for c in sets])
                      for k in ("indices", "base_low", "base_high")))
    norm = model["norm"]
    loose = {"norm": ChangeSet.exact(torch.tensor([2, 5], dtype=torch.int32, device=DEVICE),
                                     norm[[2, 5]] + 1)}
    return FlatChanges(tuple(model), [run], loose)


def test_int64_index_runs_encode_as_the_change_sets():
    """A run with int64 indices and bounds apart from the values (residues)."""
    model = _weights(_masters())
    _assert_forms_agree(model, _int64_runs(model))


def _assert_same_error(model: dict[str, torch.Tensor], flat: FlatChanges, base: int) -> None:
    """The flat form goes down the reference path and raises the per-tensor form's error."""
    with kernels():
        assert encode_delta_flat(model, flat, stream_id="s", base_version=base,
                                 version=base + 1) is None
        with pytest.raises(EncodeError) as flat_error:
            encode_delta_batched(model, flat, stream_id="s", base_version=base,
                                 version=base + 1)
    with pytest.raises(EncodeError) as sets_error:
        encode_delta_per_tensor(model, {n: flat[n] for n in flat}, stream_id="s",
                                base_version=base, version=base + 1)
    assert str(sets_error.value) == str(flat_error.value)


def test_a_run_that_does_not_fit_raises_the_reference_error():
    """Bounds of another dtype than the tensors': the per-tensor form's error, and the
    encoder takes the reference path for the flat form."""
    model = _weights(_masters())
    good = _int64_runs(model)
    run = good.runs[0]
    bad = FlatChanges(tuple(model), [ChangeRun(run.names, run.counts, run.indices,
                                               run.base_low.half(), run.base_high.half())],
                      good.loose)
    _assert_same_error(model, bad, 1)


def test_a_tensor_retyped_after_a_sync_fails_its_run():
    """The tensor set's dtype column follows a tensor replaced by one of another dtype:
    the run's bf16 bounds no longer fit it, and the encoder raises the reference's
    error instead of reading bounds of the wrong width."""
    model = _weights(_masters())
    flat = _int64_runs(model)
    with kernels():
        assert encode_delta_flat(model, flat, stream_id="s", base_version=1, version=2)
    model["proj"] = model["proj"].half()
    _assert_same_error(model, flat, 2)


def test_a_run_with_an_index_out_of_range_raises_the_reference_error():
    """An index past its tensor inside a run: found by the statistics, then the reference
    path's error."""
    model = _weights(_masters())
    good = _int64_runs(model)
    run = good.runs[0]
    indices = run.indices.clone()
    indices[run.starts[1]] = model[run.names[1]].numel()  # the second member's first index
    bad = FlatChanges(tuple(model), [ChangeRun(run.names, run.counts, indices, run.base_low,
                                               run.base_high)], good.loose)
    _assert_same_error(model, bad, 1)


def _split(flat: FlatChanges, at: int) -> FlatChanges:
    """``flat``'s one run cut into two after member ``at``: the same change sets, grouped
    otherwise."""
    run = flat.runs[0]
    cut = sum(run.counts[:at])
    first = ChangeRun(run.names[:at], run.counts[:at], run.indices[:cut], run.base_low[:cut],
                      run.base_high[:cut])
    second = ChangeRun(run.names[at:], run.counts[at:], run.indices[cut:],
                       run.base_low[cut:], run.base_high[cut:])
    return FlatChanges(tuple(flat), [second, first], flat.loose)


def test_kept_tables_follow_regrouped_runs_and_replaced_tensors():
    """What the encoder keeps across syncs (the members' places, per tensor set; the
    items table's numel, widths and addresses, per tensor set) follows runs grouped
    otherwise, a tensor replaced by one of other values at another address (the old
    one still alive: a kept address would read its values), and a tensor replaced by
    a larger one: every sync gives the reference's bytes."""
    model = _weights(_masters())
    _assert_forms_agree(model, _int64_runs(model))
    _assert_forms_agree(model, _split(_int64_runs(model), 2))
    old = model["proj"]
    model["proj"] = (old.float() * 3 + 1).to(torch.bfloat16)
    _assert_forms_agree(model, _split(_int64_runs(model), 2))
    model["embed"] = torch.randn(50, 30, generator=torch.Generator().manual_seed(7)).to(
        DEVICE).to(torch.bfloat16)
    _assert_forms_agree(model, _int64_runs(model))
    assert old.data_ptr() != model["proj"].data_ptr()
