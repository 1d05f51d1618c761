"""Applying payloads to live tensors: staging checks, all-or-nothing writes, rollback."""

from __future__ import annotations

import pytest
import torch
from bitwise import first_difference
from kernel_mode import DEVICE, kernels, needs_triton
from dte_codec import Frame, apply_, decode, encode_delta, encode_full
from dte_codec.apply import Staged, prepare, prepare_window
from dte_codec.box_copy import StagedCopies
from dte_codec.encodings import Kind
from dte_codec.errors import ApplyError, EntryError, MismatchError
from dte_codec.fit import check_covered
from dte_codec.parts import assemble, box_part, dense_part
from dte_codec.values import int_view
from dte_detector import ChangeSet, diff


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(50, generator=gen),
            "b": torch.randn(4, 30, generator=gen).to(torch.bfloat16),
            "c": torch.randn(6, generator=gen).to(torch.float16)}


def _copy(weights):
    return {name: t.clone() for name, t in weights.items()}


def _new(weights) -> dict[str, torch.Tensor]:
    """A step: a few elements of ``a`` and ``b`` move, all of ``c`` (a dense entry)."""
    new = _copy(weights)
    new["a"][[1, 20, 49]] += 1.0
    int_view(new["b"]).view(-1)[[0, 7, 119]] += 1
    new["c"] = -new["c"] - 1
    return new


def _delta_bytes(weights, new=None) -> Frame:
    new = _new(weights) if new is None else new
    changes = {name: diff(weights[name], new[name]) for name in weights}
    return encode_delta(new, changes, stream_id="s", base_version=1, version=2)


def _mismatch(weights, data) -> str:
    before = _copy(weights)
    with pytest.raises(MismatchError) as info:
        apply_(weights, decode(data))
    assert first_difference(before, weights) is None
    return str(info.value)


def test_delta_applies_bitwise():
    """A delta turns the base into the new tensors, bit for bit."""
    weights = _weights()
    new = _new(weights)
    data = _delta_bytes(weights, new)
    apply_(weights, decode(data))
    assert first_difference(new, weights) is None


def test_full_applies_bitwise():
    """A full payload overwrites every tensor, including 0-d and empty ones."""
    source = dict(_new(_weights()), z=torch.tensor(-0.0), e=torch.empty(0, 3))
    target = {name: torch.full_like(t, float("nan")) for name, t in source.items()}
    apply_(target, decode(encode_full(source, stream_id="s", version=1)))
    assert first_difference(source, target) is None


def test_writes_in_place():
    """The receiver's tensor objects are written, not replaced."""
    weights = _weights()
    ids = {name: t.data_ptr() for name, t in weights.items()}
    apply_(weights, decode(_delta_bytes(weights)))
    assert ids == {name: t.data_ptr() for name, t in weights.items()}


def test_leaf_tensors_requiring_grad():
    """Regression: parameters that require grad rejected every write with ApplyError;
    writes now run under ``no_grad``."""
    weights = _weights()
    new = _new(weights)
    data = _delta_bytes(weights, new)
    params = {name: torch.nn.Parameter(t.clone(), requires_grad=t.is_floating_point())
              for name, t in weights.items()}
    apply_(params, decode(data))
    assert first_difference(new, {n: p.detach() for n, p in params.items()}) is None


def test_unknown_name():
    """An entry naming no tensor of the receiver."""
    weights = _weights()
    data = encode_full({"zz": torch.zeros(2)}, stream_id="s", version=1)
    assert "name: expected a tensor of the receiver, got 'zz'" == _mismatch(weights, data)


def test_wrong_dtype():
    """An entry whose dtype differs from the receiver's tensor."""
    weights = _weights()
    data = encode_full({"a": weights["a"].double()}, stream_id="s", version=1)
    assert "tensor 'a': dtype: expected torch.float32, got torch.float64" == _mismatch(
        weights, data)


