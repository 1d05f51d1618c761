"""What each spawned rank runs in the awex cluster tests (gloo on CPU, AReaL's .venv-areal).

Trainer ranks: megatron-core's own ``GPTModel`` at TP2 (``megatron_world.gpt_model``),
bf16, under ``DeltaAwexMegatronAdapter``. Megatron's optimizers need CUDA (DESIGN §7), so
the optimizer is a stand-in with the structures of megatron-core's
``Float16OptimizerWithFloat16Params`` that ``areal_dte.megatron.attach`` reads (fp32
masters stepped by a real torch AdamW, then copied into the bf16 params by
``_copy_main_params_to_model_params``). The gradients are cut from one canonical gradient
per step (``group_worker``), not produced by a forward pass, so that every process can
compute what a full sync gives.

Rollout ranks: SGLang 0.5.10.post1's own ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``
(AReaL 1.0.4's SGLang; built on CPU over gloo at the rank's TP size by ``sglang_cpu``,
with SGLang's real ``ServerArgs``) under ``DeltaAwexSGLangAdapter``, which applies into
their live parameters (``qkv_proj``, ``gate_up_proj``, the fused ``w13``/``w2`` experts,
the padded embedding and lm_head), after SGLang's own load of the initial weights.
SGLang's ``Scheduler`` and model runner need a GPU, so the scheduler is a stand-in holding
what the adapter reads of it: the ``ServerArgs``, ``tp_rank``,
``tp_worker.model_runner.model`` (the SGLang model) and ``flush_cache`` (whose answer the
test chooses: a scheduler that is not idle).

The parent runs AReaL's weight-update gateway for its KV store; ranks exchange their metas
with it through files (``meta-*.json``, then ``connect-<pair>.json``), as AReaL's
``/connect`` does over HTTP.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import types

import attrs
import torch
import torch.distributed as dist
from dte_codec.layouts import ModelConfig
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_config import DeltaConfig, DeltaMethod, export_env
from dte_transport import group as group_module
from group_worker import LR, WD, _corrupting, canonical_grads, canonical_masters, cut

TRAINER_TP = 2
PAIRS = ("pair-a", "pair-b")
"""The first connection, and the one after a rollout rank restarts."""


@attrs.frozen
class Case:
    config: ModelConfig
    rollout_tp: int
    engines: int
    method: DeltaMethod
    versions: int = 16
    anchor: int = 4
    veto: int = 4
    """The version whose delta rollout rank 0 vetoes at the agreement (it claims to hold
    the version before)."""
    corrupt: int = 6
    """The version whose delta reaches the rollout with one byte flipped (refused at the
    vote, after the exchange)."""
    replaced: int = 8
    """The version for which rollout rank 0's live model holds a param of another shape
    (as if SGLang had rebuilt a layer): it refuses, every rank keeps its version, and the
    trainers' next version is full."""
    restart: int = 15
    """Before this version rollout rank 0 restarts empty and every rank reconnects."""
    busy: int = 7
    """The version after which the last rollout rank's scheduler is not idle: its cache
    cannot be flushed."""

    @property
    def rollouts(self) -> int:
        return self.rollout_tp * self.engines

    @property
    def world(self) -> int:
        return self.rollouts + TRAINER_TP


def hf_config(config: ModelConfig):
    """The transformers config AReaL's engines carry (``hf_config``, ``model.config``)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=config.vocab, hidden_size=config.hidden,
                  num_hidden_layers=config.layers, num_attention_heads=config.heads,
                  num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
                  intermediate_size=config.intermediate,
                  tie_word_embeddings=config.tie_word_embeddings)
    if config.is_moe:
        return Qwen3MoeConfig(**common, num_experts=config.num_experts,
                              moe_intermediate_size=config.moe_intermediate,
                              num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"])
    return Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])


def _wait_for(path: str, seconds: float = 180) -> dict:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)
    with open(path) as fh:
        return json.load(fh)


def write_json(path: str, value) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump(value, fh)
    os.replace(path + ".tmp", path)


class _MixedPrecisionOptimizer:
    """The stand-in of megatron-core's ``Float16OptimizerWithFloat16Params`` (CUDA-only)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], masters: dict[str, torch.Tensor]):
        self.float16_groups = [[params[n] for n in masters]]
        self.fp32_from_float16_groups = [[torch.nn.Parameter(m) for m in masters.values()]]
        self.fp32_from_fp32_groups = [[]]
        self.optimizer = torch.optim.AdamW(self.fp32_from_float16_groups[0], lr=LR,
                                           weight_decay=WD, foreach=True)

    def step(self, grads: list[torch.Tensor]) -> None:
        for main, grad in zip(self.fp32_from_float16_groups[0], grads):
            main.grad = grad
        self.optimizer.step()
        self._copy_main_params_to_model_params()

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        for main, param in zip(self.fp32_from_float16_groups[0], self.float16_groups[0]):
            param.data.copy_(main)

    def reload_model_params(self) -> None:
        self._copy_main_params_to_model_params()

    def load_state_dict(self, state) -> None:
        self.optimizer.load_state_dict(state)


