"""The SGLang rollout's shards (Qwen3ForCausalLM / Qwen3MoeForCausalLM, sglang 0.5.23).

One TP group of ``tp`` ranks, no PP, no attention DP. For MoE the group is split as
SGLang does with ``moe_dp_size`` 1: ``moe_tp = tp / ep``, rank r has MoE-EP rank
``r // moe_tp`` and MoE-TP rank ``r % moe_tp``.

Geometry per rank r:

- ``model.embed_tokens.weight`` and ``lm_head.weight``: ``[Vp/tp, H]``, where ``Vp`` is
  the vocab rounded up to ``vocab_padding`` (64), or to ``vocab_padding * tp`` when that
  would not split evenly; rank r holds rows ``[r*Vp/tp, ...)`` cut at the vocab, the
  rest is padding that nothing writes. With tied embeddings there is no ``lm_head``.
- ``qkv_proj``: [q rows of heads r*nh/tp...; k rows; v rows]; with tp > kv_heads each
  rank holds kv head ``r * kv_heads // tp`` (replicated on ``tp / kv_heads`` ranks).
- ``o_proj``, ``down_proj``: split on columns; ``gate_up_proj``: [gate part; up part].
- norms and the router (``mlp.gate``) are whole on every rank.
- ``experts.w13_weight[j]`` = [gate part; up part] and ``experts.w2_weight[j]`` = down
  part of expert ``ep_rank * E/ep + j``, each part split ``moe_tp`` ways.

Only the first holder of a replicated region is primary (sends when SGLang is a source).
"""

from __future__ import annotations

import attrs

from .errors import GeometryError
from .geometry import Shard
from .layouts import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    ModelConfig,
    ShardBuilder,
    cols,
    divisor,
    expert,
    layer,
    rows,
    size_field,
)

DEFAULT_VOCAB_PADDING = 64
"""SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``."""




@attrs.frozen(kw_only=True)
class SGLangLayout:
    """SGLang parallel sizes of one rollout engine."""

    tp: int = size_field()
    """Tensor-parallel size."""
    ep: int = size_field()
    """Expert-parallel size inside the TP group (MoE only); must divide ``tp``."""
    vocab_padding: int = size_field(DEFAULT_VOCAB_PADDING)
    """The vocab-parallel layers' padding size."""

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def padded_vocab(self, config: ModelConfig) -> int:
        padding = self.vocab_padding
        if _round_up(config.vocab, padding) % self.tp:
            padding *= self.tp
        return _round_up(config.vocab, padding)

    def check(self, config: ModelConfig) -> None:
        """Raise ``GeometryError`` unless SGLang can split ``config`` this way."""
        tp = self.tp
        divisor(config.heads, tp, field="sglang.tp", of="heads")
        if config.kv_heads % tp and tp % config.kv_heads:
            raise GeometryError("sglang.tp", got=tp, expected=(
                f"a divisor or multiple of kv_heads {config.kv_heads}"))
        if config.is_moe:
            divisor(tp, self.ep, field="sglang.ep", of="tp")
            divisor(config.num_experts, self.ep, field="sglang.ep", of="num_experts")
            divisor(config.moe_intermediate, self.moe_tp, field="sglang.tp / sglang.ep",
                    of="moe_intermediate")
        else:
            divisor(config.intermediate, tp, field="sglang.tp", of="intermediate")
            if self.ep != 1:
                raise GeometryError("sglang.ep", expected="1 (a dense model)", got=self.ep)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sglang_shard(config: ModelConfig, layout: SGLangLayout, *, rank: int) -> Shard:
    """The local tensors of SGLang TP rank ``rank`` and the canonical pieces they hold.

    Raises:
        GeometryError: ``layout`` cannot split ``config`` or ``rank`` is out of range.
    """
    layout.check(config)
    if not 0 <= rank < layout.tp:
        raise GeometryError("sglang rank", expected=f"inside [0, {layout.tp})", got=rank)
    out = ShardBuilder(rank, config.dtype)
    per_rank_vocab = layout.padded_vocab(config) // layout.tp
    out.vocab(EMBED, EMBED, config, per_rank=per_rank_vocab, tp_rank=rank, primary=True)
    for i in range(config.layers):
        _layer(out, config, layout, rank=rank, i=i)
    out.whole(FINAL_NORM, FINAL_NORM, config.hidden, primary=rank == 0)
    if not config.tie_word_embeddings:
        out.vocab(LM_HEAD, LM_HEAD, config, per_rank=per_rank_vocab, tp_rank=rank,
                  primary=True)
    return out.build()


