"""The canonical space of Qwen3 and Qwen3-MoE, and the Hugging Face layout of it.

``ModelConfig`` holds the few numbers that fix every weight's name and full shape;
``canonical_tensors`` lists them under their Hugging Face names, and ``hf_shard`` is the
one-rank layout that holds each of them whole. The trainer and rollout layouts
(``megatron_layout``, ``sglang_layout``) describe their shards in this space.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from attrs.validators import ge, instance_of

from .errors import GeometryError
from .geometry import Box, Piece, Shard, TensorSpec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer(i: int, suffix: str) -> str:
    """The Hugging Face name of a weight of decoder layer ``i``."""
    return f"model.layers.{i}.{suffix}"


def expert(i: int, e: int, proj: str) -> str:
    """The Hugging Face name of expert ``e``'s ``proj`` (gate/up/down) in layer ``i``."""
    return layer(i, f"mlp.experts.{e}.{proj}_proj.weight")


def _positive(default: int):
    return attrs.field(default=default, validator=[instance_of(int), ge(1)])


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The shape of a Qwen3 (``num_experts == 0``) or Qwen3-MoE model (every layer MoE);
    the defaults are Qwen3-0.6B's."""

    vocab: int = _positive(151936)
    """Vocabulary size (rows of the embedding and of the LM head)."""
    hidden: int = _positive(1024)
    """Hidden size H."""
    layers: int = _positive(28)
    """Number of decoder layers."""
    heads: int = _positive(16)
    """Query heads."""
    kv_heads: int = _positive(8)
    """Key/value heads (query groups); must divide ``heads``."""
    head_dim: int = _positive(128)
    """Channels per head."""
    intermediate: int = _positive(3072)
    """Dense MLP width (ignored by a MoE model, whose every layer is MoE)."""
    num_experts: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    """Routed experts per layer; 0: a dense Qwen3."""
    moe_intermediate: int = _positive(768)
    """Width of one expert's MLP."""
    tie_word_embeddings: bool = attrs.field(default=True, validator=instance_of(bool))
    """The LM head is the embedding (no ``lm_head.weight`` of its own)."""
    dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=instance_of(torch.dtype))
    """Dtype of every weight."""

    def __attrs_post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise GeometryError("model.kv_heads", expected=f"a divisor of heads {self.heads}",
                                got=self.kv_heads)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, hf: Any, *, dtype: torch.dtype = torch.bfloat16) -> ModelConfig:
        """Read a ``transformers`` ``Qwen3Config`` or ``Qwen3MoeConfig`` (duck-typed).

        Raises:
            GeometryError: the MoE config has dense layers (``mlp_only_layers``,
                ``decoder_sparse_step``), which these layouts do not describe.
        """
        experts = getattr(hf, "num_experts", 0) or 0
        if experts and (getattr(hf, "mlp_only_layers", None) or
                        getattr(hf, "decoder_sparse_step", 1) != 1):
            raise GeometryError("mlp_only_layers, decoder_sparse_step",
                                expected="[] and 1 (every layer MoE)",
                                got=f"{hf.mlp_only_layers}, {hf.decoder_sparse_step}")
        return cls(vocab=hf.vocab_size, hidden=hf.hidden_size, layers=hf.num_hidden_layers,
                   heads=hf.num_attention_heads, kv_heads=hf.num_key_value_heads,
                   head_dim=getattr(hf, "head_dim", None) or
                   hf.hidden_size // hf.num_attention_heads,
                   intermediate=hf.intermediate_size, num_experts=experts,
                   moe_intermediate=getattr(hf, "moe_intermediate_size", None) or 1,
                   tie_word_embeddings=bool(hf.tie_word_embeddings), dtype=dtype)


def canonical_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every weight of the model under its Hugging Face name, with its full shape."""
    h, d = config.hidden, config.head_dim

    def spec(*shape: int) -> TensorSpec:
        return TensorSpec(shape, config.dtype)

    out = {EMBED: spec(config.vocab, h)}
    for i in range(config.layers):
        out[layer(i, "input_layernorm.weight")] = spec(h)
        out[layer(i, "self_attn.q_proj.weight")] = spec(config.heads * d, h)
        out[layer(i, "self_attn.k_proj.weight")] = spec(config.kv_heads * d, h)
        out[layer(i, "self_attn.v_proj.weight")] = spec(config.kv_heads * d, h)
        out[layer(i, "self_attn.o_proj.weight")] = spec(h, config.heads * d)
        out[layer(i, "self_attn.q_norm.weight")] = spec(d)
        out[layer(i, "self_attn.k_norm.weight")] = spec(d)
        out[layer(i, "post_attention_layernorm.weight")] = spec(h)
        if config.is_moe:
            out[layer(i, "mlp.gate.weight")] = spec(config.num_experts, h)
            for e in range(config.num_experts):
                out[expert(i, e, "gate")] = spec(config.moe_intermediate, h)
                out[expert(i, e, "up")] = spec(config.moe_intermediate, h)
                out[expert(i, e, "down")] = spec(h, config.moe_intermediate)
        else:
            out[layer(i, "mlp.gate_proj.weight")] = spec(config.intermediate, h)
            out[layer(i, "mlp.up_proj.weight")] = spec(config.intermediate, h)
            out[layer(i, "mlp.down_proj.weight")] = spec(h, config.intermediate)
    out[FINAL_NORM] = spec(h)
    if not config.tie_word_embeddings:
        out[LM_HEAD] = spec(config.vocab, h)
    return out


def hf_shard(config: ModelConfig) -> Shard:
    """The Hugging Face layout: one rank (0) holding every canonical tensor whole."""
    tensors = canonical_tensors(config)
    pieces = [Piece(tensor=name, local=Box.whole(spec.shape), canonical=name,
                    region=Box.whole(spec.shape)) for name, spec in tensors.items()]
    return Shard(rank=0, tensors=tensors, pieces=pieces)


def divisor(value: int, size: int, *, field: str, of: str) -> int:
    """``value // size``, or ``GeometryError`` naming both when ``size`` does not divide it."""
    if value % size:
        raise GeometryError(field, expected=f"a divisor of {of} {value}", got=size)
    return value // size