def test_wrong_shape():
    """An entry whose shape differs, even with the same number of elements."""
    weights = _weights()
    data = encode_full({"b": weights["b"].reshape(30, 4)}, stream_id="s", version=1)
    assert "tensor 'b': shape: expected (4, 30), got (30, 4)" == _mismatch(weights, data)


def test_non_contiguous_target():
    """The receiver's tensor must be contiguous to be written through a flat view."""
    weights = _weights()
    data = encode_full(weights, stream_id="s", version=1)
    weights["b"] = torch.zeros(30, 4, dtype=torch.bfloat16).t()
    assert "tensor 'b': layout: expected a contiguous tensor, got strided" == _mismatch(
        weights, data)


def test_full_payload_must_cover_every_tensor():
    """A full payload without some of the receiver's tensors is refused."""
    weights = _weights()
    data = encode_full({"a": weights["a"]}, stream_id="s", version=1)
    assert ("entries: expected every tensor of the receiver, got a full payload without "
            "['b', 'c']") == _mismatch(weights, data)


def test_full_covers_exactly_the_held_elements():
    """With ``held`` (a receiver whose padding rows no sender has), a full version of the
    rows that come from the model is accepted, padding untouched; one element short of
    ``held``, or the whole tensor where fewer are held, is refused."""
    target = torch.full((6, 4), -7.0, dtype=torch.bfloat16)
    rows = torch.randn(4, 4).to(torch.bfloat16)

    def full(block):
        return decode(bytes(assemble([box_part("e", block, shape=(6, 4), start=(0, 0))],
                                     stream_id="s", kind=Kind.FULL, base_version=-1,
                                     version=1)))

    prepare({"e": target}, [full(rows)], held={"e": 16}).write()
    assert torch.equal(target[:4], rows) and bool((target[4:] == -7.0).all())
    for block, held in ((rows[:3], 16), (torch.zeros(6, 4, dtype=torch.bfloat16), 16),
                        (rows, None)):
        with pytest.raises(MismatchError, match="elements covered"):
            prepare({"e": target}, [full(block)], held=held and {"e": held})


def test_delta_may_cover_some_tensors():
    """A delta names only the tensors that changed; the others stay as they are."""
    weights = _weights()
    new = dict(weights, a=weights["a"].clone())
    new["a"][0] = 5.0
    before = _copy(weights)
    apply_(weights, decode(_delta_bytes(weights, new)))
    assert first_difference(new, weights) is None
    assert first_difference({"b": before["b"]}, {"b": weights["b"]}) is None


def test_mismatch_in_a_later_entry_writes_nothing():
    """Staging checks every entry before the first write: a bad last entry leaves the
    earlier ones unwritten."""
    weights = _weights()
    data = _delta_bytes(weights)
    weights["c"] = weights["c"].float()
    assert "tensor 'c': dtype: expected torch.float32, got torch.float16" == _mismatch(
        weights, data)


def test_residue_against_a_foreign_base_writes_nothing():
    """A residue that cannot be resolved against this receiver's base raises
    ``EntryError`` at staging, before anything is written."""
    base = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    new = base.clone()
    int_view(new)[1] -= 1
    change = ChangeSet.exact(torch.tensor([1], dtype=torch.int32), base[1:2].clone())
    other = torch.tensor([0.5, 1.0], dtype=torch.bfloat16)
    data = encode_delta({"x": other + 1, "y": new},
                        {"x": diff(other, other + 1), "y": change},
                        stream_id="s", base_version=1, version=2)
    receiver = {"x": other.clone(), "y": torch.tensor([0.0, -float("nan"), 0.0],
                                                      dtype=torch.bfloat16)}
    int_view(receiver["y"])[1] = -1  # 0xFFFF, the lowest pattern: key 0
    before = _copy(receiver)
    with pytest.raises(EntryError) as info:
        apply_(receiver, decode(data))
    assert ("tensor 'y': values: expected residues that decode inside the dtype's range, "
            "got a residue that does not fit this receiver's base") == str(info.value)
    assert first_difference(before, receiver) is None