def _env(case: Case) -> None:
    delta = DeltaConfig(enable_delta_weight_update=True, weight_update_delta_method=case.method,
                        weight_update_anchor_interval=case.anchor)
    export_env(delta, environ=os.environ, tree={})


def _connect(adapter, case: Case, folder: str, pair: str, transfer_rank: int) -> None:
    where = _wait_for(os.path.join(folder, f"connect-{pair}.json"))
    adapter.init_weight_update_group(
        pair_name=pair, master_addr="127.0.0.1", master_port=where["port"],
        transfer_rank=transfer_rank, world_size=case.world, kv_store_url=where["kv"],
        infer_world_size=case.rollout_tp, train_world_size=TRAINER_TP,
        num_engines=case.engines)
    adapter.batch_isend_irecv(world_size=case.world)  # the gateway's next call


def _report_meta(adapter, folder: str, name: str) -> None:
    from areal.infra.rpc.serialization import serialize_value

    write_json(os.path.join(folder, f"meta-{name}.json"),
                serialize_value(adapter.get_weight_metadata()))


def _reference(config: ModelConfig):
    masters = canonical_masters(config)
    params = [torch.nn.Parameter(t.clone()) for t in masters.values()]
    return masters, params, torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True)


def run_trainer(rank: int, case: Case, store: str, folder: str) -> None:
    from areal_dte.areal.awex_megatron import DeltaAwexMegatronAdapter
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron_world import gpt_model

    _env(case)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=TRAINER_TP,
                            timeout=datetime.timedelta(seconds=120))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TRAINER_TP)
    initialize_rng_tracker(inference_rng_tracker=True)
    model = gpt_model(case.config).to(torch.bfloat16)
    shard = megatron_shard(case.config, MegatronLayout(tp=TRAINER_TP), rank=rank)
    masters, ref_params, ref_opt = _reference(case.config)
    mine = cut(shard, masters)
    params = dict(model.named_parameters())
    assert set(params) == set(mine), "the GPTModel's params are the layout's tensors"
    optimizer = _MixedPrecisionOptimizer(params, mine)
    optimizer.reload_model_params()
    engine = types.SimpleNamespace(model=model, optimizer=optimizer,
                                   hf_config=hf_config(case.config), data_parallel_rank=0,
                                   data_parallel_world_size=1, world_size=TRAINER_TP, rank=rank)
    adapter = DeltaAwexMegatronAdapter(engine)
    _report_meta(adapter, folder, f"train{rank}")
    transfer_rank = case.rollouts + rank
    _connect(adapter, case, folder, PAIRS[0], transfer_rank)
    log = []
    for version in range(1, case.versions + 1):
        grads = canonical_grads(masters, version)
        for param, grad in zip(ref_params, grads.values()):
            param.grad = grad
        ref_opt.step()
        local = cut(shard, grads)
        optimizer.step([local[n] for n in mine])
        if version == case.restart:
            adapter.teardown_weight_update_group()
            _connect(adapter, case, folder, PAIRS[1], transfer_rank)
        if version == case.corrupt and rank == 0:
            group_module.exchange = _corrupting  # puts the real one back after one call
        try:
            adapter.execute_weight_update(version)
            report = adapter.last_report
            log.append(f"v{version} {report.kind.value} {report.reason}")
        except Exception as exc:  # noqa: BLE001 - the log is what the test reads
            log.append(f"v{version} {type(exc).__name__}: {exc}")
    _finish(folder, f"train{rank}", log)


