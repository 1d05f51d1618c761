"""Hypothesis strategies for layouts and plans: random Qwen3 / Qwen3-MoE models and the
Megatron, SGLang and Hugging Face layouts that can split them."""

from __future__ import annotations

import attrs
from dte_codec.errors import GeometryError
from dte_codec.geometry import Shard
from dte_codec.layouts import ModelConfig, hf_shard
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
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


# A Megatron TP 4 source over 2 query groups (split group blocks) into SGLang TP 8 over 2
# kv heads (replicated kv heads), with a padded vocab on both sides.
GQA = ModelConfig(vocab=50, hidden=8, layers=2, heads=8, kv_heads=2, head_dim=2,
                  intermediate=8, num_experts=4, moe_intermediate=8)
PINNED = (GQA, MegatronLayout(tp=4, pp=2, ep=2, vocab_multiple=32),
          SGLangLayout(tp=8, ep=2), 7, 0.3)
# The way back, tied embeddings on two stages, SGLang TP 4 > 2 kv heads as the sender.
TIED = attrs.evolve(GQA, num_experts=0, tie_word_embeddings=True)
BACK = (TIED, SGLangLayout(tp=4, vocab_padding=3), MegatronLayout(tp=2, pp=2), 3, 0.03)