def _failing_write(monkeypatch, k: int) -> None:
    original = Staged.write
    calls = []

    def write(self):
        calls.append(self.name)
        if len(calls) == k:
            raise RuntimeError("disk on fire")
        return original(self)

    monkeypatch.setattr(Staged, "write", write)


def test_failed_write_restores_delta(monkeypatch):
    """A write failing on the last entry restores the entries written before it."""
    weights = _weights()
    before = _copy(weights)
    payload = decode(_delta_bytes(weights))
    _failing_write(monkeypatch, 3)
    with pytest.raises(ApplyError) as info:
        apply_(weights, payload)
    assert ("writing tensor 'c' failed after 2 of 3 entries: RuntimeError('disk on fire'); "
            "every tensor was restored") == str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert first_difference(before, weights) is None


def test_failed_write_of_full_payload_says_versions_mix(monkeypatch):
    """A full payload keeps no undo log; its ``ApplyError`` says the tensors mix versions."""
    weights = _weights()
    source = _new(weights)
    _failing_write(monkeypatch, 2)
    with pytest.raises(ApplyError) as info:
        apply_(weights, decode(encode_full(source, stream_id="s", version=1)))
    assert ("writing tensor 'b' failed after 1 of 3 entries: RuntimeError('disk on fire'); "
            "the tensors now mix versions") == str(info.value)
    assert first_difference({"a": source["a"]}, {"a": weights["a"]}) is None


def test_full_version_in_windows():
    """A full version split into two windows (one tensor each, ``b`` in two boxes):
    each window is written as it comes; the regions of both cover every element."""
    source, weights = _new(_weights()), _weights()
    b = source["b"]
    windows = [[dense_part("a", source["a"]), box_part("b", b[:1], shape=(4, 30), start=(0, 0))],
               [box_part("b", b[1:], shape=(4, 30), start=(1, 0)), dense_part("c", source["c"])]]
    regions: dict[str, list] = {}
    for parts in windows:
        payload = decode(assemble(parts, stream_id="s", kind=Kind.FULL, base_version=-1,
                                  version=3))
        prepare_window(weights, [payload]).write()
        for entry, where in zip(payload.header.entries, payload.indices):
            regions.setdefault(entry.name, []).append(where)
    check_covered(weights, regions)
    assert first_difference(source, weights) is None
    del regions["c"]
    with pytest.raises(MismatchError) as info:
        check_covered(weights, regions)
    assert "entries: expected every tensor of the receiver, got a full payload without ['c']" \
        == str(info.value)


def test_window_of_a_delta_refused():
    """Only full payloads come in windows."""
    weights = _weights()
    with pytest.raises(MismatchError) as info:
        prepare_window(weights, [decode(_delta_bytes(weights))])
    assert "payloads: expected full payloads in a window, got DELTA" == str(info.value)


@needs_triton
@pytest.mark.parametrize("windows", [False, True], ids=["whole", "windows"])
def test_full_version_by_the_copy_kernel(windows):
    """Where the kernels run, a full version (whole tensors, or boxes from two windows) is
    written by one box-copy write, bit for bit as the reference ``copy_`` per entry, also
    a second time (the plan kept) from values at other addresses."""
    weights, step = {n: t.to(DEVICE) for n, t in _weights().items()}, _weights()
    for version in (3, 4):
        step = _new(step)
        source = {n: t.to(DEVICE) for n, t in step.items()}
        b = source["b"]
        parts = [[dense_part("a", source["a"]), box_part("b", b[:1], shape=(4, 30),
                                                         start=(0, 0))],
                 [box_part("b", b[1:], shape=(4, 30), start=(1, 0)),
                  dense_part("c", source["c"])]]
        if not windows:
            parts = [[dense_part(n, t) for n, t in source.items()]]
        with kernels():
            for window in parts:
                payload = decode(assemble(window, stream_id="s", kind=Kind.FULL,
                                          base_version=-1, version=version))
                prepared = prepare_window(weights, [payload])
                assert [StagedCopies] == [type(s) for s in prepared.entries]
                prepared.write()
        assert first_difference(source, weights) is None
