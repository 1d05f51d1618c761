"""Plans between random layouts of random Qwen3 / Qwen3-MoE models (invariant 6).

Every property builds random canonical tensors and cuts the source and target shards out
of them with ``materialize`` (which reads the pieces, not the plan), so the plan, the
remap and the dense copy are each checked against the layouts themselves.
"""

from __future__ import annotations

import attrs
import torch
from dte_codec.errors import GeometryError
from dte_codec.geometry import Shard, materialize, plan
from dte_codec.layouts import ModelConfig, canonical_tensors, hf_shard
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.remap import copy_slices, remap
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from hypothesis import example, given
from hypothesis import strategies as st


@attrs.frozen
class HF:
    """The one-rank Hugging Face layout (a marker next to the two parallel layouts)."""


def shards(config: ModelConfig, layout) -> list[Shard]:
    if isinstance(layout, MegatronLayout):
        return [megatron_shard(config, layout, rank=r) for r in range(layout.world_size)]
    if isinstance(layout, SGLangLayout):
        return [sglang_shard(config, layout, rank=r) for r in range(layout.tp)]
    return [hf_shard(config)]


def _fits(config: ModelConfig, layout) -> bool:
    try:
        layout.check(config)
    except GeometryError:
        return False
    return True


@st.composite
def model_configs(draw) -> ModelConfig:
    """Small GQA models, dense or MoE, whose sizes divide by some of the TP sizes."""
    kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    heads = draw(st.sampled_from([h for h in (4, 8, 12, 16) if h % kv_heads == 0]))
    moe = draw(st.booleans())
    return ModelConfig(
        vocab=draw(st.integers(8, 100)), hidden=draw(st.integers(8, 32)),
        layers=draw(st.integers(1, 4)), heads=heads, kv_heads=kv_heads,
        head_dim=draw(st.integers(2, 8)), intermediate=draw(st.sampled_from([8, 12, 16, 24])),
        num_experts=draw(st.integers(2, 8)) if moe else 0,
        moe_intermediate=draw(st.sampled_from([4, 6, 8, 16])),
        tie_word_embeddings=draw(st.booleans()))


def layouts_for(config: ModelConfig, kind: str) -> st.SearchStrategy:
    """Every layout of ``kind`` in the test grid that can split ``config``: Megatron TP
    1/2/4 x PP 1/2 x EP 1/2 with the vocab padded or not, SGLang TP 1/2/4/8 x EP 1/2 x
    vocab padding 64 or 3, or HF."""
    eps = (1, 2) if config.is_moe else (1,)
    grid = {
        "hf": [HF()],
        "megatron": [MegatronLayout(tp=tp, pp=pp, ep=ep, vocab_multiple=vm)
                     for tp in (1, 2, 4) for pp in (1, 2) for ep in eps for vm in (1, 8 * tp)],
        "sglang": [SGLangLayout(tp=tp, ep=ep, vocab_padding=padding)
                   for tp in (1, 2, 4, 8) for ep in eps for padding in (64, 3)],
    }[kind]
    return st.sampled_from([layout for layout in grid if isinstance(layout, HF) or
                            _fits(config, layout)])


@st.composite
def cases(draw):
    """A model, a source and a target layout (trainer to rollout most often), a seed and
    a change rate."""
    config = draw(model_configs())
    source = draw(layouts_for(config, draw(st.sampled_from(["megatron", "sglang", "hf"]))))
    target = draw(layouts_for(config, draw(st.sampled_from(["sglang", "megatron", "hf"]))))
    return config, source, target, draw(st.integers(0, 2**31 - 1)), \
        draw(st.sampled_from([0.03, 0.3, 1.0, 0.0]))


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


# A Megatron TP 4 source over 2 query groups (split group blocks) into SGLang TP 8 over 2
# kv heads (replicated kv heads), with a padded vocab on both sides.
GQA = ModelConfig(vocab=50, hidden=8, layers=2, heads=8, kv_heads=2, head_dim=2,
                  intermediate=8, num_experts=4, moe_intermediate=8)
PINNED = (GQA, MegatronLayout(tp=4, pp=2, ep=2, vocab_multiple=32),
          SGLangLayout(tp=8, ep=2), 7, 0.3)
# The way back, tied embeddings on two stages, SGLang TP 4 > 2 kv heads as the sender.
TIED = attrs.evolve(GQA, num_experts=0, tie_word_embeddings=True)
BACK = (TIED, SGLangLayout(tp=4, vocab_padding=3), MegatronLayout(tp=2, pp=2), 3, 0.03)


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
