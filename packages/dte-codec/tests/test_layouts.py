"""The canonical space and the Hugging Face, Megatron-core and SGLang layouts, checked
by hand on tiny models whose canonical rows are labelled with their own row number."""

from __future__ import annotations

import types

import pytest
import torch
from dte_codec.errors import GeometryError
from dte_codec.geometry import materialize
from dte_codec.layouts import ModelConfig, canonical_tensors, hf_shard
from dte_codec.megatron_layout import MegatronLayout, MegatronRank, megatron_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard

# 4 query heads in 2 groups, head_dim 1: q_proj has rows q0..q3, k_proj k0 k1, v_proj v0 v1.
ATTN = ModelConfig(vocab=8, hidden=2, layers=2, heads=4, kv_heads=2, head_dim=1,
                   intermediate=4, tie_word_embeddings=False, dtype=torch.float32)
MOE = ModelConfig(vocab=50, hidden=2, layers=1, heads=4, kv_heads=2, head_dim=1,
                  num_experts=4, moe_intermediate=4, dtype=torch.float32)
QKV_TAG = {"q": 100, "k": 200, "v": 300}


def _labelled(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical tensors whose element [r, c] is ``tag + r`` (tags tell q, k, v, gate, up,
    down and experts apart); columns of a down projection carry the label instead."""
    out = {}
    for name, spec in canonical_tensors(config).items():
        tag = next((t for key, t in QKV_TAG.items() if f".{key}_proj" in name), 0)
        tag += {"gate_": 1000, "up_": 2000, "down_": 3000}.get(
            next((p for p in ("gate_", "up_", "down_") if p in name), ""), 0)
        tag += 10000 * int(name.split("experts.")[1].split(".")[0]) if "experts." in name else 0
        labels = torch.arange(spec.shape[0], dtype=torch.float32) + tag
        if "down_proj" in name:
            labels = torch.arange(spec.shape[-1], dtype=torch.float32) + tag
            out[name] = labels.expand(spec.shape).clone()
        else:
            out[name] = labels.view(-1, *(1,) * (len(spec.shape) - 1)).expand(spec.shape).clone()
    return out


def _first_column(tensor: torch.Tensor) -> list[int]:
    return tensor[..., 0].to(torch.int64).flatten().tolist()


def _megatron(config, layout, rank, name):
    return materialize(megatron_shard(config, layout, rank=rank), _labelled(config),
                       fill=-1)[name]


def _sglang(config, layout, rank, name):
    return materialize(sglang_shard(config, layout, rank=rank), _labelled(config), fill=-1)[name]


QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
SGL_QKV = "model.layers.0.self_attn.qkv_proj.weight"


def test_canonical_names_and_shapes_of_qwen3():
    """Dense Qwen3: Hugging Face names and full shapes, no lm_head when tied."""
    config = ModelConfig(vocab=10, hidden=4, layers=1, heads=4, kv_heads=2, head_dim=3,
                         intermediate=6, tie_word_embeddings=True)
    expected = {
        "model.embed_tokens.weight": (10, 4), "model.layers.0.input_layernorm.weight": (4,),
        "model.layers.0.self_attn.q_proj.weight": (12, 4),
        "model.layers.0.self_attn.k_proj.weight": (6, 4),
        "model.layers.0.self_attn.v_proj.weight": (6, 4),
        "model.layers.0.self_attn.o_proj.weight": (4, 12),
        "model.layers.0.self_attn.q_norm.weight": (3,),
        "model.layers.0.self_attn.k_norm.weight": (3,),
        "model.layers.0.post_attention_layernorm.weight": (4,),
        "model.layers.0.mlp.gate_proj.weight": (6, 4), "model.layers.0.mlp.up_proj.weight": (6, 4),
        "model.layers.0.mlp.down_proj.weight": (4, 6), "model.norm.weight": (4,)}
    assert expected == {n: s.shape for n, s in canonical_tensors(config).items()}


def test_canonical_experts_of_qwen3_moe():
    """Qwen3-MoE: the router and one gate/up/down triple per expert replace the dense MLP."""
    names = [n for n in canonical_tensors(MOE) if ".mlp." in n]
    assert ["model.layers.0.mlp.gate.weight"] + [
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(4)
        for p in ("gate", "up", "down")] == names
    assert (2, 4) == canonical_tensors(MOE)["model.layers.0.mlp.experts.3.down_proj.weight"].shape


def test_model_config_rejects_kv_heads_not_dividing_heads():
    """GQA needs kv_heads to divide heads."""
    with pytest.raises(GeometryError) as info:
        ModelConfig(heads=6, kv_heads=4)
    assert "model.kv_heads: expected a divisor of heads 6, got 4" == str(info.value)


def test_model_config_from_hf():
    """A transformers-like Qwen3-MoE config is read field by field."""
    hf = types.SimpleNamespace(vocab_size=64, hidden_size=8, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                               intermediate_size=16, num_experts=4, moe_intermediate_size=6,
                               tie_word_embeddings=False, mlp_only_layers=[],
                               decoder_sparse_step=1)
    expected = ModelConfig(vocab=64, hidden=8, layers=2, heads=4, kv_heads=2, head_dim=4,
                           intermediate=16, num_experts=4, moe_intermediate=6,
                           tie_word_embeddings=False)
    assert expected == ModelConfig.from_hf(hf)


def test_model_config_from_hf_rejects_dense_layers_in_moe():
    """A Qwen3-MoE config with dense layers is refused (the layouts assume all MoE)."""
    hf = types.SimpleNamespace(num_experts=4, mlp_only_layers=[1], decoder_sparse_step=1)
    with pytest.raises(GeometryError) as info:
        ModelConfig.from_hf(hf)
    assert ("mlp_only_layers, decoder_sparse_step: expected [] and 1 (every layer MoE), "
            "got [1], 1") == str(info.value)


def test_hf_shard_is_identity():
    """The Hugging Face layout is one rank holding every canonical tensor whole."""
    shard = hf_shard(ATTN)
    canonical = _labelled(ATTN)
    assert canonical_tensors(ATTN) == dict(shard.tensors)
    local = materialize(shard, canonical)
    assert all(torch.equal(canonical[n], local[n]) for n in canonical)


def test_megatron_rank_positions():
    """Ranks run TP fastest, then EP, then PP."""
    layout = MegatronLayout(tp=2, ep=2, pp=2)
    assert MegatronRank(pp=1, tp=1, ep=0) == layout.position(5)
    assert MegatronRank(pp=0, tp=0, ep=1) == layout.position(2)


def test_megatron_qkv_tp2_interleaves_groups():
    """TP 2, 4 heads in 2 groups: rank 0 holds [q0 q1 k0 v0], rank 1 [q2 q3 k1 v1]."""
    layout = MegatronLayout(tp=2)
    assert [100, 101, 200, 300] == _first_column(_megatron(ATTN, layout, 0, QKV))
    assert [102, 103, 201, 301] == _first_column(_megatron(ATTN, layout, 1, QKV))


def test_megatron_qkv_tp4_splits_a_group_block():
    """TP 4 > 2 groups: each rank holds half of one group's [q q k v] block."""
    layout = MegatronLayout(tp=4)
    held = [_first_column(_megatron(ATTN, layout, r, QKV)) for r in range(4)]
    assert [[100, 101], [200, 300], [102, 103], [201, 301]] == held


def test_megatron_mlp_tp2():
    """linear_fc1 holds [gate half; up half] of this rank; linear_fc2 the down columns."""
    layout = MegatronLayout(tp=2)
    fc1 = _megatron(ATTN, layout, 1, "decoder.layers.0.mlp.linear_fc1.weight")
    fc2 = _megatron(ATTN, layout, 1, "decoder.layers.0.mlp.linear_fc2.weight")
    assert [1002, 1003, 2002, 2003] == _first_column(fc1)
    assert [[3002, 3003], [3002, 3003]] == fc2.to(torch.int64).tolist()


def test_megatron_pipeline_stages_and_names():
    """PP 2 over 2 layers: the first stage has the embedding and layer 0, the last stage
    layer 1 (as its local layer 0), the final norm and the output layer."""
    layout = MegatronLayout(pp=2)
    first, last = (set(megatron_shard(ATTN, layout, rank=r).tensors) for r in (0, 1))
    layer = {f"decoder.layers.0.{s}.weight" for s in (
        "input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj",
        "self_attention.q_layernorm", "self_attention.k_layernorm", "pre_mlp_layernorm",
        "mlp.linear_fc1", "mlp.linear_fc2")}
    assert {"embedding.word_embeddings.weight"} | layer == first
    assert layer | {"decoder.final_layernorm.weight", "output_layer.weight"} == last
    pieces = megatron_shard(ATTN, layout, rank=1).pieces
    assert {"model.layers.1.input_layernorm.weight"} == {
        p.canonical for p in pieces if p.tensor == "decoder.layers.0.input_layernorm.weight"}


def test_megatron_tied_output_layer_is_a_non_sending_copy():
    """Tied embeddings: one stage has no output layer; with PP 2 the last stage's output
    layer holds the embedding but does not send it."""
    tied = ModelConfig(vocab=8, hidden=2, layers=2, heads=4, kv_heads=2, head_dim=1,
                       intermediate=4, tie_word_embeddings=True)
    assert "output_layer.weight" not in megatron_shard(tied, MegatronLayout(), rank=0).tensors
    pieces = megatron_shard(tied, MegatronLayout(pp=2), rank=1).pieces
    head = [p for p in pieces if p.tensor == "output_layer.weight"]
    assert [("model.embed_tokens.weight", False)] == [(p.canonical, p.primary) for p in head]


def test_megatron_experts_and_senders():
    """EP 2 over 4 experts: EP rank 1 (rank 3 with TP 2) holds experts 2 and 3 as local
    experts 0 and 1, and its TP rank 1 the second half of their rows;
    dense weights and the router are sent from EP rank 0, TP rank 0 only."""
    layout = MegatronLayout(tp=2, ep=2)
    fc1 = _megatron(MOE, layout, 3,
                    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
    assert [21002, 21003, 22002, 22003] == _first_column(fc1)
    senders = {(r, p.canonical) for r in range(4) for p in megatron_shard(
        MOE, layout, rank=r).pieces if p.primary and "experts" not in p.canonical}
    assert {0} == {r for r, name in senders if name.endswith("norm.weight") or ".gate." in name}
    assert {0, 1} == {r for r, name in senders if "q_proj" in name}


@pytest.mark.parametrize("config, layout, message", [
    (ATTN, MegatronLayout(tp=3), "megatron.tp: expected a divisor of heads 4, got 3"),
    (ModelConfig(heads=12, kv_heads=4), MegatronLayout(tp=6),
     "megatron.tp: expected a divisor or multiple of kv_heads 4, got 6"),
    (ATTN, MegatronLayout(tp=4, pp=3), "megatron.pp: expected a divisor of layers 2, got 3"),
    (ModelConfig(vocab=50, heads=4, kv_heads=2, intermediate=4), MegatronLayout(tp=4),
     "megatron.tp: expected a divisor of padded vocab 50, got 4"),
    (ModelConfig(vocab=8, heads=4, kv_heads=2, intermediate=6), MegatronLayout(tp=4),
     "megatron.tp: expected a divisor of intermediate 6, got 4"),
    (ModelConfig(vocab=8, num_experts=6), MegatronLayout(ep=4),
     "megatron.ep: expected a divisor of num_experts 6, got 4"),
    (ATTN, MegatronLayout(ep=2), "megatron.ep: expected 1 (a dense model), got 2"),
], ids=["heads", "groups", "layers", "vocab", "intermediate", "experts", "dense-ep"])
def test_megatron_rejects_uneven_splits(config, layout, message):
    """A split Megatron cannot make is rejected, naming the size and what it must divide."""
    with pytest.raises(GeometryError) as info:
        megatron_shard(config, layout, rank=0)
    assert message == str(info.value)


def test_megatron_pads_the_vocab_when_asked():
    """With ``vocab_multiple`` 64 a 50-row vocab becomes 64 rows, 32 per TP rank; rank 1
    holds rows 32..49 and 14 padding rows."""
    embed = _megatron(MOE, MegatronLayout(tp=2, vocab_multiple=64), 1,
                      "embedding.word_embeddings.weight")
    assert list(range(32, 50)) + [-1] * 14 == _first_column(embed)


def test_megatron_rejects_rank_out_of_range():
    """A rank past the world size is rejected."""
    with pytest.raises(GeometryError) as info:
        megatron_shard(ATTN, MegatronLayout(tp=2), rank=2)
    assert "megatron rank: expected inside [0, 2), got 2" == str(info.value)


def test_sglang_qkv_replicates_kv_heads():
    """TP 4 with 2 kv heads: rank r holds [q_r, k_(r//2), v_(r//2)]; the first of each
    pair of replicas sends."""
    layout = SGLangLayout(tp=4)
    held = [_first_column(_sglang(ATTN, layout, r, SGL_QKV)) for r in range(4)]
    assert [[100, 200, 300], [101, 200, 300], [102, 201, 301], [103, 201, 301]] == held
    primary = [sorted(p.canonical.split(".")[-2] for p in sglang_shard(ATTN, layout, rank=r)
                      .pieces if p.tensor == SGL_QKV and p.primary) for r in range(4)]
    assert [["k_proj", "q_proj", "v_proj"], ["q_proj"]] * 2 == primary


def test_sglang_qkv_tp2_groups_q_then_k_then_v():
    """TP 2: rank 1 holds [q2 q3 k1 v1], q rows first, unlike Megatron's per-group order."""
    assert [102, 103, 201, 301] == _first_column(_sglang(ATTN, SGLangLayout(tp=2), 1, SGL_QKV))


def test_sglang_mlp_and_names():
    """gate_up_proj holds [gate half; up half]; down_proj the down columns; names are
    SGLang's fused ones."""
    layout = SGLangLayout(tp=2)
    gate_up = _sglang(ATTN, layout, 0, "model.layers.0.mlp.gate_up_proj.weight")
    assert [1000, 1001, 2000, 2001] == _first_column(gate_up)
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
            "model.layers.0.post_attention_layernorm.weight"} == {
        n for n in sglang_shard(ATTN, layout, rank=0).tensors if ".layers.0." in n}


def test_sglang_fused_experts_with_ep():
    """TP 4, EP 2 (MoE-TP 2) over 4 experts of width 4: rank 3 is EP rank 1, MoE-TP rank 1,
    so w13[j] holds [gate; up] rows 2..3 and w2[j] down columns 2..3 of expert 2 + j."""
    layout = SGLangLayout(tp=4, ep=2)
    w13 = _sglang(MOE, layout, 3, "model.layers.0.mlp.experts.w13_weight")
    w2 = _sglang(MOE, layout, 3, "model.layers.0.mlp.experts.w2_weight")
    assert [21002, 21003, 22002, 22003, 31002, 31003, 32002, 32003] == _first_column(w13)
    assert [[[23002, 23003]] * 2, [[33002, 33003]] * 2] == w2.to(torch.int64).tolist()


@pytest.mark.parametrize("vocab, tp, per_rank, last", [
    (50, 4, 16, [48, 49] + [-1] * 14),
    (100, 8, 16, [-1] * 16),
    (50, 3, 64, [-1] * 64),
], ids=["pad-64", "empty-last-rank", "pad-64-times-tp"])
def test_sglang_vocab_padding(vocab, tp, per_rank, last):
    """SGLang pads the vocab to a multiple of 64 (of 64 * tp when 64 rows do not split
    evenly), gives each rank an equal slice in order, and leaves rows past the vocab as
    padding."""
    config = ModelConfig(vocab=vocab, hidden=2, layers=1, heads=24, kv_heads=1, head_dim=1,
                         intermediate=24, dtype=torch.float32)
    held = [_first_column(_sglang(config, SGLangLayout(tp=tp), r, "model.embed_tokens.weight"))
            for r in range(tp)]
    assert [per_rank] * tp == [len(h) for h in held]
    assert list(range(vocab)) == [v for h in held for v in h if v >= 0]
    assert last == held[-1]


@pytest.mark.parametrize("config, layout, message", [
    (ATTN, SGLangLayout(tp=3), "sglang.tp: expected a divisor of heads 4, got 3"),
    (ModelConfig(heads=12, kv_heads=4, intermediate=12), SGLangLayout(tp=6),
     "sglang.tp: expected a divisor or multiple of kv_heads 4, got 6"),
    (MOE, SGLangLayout(tp=2, ep=4), "sglang.ep: expected a divisor of tp 2, got 4"),
    (ModelConfig(num_experts=6, moe_intermediate=4), SGLangLayout(tp=4, ep=4),
     "sglang.ep: expected a divisor of num_experts 6, got 4"),
    (ModelConfig(num_experts=4, moe_intermediate=6), SGLangLayout(tp=4),
     "sglang.tp / sglang.ep: expected a divisor of moe_intermediate 6, got 4"),
    (ATTN, SGLangLayout(ep=2), "sglang.ep: expected 1 (a dense model), got 2"),
], ids=["heads", "groups", "ep-tp", "experts", "moe-intermediate", "dense-ep"])
def test_sglang_rejects_uneven_splits(config, layout, message):
    """A split SGLang cannot make is rejected, naming the size and what it must divide."""
    with pytest.raises(GeometryError) as info:
        sglang_shard(config, layout, rank=0)
    assert message == str(info.value)
