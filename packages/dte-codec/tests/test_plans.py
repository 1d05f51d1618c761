"""Plans between random layouts of random Qwen3 / Qwen3-MoE models (invariant 6).

Every property builds random canonical tensors and cuts the source and target shards out
of them with ``materialize`` (which reads the pieces, not the plan), so the plan, the
remap and the dense copy are each checked against the layouts themselves.
"""

from __future__ import annotations

import torch
from dte_codec.geometry import Shard, materialize, plan
from dte_codec.layouts import ModelConfig, canonical_tensors
from dte_codec.remap import copy_slices, remap
from hypothesis import example, given
from hypothesis import strategies as st
from plan_strategies import BACK, PINNED, cases, layouts_for, model_configs, shards


def _canonical(config: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {name: torch.randn(spec.shape, generator=gen).to(spec.dtype)
            for name, spec in canonical_tensors(config).items()}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def _bitwise_equal(expected: dict, actual: dict) -> list:
    """Keys whose tensors differ in any bit."""
    return [k for k in expected if not torch.equal(_bits(expected[k]), _bits(actual[k]))]


def _local(shards_: list[Shard], canonical: dict, *, fill: float) -> dict:
    return {(s.rank, name): t for s in shards_
            for name, t in materialize(s, canonical, fill=fill).items()}


@given(case=cases())
@example(case=PINNED)
@example(case=BACK)
def test_dense_copy_reproduces_every_target_shard(case):
    """Copying every source rank's plan box by box rebuilds each target shard bit for
    bit; each target element is written exactly once per replica, padding never."""
    config, source, target, seed, _ = case
    canonical = _canonical(config, torch.Generator().manual_seed(seed))
    sources, targets = shards(config, source), shards(config, target)
    expected = _local(targets, canonical, fill=float("nan"))
    actual = {key: torch.full_like(t, float("nan")) for key, t in expected.items()}
    writes = {key: torch.zeros(t.shape, dtype=torch.int32) for key, t in expected.items()}
    for shard in sources:
        tensors = materialize(shard, canonical)
        for name, transfers in plan(shard, targets).items():
            copy_slices(transfers, tensors[name], actual)
            for t in transfers:
                writes[t.target][t.target_box.slices()] += 1
    covered = _local(targets, {n: torch.ones_like(t) for n, t in canonical.items()}, fill=0)
    assert [] == _bitwise_equal(expected, actual)
    assert [] == [k for k in writes if not torch.equal(covered[k].to(torch.int32), writes[k])]


@given(config=model_configs(), data=st.data())
def test_a_layout_holds_every_canonical_element_and_sends_it_once(config, data):
    """Across the ranks of any layout every canonical element sits in some piece (nothing
    is lost) and in exactly one primary piece (it is sent once)."""
    kind = data.draw(st.sampled_from(["megatron", "sglang", "hf"]))
    layout = data.draw(layouts_for(config, kind))
    held = {name: torch.zeros(spec.shape, dtype=torch.int32)
            for name, spec in canonical_tensors(config).items()}
    sent = {n: torch.zeros_like(t) for n, t in held.items()}
    for shard in shards(config, layout):
        for piece in shard.pieces:
            held[piece.canonical][piece.region.slices()] += 1
            sent[piece.canonical][piece.region.slices()] += piece.primary
    assert [] == [n for n, t in held.items() if not bool((t >= 1).all())]
    assert [] == [n for n, t in sent.items() if not bool((t == 1).all())]


def _changed(config: ModelConfig, canonical: dict, gen: torch.Generator, rate: float):
    """New canonical values at a random ``rate`` of elements, and the changed mask."""
    mask = {n: torch.rand(t.shape, generator=gen) < rate for n, t in canonical.items()}
    new = {n: torch.where(mask[n], torch.randn(t.shape, generator=gen).to(t.dtype), t)
           for n, t in canonical.items()}
    return new, mask


def _remap_all(config, source, target, seed, rate):
    """Per source rank and tensor, the shuffled changed indices and their remap."""
    gen = torch.Generator().manual_seed(seed)
    canonical = _canonical(config, gen)
    new, mask = _changed(config, canonical, gen, rate)
    sources, targets = shards(config, source), shards(config, target)
    sent = []
    for shard in sources:
        values = materialize(shard, new)
        changed = materialize(shard, {n: m.to(torch.uint8) for n, m in mask.items()})
        for name, transfers in plan(shard, targets).items():
            flat = torch.nonzero(changed[name].flatten()).flatten()
            flat = flat[torch.randperm(flat.numel(), generator=gen)]
            out = remap(transfers, shard.tensors[name].shape, flat, tensor=name)
            sent.append((values[name].flatten()[flat], transfers, out))
    return canonical, new, targets, sent


@given(case=cases())
@example(case=PINNED)
@example(case=BACK)
def test_sparse_remap_equals_dense_copy_of_changed_elements(case):
    """Scattering each source rank's changed values at the remapped target indices turns
    every target shard of the old weights into the target shard of the new ones."""
    canonical, new, targets, sent = _remap_all(*case)
    actual = _local(targets, canonical, fill=float("nan"))
    for values, _, out in sent:
        for key, remapped in out.items():
            actual[key].view(-1)[remapped.indices.long()] = values[remapped.positions]
    assert [] == _bitwise_equal(_local(targets, new, fill=float("nan")), actual)


@given(case=cases())
@example(case=PINNED)
@example(case=BACK)
def test_remapped_indices_are_sorted_unique_in_range_and_narrow(case):
    """Remapped indices are strictly increasing, inside their target, int32 for these
    small targets; positions are a subset of the input without repeats; every planned
    target has an entry."""
    _, _, _, sent = _remap_all(*case)
    for values, transfers, out in sent:
        assert sorted({t.target for t in transfers}) == list(out)
        for key, remapped in out.items():
            indices, numel = remapped.indices, torch.Size(next(
                t.target_shape for t in transfers if t.target == key)).numel()
            assert torch.int32 == indices.dtype
            assert bool((indices[1:] > indices[:-1]).all())
            assert bool(((indices >= 0) & (indices < numel)).all())
            assert remapped.positions.unique().numel() == remapped.positions.numel()
            assert bool((remapped.positions < values.numel()).all())
