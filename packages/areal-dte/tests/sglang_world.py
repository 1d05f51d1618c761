"""SGLang 0.5.23 on CPU for the ``sglang``-marked tests: its process state, its Qwen3 model
classes, and a trainer whose bf16 weights they receive.

As DESIGN.md section 7 has it: SGLang's model classes build on CPU once
``ServerArgs(device="cpu")`` is published, its distributed state is set up over gloo and the
rotary embedding takes its CPU path. areal-dte's plugin is registered and applied as
SGLang's ``load_plugins`` does in a server, so the model classes and the model runner's
``WeightUpdater`` carry the same hooks.

sglang is imported inside the functions: this module is collected in the default run too.
"""

from __future__ import annotations

import os

import torch
from areal_dte import sglang_plugin
from areal_dte.sglang_receiver import payload_tensors
from bitwise import first_difference
from dte_codec import encode_delta, encode_full
from dte_codec.layouts import ModelConfig, canonical_tensors
from dte_detector import diff

LR, WEIGHT_DECAY = 1e-3, 0.01
"""An AdamW step moves an element by about lr: that flips the bf16 value of every weight
below ~0.1 in magnitude and of a share of the larger ones."""
SCALE = 1.0
"""Initial weights are N(0, SCALE**2), so a step changes some elements, not all."""


def start(folder: str, *, tp: int = 1, ep: int = 1, rank: int = 0) -> None:
    """Set up this process as SGLang TP rank ``rank`` of ``tp`` on CPU, over gloo."""
    # torch here is a CUDA build without a GPU: the TP group must not open the NCCL it
    # ships (SGLang skips pynccl when the library does not load, as on a CPU-only torch)
    os.environ["SGLANG_NCCL_SO_PATH"] = os.path.join(folder, "no-nccl-on-cpu.so")
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.rotary_embedding import base as rotary
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    # "dummy": SGLang's own no-checkpoint mode, which resolves no model files or hub names
    server_args = ServerArgs(model_path="dummy", device="cpu", tp_size=tp, ep_size=ep)
    runtime_context.publish(server_args, role="test",
                            ranks=runtime_context.SpawnRanks(world_rank=rank))
    parallel_state.init_distributed_environment(
        world_size=tp, rank=rank, local_rank=rank, backend="gloo",
        distributed_init_method=f"file://{os.path.join(folder, 'sglang-rendezvous')}")
    parallel_state.initialize_model_parallel(backend="gloo")
    rotary._is_cpu = True  # read from the platform (CUDA) at import: take the CPU path
    # As an SGLang server process does: discover the general plugins through their entry
    # points (areal-dte's pyproject declares it), run them, apply their hooks.
    load_plugins()
    assert sglang_plugin.register in _loaded_plugins(), "areal-dte's entry point not found"


def _loaded_plugins() -> list:
    from importlib.metadata import entry_points

    return [ep.load() for ep in entry_points(group="sglang.srt.plugins")
            if ep.name == sglang_plugin.PLUGIN]