def _layer(out: ShardBuilder, config: ModelConfig, layout: SGLangLayout, *, rank: int,
           i: int) -> None:
    h, d, first = config.hidden, config.head_dim, rank == 0
    for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out.whole(layer(i, norm), layer(i, norm), h, primary=first)
    for norm in ("q_norm", "k_norm"):
        name = layer(i, f"self_attn.{norm}.weight")
        out.whole(name, name, d, primary=first)
    _qkv(out, config, layout.tp, rank, i=i)
    o_proj = layer(i, "self_attn.o_proj.weight")
    shape = out.tensor(o_proj, h, config.heads * d // layout.tp)
    out.piece(o_proj, cols(shape, 0, shape[1]), o_proj,
              cols((h, config.heads * d), rank * shape[1], shape[1]))
    if config.is_moe:
        _experts(out, config, layout, rank=rank, i=i)
        return
    gate_up, down = layer(i, "mlp.gate_up_proj.weight"), layer(i, "mlp.down_proj.weight")
    part = config.intermediate // layout.tp
    out.tensor(gate_up, 2 * part, h)
    out.tensor(down, h, part)
    out.gated_mlp(gate_up, down, tuple(layer(i, f"mlp.{p}_proj.weight")
                                       for p in ("gate", "up", "down")),
                  width=config.intermediate, part=rank, parts=layout.tp, primary=True)


def _qkv(out: ShardBuilder, config: ModelConfig, tp: int, rank: int, *, i: int) -> None:
    d, h = config.head_dim, config.hidden
    heads = config.heads // tp
    kv_heads = max(1, config.kv_heads // tp)
    replicas = max(1, tp // config.kv_heads)
    kv_first = rank // replicas * kv_heads
    name = layer(i, "self_attn.qkv_proj.weight")
    shape = out.tensor(name, (heads + 2 * kv_heads) * d, h)
    out.piece(name, rows(shape, 0, heads * d), layer(i, "self_attn.q_proj.weight"),
              rows((config.heads * d, h), rank * heads * d, heads * d))
    for k, part in enumerate(("k", "v")):
        out.piece(name, rows(shape, (heads + k * kv_heads) * d, kv_heads * d),
                  layer(i, f"self_attn.{part}_proj.weight"),
                  rows((config.kv_heads * d, h), kv_first * d, kv_heads * d),
                  primary=rank % replicas == 0)


def _experts(out: ShardBuilder, config: ModelConfig, layout: SGLangLayout, *, rank: int,
             i: int) -> None:
    gate = layer(i, "mlp.gate.weight")
    out.whole(gate, gate, config.num_experts, config.hidden, primary=rank == 0)
    local_count = config.num_experts // layout.ep
    ep_rank, moe_tp_rank = rank // layout.moe_tp, rank % layout.moe_tp
    part = config.moe_intermediate // layout.moe_tp
    w13, w2 = layer(i, "mlp.experts.w13_weight"), layer(i, "mlp.experts.w2_weight")
    out.tensor(w13, local_count, 2 * part, config.hidden)
    out.tensor(w2, local_count, config.hidden, part)
    for j in range(local_count):
        e = ep_rank * local_count + j
        out.gated_mlp(w13, w2, tuple(expert(i, e, p) for p in ("gate", "up", "down")),
                      width=config.moe_intermediate, part=moe_tp_rank, parts=layout.moe_tp,
                      lead=(j,), primary=True)