def vocab_rows(vocab: int, per_rank: int, rank: int) -> tuple[int, int]:
    """First canonical row and row count of a rank's vocab slice of ``per_rank`` rows;
    local rows past the count are padding (beyond ``vocab``)."""
    start = min(rank * per_rank, vocab)
    return start, min(per_rank, vocab - start)


def rows(shape: tuple[int, ...], start: int, count: int, *, lead: tuple[int, ...] = ()) -> Box:
    """Rows ``[start, start + count)`` of a matrix of ``shape`` (its last two dims), all
    columns, at index ``lead`` of the leading dims."""
    return Box(lead + (start, 0), (1,) * len(lead) + (count, shape[-1]))


def cols(shape: tuple[int, ...], start: int, count: int, *, lead: tuple[int, ...] = ()) -> Box:
    """Columns ``[start, start + count)`` of a matrix of ``shape``, all rows."""
    return Box(lead + (0, start), (1,) * len(lead) + (shape[-2], count))


class ShardBuilder:
    """Collects one rank's local tensors and pieces (used by the layout modules)."""

    def __init__(self, rank: int, dtype: torch.dtype):
        self.rank, self.dtype = rank, dtype
        self.tensors: dict[str, TensorSpec] = {}
        self.pieces: list[Piece] = []

    def tensor(self, name: str, *shape: int) -> tuple[int, ...]:
        self.tensors[name] = TensorSpec(shape, self.dtype)
        return shape

    def piece(self, tensor: str, local: Box, canonical: str, region: Box, *,
              primary: bool = True) -> None:
        self.pieces.append(Piece(tensor=tensor, local=local, canonical=canonical,
                                 region=region, primary=primary))

    def whole(self, tensor: str, canonical: str, *shape: int, primary: bool) -> None:
        """A local tensor that is a whole canonical one (norms, routers)."""
        self.tensor(tensor, *shape)
        self.piece(tensor, Box.whole(shape), canonical, Box.whole(shape), primary=primary)

    def vocab(self, tensor: str, canonical: str, config: ModelConfig, *, per_rank: int,
              tp_rank: int, primary: bool) -> None:
        """A vocab-parallel ``[per_rank, H]`` slice; rows past the vocab stay padding."""
        shape = self.tensor(tensor, per_rank, config.hidden)
        start, count = vocab_rows(config.vocab, per_rank, tp_rank)
        if count > 0:
            self.piece(tensor, rows(shape, 0, count), canonical,
                       rows((config.vocab, config.hidden), start, count), primary=primary)

    def gated_mlp(self, fc1: str, fc2: str, canonical: tuple[str, str, str], *, width: int,
                  part: int, parts: int, lead: tuple[int, ...] = (), primary: bool) -> None:
        """A TP-split gated MLP of ``width`` (already-added local tensors): the rows of
        ``fc1`` hold [gate part; up part], the columns of ``fc2`` the down part."""
        gate, up, down = canonical
        fc1_shape, fc2_shape = self.tensors[fc1].shape, self.tensors[fc2].shape
        n, h = width // parts, fc1_shape[-1]
        self.piece(fc1, rows(fc1_shape, 0, n, lead=lead), gate, rows((width, h), part * n, n),
                   primary=primary)
        self.piece(fc1, rows(fc1_shape, n, n, lead=lead), up, rows((width, h), part * n, n),
                   primary=primary)
        self.piece(fc2, cols(fc2_shape, 0, n, lead=lead), down, cols((h, width), part * n, n),
                   primary=primary)

    def build(self) -> Shard:
        return Shard(rank=self.rank, tensors=self.tensors, pieces=self.pieces)


def size_field(default: int = 1):
    """An attrs field for a parallel size or padding multiple: an int >= 1."""
    return attrs.field(default=default, validator=[instance_of(int), ge(1)])
