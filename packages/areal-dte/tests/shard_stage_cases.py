"""The models, weights, cases, receiver pairs and deltas shared by the ShardStage tests
(``test_shard_stage`` and the kernel tests ``test_shard_stage_routes``,
``test_shard_stage_copies``, ``test_shard_stage_queued``): SGLang ranks fed by Hugging
Face- and Megatron-layout senders, each rank a reference receiver on the CPU beside one on
``kernel_mode.DEVICE``.
"""

from __future__ import annotations

import torch
from kernel_mode import DEVICE
from areal_dte.shard_stage import ShardStage
from dte_codec import encode_delta
from dte_codec.geometry import materialize
from dte_codec.layouts import ModelConfig, canonical_tensors, hf_shard
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.sglang_layout import SGLangLayout
from dte_detector import diff
from dte_transport import Receiver

PADDING = -7.0
"""What vocab padding rows hold before the first sync; no payload may touch them."""

DENSE = ModelConfig(vocab=37, hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4,
                    intermediate=8, tie_word_embeddings=False)
MOE = ModelConfig(vocab=21, hidden=8, layers=1, heads=4, kv_heads=1, head_dim=2,
                  num_experts=4, moe_intermediate=4, tie_word_embeddings=True)


def canonical_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random canonical tensors of ``config``, the same for the same ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(spec.shape, generator=gen) * 0.05).to(spec.dtype)
            for name, spec in canonical_tensors(config).items()}


def stepped(weights: dict[str, torch.Tensor], seed: int, rate: float) -> dict[str, torch.Tensor]:
    """Move a ``rate`` share of elements, most by one ulp, some far (raw escapes)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        bits = tensor.clone().view(torch.int16).view(-1)
        moved = torch.rand(bits.shape, generator=gen) < rate
        jump = torch.randint(-3, 4, bits.shape, generator=gen, dtype=torch.int16)
        jump = torch.where(torch.rand(bits.shape, generator=gen) < 0.1, jump * 1000, jump)
        bits[moved] += jump[moved]
        out[name] = bits.view(torch.bfloat16).view(tensor.shape)
    return out


CASES = [(DENSE, SGLangLayout(), "hf"), (DENSE, SGLangLayout(tp=2, vocab_padding=3), "hf"),
         (MOE, SGLangLayout(tp=2, ep=2), "hf"), (DENSE, SGLangLayout(tp=2), "megatron"),
         (MOE, SGLangLayout(tp=2), "megatron")]
IDS = [f"{'moe' if c.is_moe else 'dense'}-tp{l.tp}-ep{l.ep}-pad{l.vocab_padding}-{s}"
       for c, l, s in CASES]


def source_shard(config, kind: str):
    """The sender's shard of ``config``: Hugging Face's (``kind`` "hf"), or Megatron's
    rank 0."""
    return hf_shard(config) if kind == "hf" else megatron_shard(config, MegatronLayout(), rank=0)


def receiver_pair(source, shard, canonical):
    """A reference receiver on the CPU and a routed one on ``DEVICE`` for ``shard``, both
    holding a full load of ``canonical`` at version 1."""
    out = []
    for device in ("cpu", DEVICE):
        local = {n: t.to(device) for n, t in
                 materialize(shard, canonical, fill=PADDING).items()}
        receiver = Receiver(local, stage=ShardStage.of(source, shard, local))
        receiver.version, receiver.stream_id = 1, "s"
        out.append(receiver)
    return out[0], out[1]


def delta_frame(source, old, new):
    """The delta from canonical ``old`` (version 1) to ``new`` (version 2) as sent by
    ``source``."""
    before, after = materialize(source, old), materialize(source, new)
    return encode_delta(after, {n: diff(before[n], after[n]) for n in after}, stream_id="s",
                        base_version=1, version=2)


def on_cpu(weights):
    """``weights`` copied to the CPU."""
    return {n: t.cpu() for n, t in weights.items()}