def sglang_model(hf_config) -> torch.nn.Module:
    """SGLang's Qwen3ForCausalLM or Qwen3MoeForCausalLM of ``hf_config``, bf16, unloaded."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    model_class = Qwen3MoeForCausalLM if getattr(hf_config, "num_experts", 0) else (
        Qwen3ForCausalLM)
    with set_default_torch_dtype(torch.bfloat16):
        return model_class(hf_config)


def loaded(hf_config, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh SGLang model after SGLang's own full load of ``weights`` (HF names)."""
    model = sglang_model(hf_config)
    model.load_weights(list(weights.items()))
    return model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def weight_updater(model: torch.nn.Module):
    """The model runner's ``WeightUpdater`` of ``model``, with the fields the weight-update
    paths below read."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        WeightUpdater,
    )
    from sglang.srt.runtime_context import get_parallel

    return WeightUpdater(tp_rank=get_parallel().tp_rank, device="cpu", gpu_id=0,
                         model_config=None, custom_weight_loaders=[], get_model=lambda: model,
                         update_model_fields=None, recapture_cuda_graph=None,
                         get_model_runner=None)


def send_tensor(updater, data: bytes) -> tuple[bool, str]:
    """One payload through ``update_weights_from_tensor`` (an Engine or HTTP request)."""
    return updater.update_weights_from_tensor(payload_tensors(data))


def send_distributed(updater, data: bytes) -> tuple[bool, str]:
    """One payload through ``update_weights_from_distributed``, from where the worker has
    received the broadcast uint8 tensor (the step that follows the NCCL receive)."""
    return updater.load_weights_from_distributed(payload_tensors(data))


class Trainer:
    """fp32 masters under Hugging Face names, real AdamW steps, and the bf16 weights a
    rollout receives, as payloads of one stream."""

    def __init__(self, hf_config, *, seed: int, stream_id: str = "run"):
        gen = torch.Generator().manual_seed(seed)
        self.masters = {name: torch.nn.Parameter(torch.randn(spec.shape, generator=gen) * SCALE)
                        for name, spec in canonical_tensors(ModelConfig.from_hf(hf_config)).items()}
        self.optimizer = torch.optim.AdamW(self.masters.values(), lr=LR,
                                           weight_decay=WEIGHT_DECAY)
        self.gen, self.stream_id = gen, stream_id
        self.weights = self._cast()
        self.changes: dict = {}

    def _cast(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to(torch.bfloat16) for name, p in self.masters.items()}

    def full(self, version: int) -> bytes:
        """The full payload's bytes, as an update request carries them."""
        return bytes(encode_full(self.weights, stream_id=self.stream_id, version=version))

    def step(self) -> None:
        """One AdamW step on random gradients; ``changes`` are those of the bf16 weights."""
        for p in self.masters.values():
            p.grad = torch.randn(p.shape, generator=self.gen)
        self.optimizer.step()
        old, self.weights = self.weights, self._cast()
        self.changes = {name: diff(old[name], new) for name, new in self.weights.items()}

    def delta(self, *, base: int, version: int, stream_id: str | None = None) -> bytes:
        """The last step as a delta's bytes (from another stream with ``stream_id``)."""
        return bytes(encode_delta(self.weights, self.changes,
                                  stream_id=stream_id or self.stream_id, base_version=base,
                                  version=version))


def assert_equals_full_load(hf_config, weights: dict[str, torch.Tensor],
                            live: torch.nn.Module) -> None:
    """``live`` holds, byte for byte, SGLang's own full load of ``weights``."""
    difference = first_difference(params(loaded(hf_config, weights)), params(live))
    assert difference is None, difference


def trajectory(trainer: Trainer, *, versions: int, anchor: int):
    """Yield ``(version, kind, payload)``: version 1 full, then one AdamW step per version
    sent as a delta, with a full anchor after every ``anchor`` deltas."""
    deltas = 0
    for version in range(1, versions + 1):
        if version == 1:
            yield version, "full", trainer.full(version)
            continue
        trainer.step()
        if deltas == anchor:
            deltas = 0
            yield version, "anchor", trainer.full(version)
        else:
            deltas += 1
            yield version, "delta", trainer.delta(base=version - 1, version=version)


def run_rank(rank: int, folder: str, hf_config, *, tp: int, ep: int, versions: int,
             anchor: int) -> None:
    """One SGLang TP rank's life in a spawned process: a startup load, a ``trajectory``
    and then a delta onto the wrong base, each through ``update_weights_from_tensor``.
    Every rank computes the same payloads from the same seeds (a server hands each rank a
    copy of one). One log line per version: kind, SGLang's answer, and the comparison
    with a full load; the last line the wrong base's answer and whether params kept."""
    start(folder, tp=tp, ep=ep, rank=rank)
    live = loaded(hf_config, Trainer(hf_config, seed=1).weights)
    updater, trainer, lines = weight_updater(live), Trainer(hf_config, seed=0), []
    for version, kind, data in trajectory(trainer, versions=versions, anchor=anchor):
        success, _ = send_tensor(updater, data)
        difference = first_difference(params(loaded(hf_config, trainer.weights)), params(live))
        lines.append(f"v{version} {kind} {success} {difference or 'bitwise equal'}")
    before = {name: t.clone() for name, t in params(live).items()}
    trainer.step()
    success, message = send_tensor(updater, trainer.delta(base=versions - 1,
                                                          version=versions + 1))
    lines.append(f"{success} {first_difference(before, params(live))} {message}")
    with open(os.path.join(folder, f"rank{rank}.log"), "w") as log:
        log.write("\n".join(lines) + "\n")
    os._exit(0)  # gloo's teardown at exit has aborted finished ranks; nothing is left to do