def run_rollout(rank: int, case: Case, store: str, folder: str) -> None:
    import sglang_cpu

    _env(case)
    tp_rank = rank % case.rollout_tp
    server_args = sglang_cpu.start(folder, f"{store}-engine{rank // case.rollout_tp}",
                                   tp=case.rollout_tp, rank=tp_rank)
    model = sglang_cpu.sglang_model(server_args, hf_config(case.config))
    # as a server starts: SGLang's own load of a checkpoint (it zeroes the vocab padding)
    model.load_weights([(name, master.to(torch.bfloat16))
                        for name, master in canonical_masters(case.config).items()])
    # after sglang_cpu.start: AReaL's SGLang adapter imports sglang, which reads its CPU
    # switch at import
    from areal_dte.areal.awex_sglang import DeltaAwexSGLangAdapter

    shard = sglang_shard(case.config, SGLangLayout(tp=case.rollout_tp), rank=tp_rank)
    flushes = []

    def flush_cache() -> bool:  # SGLang's answer: False unless the scheduler is idle
        flushes.append(version)
        return not (version == case.busy and rank == case.rollouts - 1)
    version = 0
    scheduler = types.SimpleNamespace(
        server_args=server_args, tp_rank=tp_rank, tp_worker=types.SimpleNamespace(
            model_runner=types.SimpleNamespace(model=model)),
        flush_cache=flush_cache)
    adapter = DeltaAwexSGLangAdapter(scheduler)
    _report_meta(adapter, folder, f"infer{rank}")
    _connect(adapter, case, folder, PAIRS[0], rank)
    masters, ref_params, ref_opt = _reference(case.config)
    log = []
    for version in range(1, case.versions + 1):
        previous = {n: p.detach().clone() for n, p in zip(masters, ref_params)}
        for param, grad in zip(ref_params, canonical_grads(masters, version).values()):
            param.grad = grad
        ref_opt.step()
        if version == case.veto and rank == 0:
            adapter.receiver.version -= 1
        if version == case.restart:
            adapter.teardown_weight_update_group()
            if rank == 0:
                for param in model.parameters():
                    param.data.zero_()
                adapter = DeltaAwexSGLangAdapter(scheduler)
            _connect(adapter, case, folder, PAIRS[1], rank)
        before = len(flushes)
        replaced = _replace_a_param(model) if (version, rank) == (case.replaced, 0) else None
        try:
            adapter.execute_weight_update(version)
            outcome = "applied"
        except Exception as exc:  # noqa: BLE001 - the log is what the test reads
            outcome = f"{type(exc).__name__}: {exc}"
        if replaced is not None:
            replaced()
        canonical = {n: p.detach() for n, p in zip(masters, ref_params)}
        held, which = (previous, " (the version before)") if (
            outcome.startswith("PayloadRejectedError")) else (canonical, "")
        log.append(f"v{version} {outcome}, flushed {len(flushes) - before}, "
                   f"{_differences(model, shard, held)}{which}")
    _finish(folder, f"infer{rank}", log)


def _replace_a_param(model: torch.nn.Module):
    """Give the model's first param another shape; returns what puts it back."""
    name, param = next(iter(model.named_parameters()))
    path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(path)
    owner.register_parameter(leaf, torch.nn.Parameter(param.data[:1].clone(),
                                                       requires_grad=False))
    return lambda: owner.register_parameter(leaf, param)


def _differences(model: torch.nn.Module, shard, canonical) -> str:
    """Which live params differ, by bit pattern, from the full sync of ``canonical``."""
    expected = {n: t.to(torch.bfloat16) for n, t in cut(shard, canonical).items()}
    differ = [name for name, param in model.named_parameters()
              if not torch.equal(param.data.view(torch.int16), expected[name].view(torch.int16))]
    return f"differing {differ[:3]}" if differ else "bitwise equal to a full sync"


def _finish(folder: str, name: str, log: list[str]) -> None:
    with open(os.path.join(folder, f"{name}.log"), "w") as fh:
        fh.write("\n".join(log) + "\n")
    dist.barrier()
    os._exit(0)  # skip gloo's teardown (group_worker: it aborted finished ranks)
