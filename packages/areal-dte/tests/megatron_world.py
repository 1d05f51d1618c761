"""What each spawned rank runs in the megatron-core geometry tests (gloo on CPU).

Every rank builds megatron-core's own ``GPTModel`` (local layer spec) at its TP rank and
checks ``dte_codec.megatron_layout`` against it: the same parameter names and shapes, and
a change set taken in Megatron's layout that, remapped through the geometry into SGLang's
layout, gives the same bytes as converting the whole new tensors. The target tensors are
assembled over the group by an all-reduce of bit patterns: the ranks' primary pieces are
disjoint, so sums of integers are exact.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dte_codec.geometry import plan
from dte_codec.layouts import ModelConfig
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.remap import copy_slices, remap
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_detector import diff
from dte_detector.changes import int_bits

DENSE = ModelConfig(vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                    intermediate=64, tie_word_embeddings=False)
MOE = ModelConfig(vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                  num_experts=4, moe_intermediate=16, tie_word_embeddings=False)


def gpt_model(config: ModelConfig):
    """megatron-core's GPTModel for ``config`` at this process's TP rank, on the CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = {"num_moe_experts": config.num_experts, "moe_ffn_hidden_size": config.moe_intermediate,
           "moe_router_topk": 2} if config.is_moe else {}
    transformer = TransformerConfig(
        num_layers=config.layers, hidden_size=config.hidden, ffn_hidden_size=config.intermediate,
        num_attention_heads=config.heads, num_query_groups=config.kv_heads,
        kv_channels=config.head_dim, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, init_method_std=0.02, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=dist.get_world_size(), **moe)
    spec = get_gpt_layer_local_spec(num_experts=config.num_experts or None,
                                    moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    return GPTModel(transformer, spec, vocab_size=config.vocab, max_sequence_length=16,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _assembled(tensors: dict) -> dict:
    """Each rank's disjoint contributions summed over the group, as exact bit patterns."""
    out = {}
    for key, tensor in tensors.items():
        bits = int_bits(tensor).to(torch.int64)
        dist.all_reduce(bits)
        out[key] = bits.to(int_bits(tensor).dtype).view(tensor.dtype)
    return out


def run(rank: int, world: int, init: str, config: ModelConfig, rollout_tp: int,
        log_dir: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(rank)
    shard = megatron_shard(config, MegatronLayout(tp=world), rank=rank)
    model = {n: p.detach() for n, p in gpt_model(config).named_parameters()}
    layout = {n: tuple(s.shape) for n, s in shard.tensors.items()}
    lines = [f"names and shapes equal: {layout == {n: tuple(p.shape) for n, p in model.items()}}"]
    old = {n: model[n].to(spec.dtype) for n, spec in shard.tensors.items()}
    gen = torch.Generator().manual_seed(100 + rank)
    new = {n: (t.float() * (1 + 0.05 * (torch.rand(t.shape, generator=gen) < 0.1))).to(t.dtype)
           for n, t in old.items()}  # about 10 % of the elements move, as after a step
    targets = [sglang_shard(config, SGLangLayout(tp=rollout_tp), rank=r) for r in range(rollout_tp)]
    transfers = plan(shard, targets)

    def zeros():
        return {(t.rank, n): torch.zeros(s.shape, dtype=s.dtype) for t in targets
                for n, s in t.tensors.items()}
    dense_old, dense_new, moved, mask = zeros(), zeros(), zeros(), zeros()
    changed = 0
    for name in shard.tensors:
        copy_slices(transfers[name], old[name], dense_old, tensor=name)
        copy_slices(transfers[name], new[name], dense_new, tensor=name)
        change = diff(old[name], new[name])
        changed += len(change)
        values = new[name].reshape(-1)[change.indices.to(torch.int64)]
        for key, routed in remap(transfers[name], tuple(old[name].shape), change.indices,
                                 tensor=name).items():
            moved[key].view(-1)[routed.indices.to(torch.int64)] = values[routed.positions]
            mask[key].view(-1)[routed.indices.to(torch.int64)] = 1
    dense_old, dense_new, moved, mask = (_assembled(t) for t in (dense_old, dense_new, moved,
                                                                  mask))
    same = all(torch.equal(torch.where(mask[k] != 0, moved[k], dense_old[k])
                           .view(int_bits(t).dtype), int_bits(t))
               for k, t in dense_new.items())
    lines += [f"changed elements: {changed > 0}", f"changes remapped equal dense: {same}"]
    with open(os.path.join(log_dir, f"rank{rank}.log"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    dist.barrier()
    os._exit(0)  # skip gloo's teardown (tests/group_worker.py: it aborted finished ranks)


UNION_PARAMS = {"a": (1000, torch.bfloat16), "b": (64, torch.bfloat16),
                "c": (50, torch.float32), "d": (3000, torch.bfloat16)}
"""Params of the DP-union test: ``b`` never changes, ``d`` outgrows the small window."""


def union_case(world: int) -> dict:
    """Every param's full change set (the truth), the same on every rank."""
    from dte_detector import ChangeSet

    gen = torch.Generator().manual_seed(7)
    out = {}
    for name, (numel, dtype) in UNION_PARAMS.items():
        rate = 0.0 if name == "b" else 0.3
        index = torch.nonzero(torch.rand(numel, generator=gen) < rate).view(-1).to(torch.int32)
        low = torch.randn(index.numel(), generator=gen).to(dtype)
        out[name] = ChangeSet(index, low, (low.float() * 2).to(dtype))
    return out


def own_range(change, numel: int, rank: int, world: int):
    """The part of ``change`` inside DP rank ``rank``'s contiguous range of the param."""
    from dte_detector import ChangeSet

    start, end = numel * rank // world, numel * (rank + 1) // world
    keep = (change.indices >= start) & (change.indices < end)
    return ChangeSet(change.indices[keep], change.base_low[keep], change.base_high[keep])


def run_union(rank: int, world: int, init: str, window_bytes: int, log_dir: str) -> None:
    from areal_dte.megatron.dp_union import union_over_dp

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    truth = union_case(world)
    mine = {n: own_range(c, UNION_PARAMS[n][0], rank, world) for n, c in truth.items()}
    merged = union_over_dp(mine, None, window_bytes=window_bytes)
    same = all(torch.equal(merged[n].indices, c.indices)
               and torch.equal(int_bits(merged[n].base_low), int_bits(c.base_low))
               and torch.equal(int_bits(merged[n].base_high), int_bits(c.base_high))
               and merged[n].indices.dtype == torch.int32 for n, c in truth.items())
    with open(os.path.join(log_dir, f"rank{rank}.log"), "w") as fh:
        fh.write(f"union equals the whole change sets: {same}\n")
    dist.barrier()
    os._exit(0)
