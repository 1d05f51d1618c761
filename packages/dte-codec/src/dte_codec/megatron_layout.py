"""The Megatron-core trainer's shards (GPTModel, local layer spec, megatron-core 0.16).

Ranks are numbered TP fastest, then EP, then PP: Megatron's default order
``tp-cp-ep-dp-pp`` with CP 1 and one expert-parallel replica of the model (DP == EP);
expert TP equals TP (Megatron's default). Names are those of a bare ``GPTModel``
(wrappers such as ``Float16Module``/DDP add a ``module.`` prefix the caller strips).

Geometry per rank (stage ``pp``, TP rank ``t``, EP rank ``x``):

- ``embedding.word_embeddings.weight`` (first stage) and ``output_layer.weight`` (last
  stage): vocab-parallel ``[Vp/tp, H]``; ``Vp`` is the vocab rounded up to
  ``vocab_multiple``; rows past the vocab are padding. With tied embeddings and PP > 1
  the last stage keeps its own copy of the embedding (not a sender).
- ``linear_qkv``: the column-parallel split of the rows of ``[q_g; k_g; v_g]`` for every
  query group g in order; with TP > groups a rank holds part of one group's block.
- ``linear_proj``, ``linear_fc2``: split on columns; ``linear_fc1``: [gate part; up part].
- norms and the router are whole on every TP rank; dense weights repeat on every EP
  rank. Only EP rank 0 sends dense weights, and only TP rank 0 sends replicated ones.
- expert e sits on EP rank ``e // (E/ep)`` as ``local_experts.{e % (E/ep)}``.
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




@attrs.frozen
class MegatronRank:
    """Where a rank sits: pipeline stage, tensor-parallel rank, expert-parallel rank."""

    pp: int
    tp: int
    ep: int


@attrs.frozen(kw_only=True)
class MegatronLayout:
    """Megatron-core parallel sizes of the trainer."""

    tp: int = size_field()
    """Tensor-parallel size (also the expert tensor-parallel size)."""
    pp: int = size_field()
    """Pipeline stages; each holds ``layers / pp`` consecutive layers."""
    ep: int = size_field()
    """Expert-parallel size (MoE only)."""
    vocab_multiple: int = size_field()
    """Pad the vocab to a multiple of this before the TP split (Megatron-LM: its
    ``make_vocab_size_divisible_by * tp``; a bare GPTModel as AReaL builds it: 1)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.ep * self.pp

    def position(self, rank: int) -> MegatronRank:
        """The (stage, TP rank, EP rank) of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise GeometryError("megatron rank", expected=f"inside [0, {self.world_size})",
                                got=rank)
        return MegatronRank(pp=rank // (self.tp * self.ep), tp=rank % self.tp,
                            ep=rank // self.tp % self.ep)

    def padded_vocab(self, config: ModelConfig) -> int:
        return -(-config.vocab // self.vocab_multiple) * self.vocab_multiple

    def check(self, config: ModelConfig) -> None:
        """Raise ``GeometryError`` unless Megatron can split ``config`` this way."""
        tp = self.tp
        divisor(config.heads, tp, field="megatron.tp", of="heads")
        if config.kv_heads % tp and tp % config.kv_heads:
            raise GeometryError("megatron.tp", got=tp, expected=(
                f"a divisor or multiple of kv_heads {config.kv_heads}"))
        qkv_rows = (config.heads + 2 * config.kv_heads) * config.head_dim
        divisor(qkv_rows, tp, field="megatron.tp", of="linear_qkv rows")
        divisor(self.padded_vocab(config), tp, field="megatron.tp", of="padded vocab")
        divisor(config.layers, self.pp, field="megatron.pp", of="layers")
        if config.is_moe:
            divisor(config.moe_intermediate, tp, field="megatron.tp", of="moe_intermediate")
            divisor(config.num_experts, self.ep, field="megatron.ep", of="num_experts")
        else:
            divisor(config.intermediate, tp, field="megatron.tp", of="intermediate")
            if self.ep != 1:
                raise GeometryError("megatron.ep", expected="1 (a dense model)", got=self.ep)


def megatron_shard(config: ModelConfig, layout: MegatronLayout, *, rank: int) -> Shard:
    """The local tensors of Megatron rank ``rank`` and the canonical pieces they hold.

    Raises:
        GeometryError: ``layout`` cannot split ``config`` or ``rank`` is out of range.
    """
    layout.check(config)
    where = layout.position(rank)
    out = ShardBuilder(rank, config.dtype)
    dense = where.ep == 0
    per_rank_vocab = layout.padded_vocab(config) // layout.tp
    stage_layers = config.layers // layout.pp
    if where.pp == 0:
        out.vocab("embedding.word_embeddings.weight", EMBED, config,
                  per_rank=per_rank_vocab, tp_rank=where.tp, primary=dense)
    for local in range(stage_layers):
        _layer(out, config, layout, where, local=local, i=where.pp * stage_layers + local)
    if where.pp == layout.pp - 1:
        out.whole("decoder.final_layernorm.weight", FINAL_NORM, config.hidden,
                  primary=dense and where.tp == 0)
        if not config.tie_word_embeddings:
            out.vocab("output_layer.weight", LM_HEAD, config, per_rank=per_rank_vocab,
                      tp_rank=where.tp, primary=dense)
        elif layout.pp > 1:  # a tied head on one stage is the embedding itself
            out.vocab("output_layer.weight", EMBED, config, per_rank=per_rank_vocab,
                      tp_rank=where.tp, primary=False)
    return out.build()


def _layer(out: ShardBuilder, config: ModelConfig, layout: MegatronLayout,
           where: MegatronRank, *, local: int, i: int) -> None:
    prefix = f"decoder.layers.{local}."
    dense = where.ep == 0
    replicated = dense and where.tp == 0
    h, d = config.hidden, config.head_dim
    out.whole(prefix + "input_layernorm.weight", layer(i, "input_layernorm.weight"), h,
              primary=replicated)
    _qkv(out, config, layout.tp, where.tp, tensor=prefix + "self_attention.linear_qkv.weight",
         i=i, primary=dense)
    proj = out.tensor(prefix + "self_attention.linear_proj.weight", h,
                      config.heads * d // layout.tp)
    out.piece(prefix + "self_attention.linear_proj.weight", cols(proj, 0, proj[1]),
              layer(i, "self_attn.o_proj.weight"),
              cols((h, config.heads * d), where.tp * proj[1], proj[1]), primary=dense)
    for norm in ("q", "k"):
        out.whole(prefix + f"self_attention.{norm}_layernorm.weight",
                  layer(i, f"self_attn.{norm}_norm.weight"), d, primary=replicated)
    out.whole(prefix + "pre_mlp_layernorm.weight", layer(i, "post_attention_layernorm.weight"),
              h, primary=replicated)
    if config.is_moe:
        _experts(out, config, layout, where, prefix=prefix, i=i)
    else:
        _fc(out, prefix + "mlp.", tuple(layer(i, f"mlp.{p}_proj.weight")
                                        for p in ("gate", "up", "down")),
            width=config.intermediate, hidden=h, layout=layout, where=where, primary=dense)


def _qkv(out: ShardBuilder, config: ModelConfig, tp: int, tp_rank: int, *, tensor: str,
         i: int, primary: bool) -> None:
    """Clip the full interleaved ``[q_g; k_g; v_g]`` row sequence to this rank's rows."""
    d, h = config.head_dim, config.hidden
    per_group = config.heads // config.kv_heads
    total = (config.heads + 2 * config.kv_heads) * d
    shape = out.tensor(tensor, total // tp, h)
    low, high = tp_rank * shape[0], (tp_rank + 1) * shape[0]
    for g in range(config.kv_heads):
        base = g * (per_group + 2) * d
        segments = ((base, "q", g * per_group * d, per_group * d, config.heads),
                    (base + per_group * d, "k", g * d, d, config.kv_heads),
                    (base + (per_group + 1) * d, "v", g * d, d, config.kv_heads))
        for row, name, canonical_row, count, heads in segments:
            start, stop = max(row, low), min(row + count, high)
            if start < stop:
                out.piece(tensor, rows(shape, start - low, stop - start),
                          layer(i, f"self_attn.{name}_proj.weight"),
                          rows((heads * d, h), canonical_row + start - row, stop - start),
                          primary=primary)


def _fc(out: ShardBuilder, prefix: str, canonical: tuple[str, str, str], *, width: int,
        hidden: int, layout: MegatronLayout, where: MegatronRank, primary: bool) -> None:
    part = width // layout.tp
    out.tensor(prefix + "linear_fc1.weight", 2 * part, hidden)
    out.tensor(prefix + "linear_fc2.weight", hidden, part)
    out.gated_mlp(prefix + "linear_fc1.weight", prefix + "linear_fc2.weight", canonical,
                  width=width, part=where.tp, parts=layout.tp, primary=primary)


def _experts(out: ShardBuilder, config: ModelConfig, layout: MegatronLayout,
             where: MegatronRank, *, prefix: str, i: int) -> None:
    out.whole(prefix + "mlp.router.weight", layer(i, "mlp.gate.weight"), config.num_experts,
              config.hidden, primary=where.ep == 0 and where.tp == 0)
    local_count = config.num_experts // layout.ep
    for j in range(local_count):
        e = where.ep * local_count + j
        _fc(out, prefix + f"mlp.experts.local_experts.{j}.",
            tuple(expert(i, e, p) for p in ("gate", "up", "down")),
            width=config.moe_intermediate, hidden=config.hidden, layout=layout, where=where,
            primary=True)
