"""End-to-end weight sync of a Qwen3-4B-shaped model, deltas against dense, on one GPU or two.

The trainer is a real training loop in Megatron's layout: a ``transformers`` Qwen3 model
(random weights, bf16) does forward and backward on random token batches; its gradients
are cut into Megatron's TP1 layout (fused ``linear_qkv`` with interleaved query groups,
fused ``linear_fc1``), where fp32 masters take a fused ``torch.optim.AdamW`` step (lr 3e-6,
wd 0.003) inside ``areal_dte.TorchActor`` (``--method``). The actor's bf16 copy goes back
into the Hugging Face modules for the next step (outside every timer). The rollout holds
SGLang's layout (fused ``qkv_proj`` and ``gate_up_proj``), so every index is remapped.

* ``--gpus 1``: trainer and rollout share the GPU; the link is ``dte_transport.Loopback``
  into a ``Receiver`` with a ``ShardStage``; the dense baseline is a device-to-device copy
  of every bf16 weight, and wire times over NVLink (370 GB/s, two H200s, DESIGN.md
  section 6) and a 25 GB/s network link are computed from measured bandwidths and
  labelled so.
* ``--gpus 2``: rank 0 trains on GPU0, rank 1 holds the rollout on GPU1; the sync is
  ``GroupSender``/``GroupReceiver`` over NCCL (``--link nvlink``), or NCCL held to
  sockets (``--link sockets``: ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``) standing for a
  cross-node link; the dense baseline is one NCCL send of every bf16 weight, measured
  after every sync. That send also carries the trainer's weights for the bitwise check.

Per sync after ``--warmup-steps``: changed fraction, bytes (ours, int32 index + bf16
value, dense), time per phase and end to end, and every rollout tensor compared bit for
bit with the layout conversion of the trainer's bf16 weights. The first sync is our full
sync. The floor adds the detector's minimal bytes (14 B per element for ``adamw``, 6 B for
``cast``) at the copy bandwidth, the payload at the link and the apply (8 B per changed
element).

    python3 tools/bench_sync.py --out $OUT              # on the GPU machine, src folders on PYTHONPATH
    python3 tools/bench_sync.py --gpus 2 --link sockets --out $OUT
    uv run python tools/bench_sync.py --smoke [--gpus 2]  # a tiny model on the CPU (gloo)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from areal_dte import Method, TorchActor
from areal_dte.shard_stage import ShardStage
from dte_codec.geometry import Shard, materialize, plan
from dte_codec.layouts import ModelConfig, canonical_tensors
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_transport import Loopback, Receiver, Sender
from dte_transport.group import GroupReceiver, GroupSender, Roles
from sync_measure import (NVLINK_GBPS, Stalls, copy_ms, dense_send, markdown_row, plot,
                          profiled, settled, step_row, summary, timed)

QWEN3_4B = dict(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                intermediate=9728)
SMOKE = dict(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=64)
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="adamw", choices=[m.value for m in Method])
    p.add_argument("--gpus", type=int, default=1, choices=[1, 2])
    p.add_argument("--link", default="nvlink", choices=["nvlink", "sockets"],
                   help="--gpus 2: NCCL as it comes, or held to sockets")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--layers", type=int, default=QWEN3_4B["layers"])
    p.add_argument("--sha", default=None, help="the tree's sha, where the machine has no git")
    p.add_argument("--profile", action="store_true",
                   help="--gpus 1: two more delta syncs and a full one under torch.profiler "
                        "(with Python stacks, and the second delta without: its timeline), "
                        "into --out/profile_* (not counted in the results)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--out", type=Path, default=None, help="folder for sync.json and sync.png")
    return p.parse_args()


def model_config(args: argparse.Namespace) -> ModelConfig:
    shape = dict(SMOKE if args.smoke else QWEN3_4B, layers=2 if args.smoke else args.layers)
    return ModelConfig(**shape, tie_word_embeddings=True)

def to_canonical(shard: Shard, local: dict[str, torch.Tensor],
                 canonical: dict[str, torch.Tensor]) -> None:
    """Write the shard's tensors into the full canonical (Hugging Face) tensors."""
    for piece in shard.pieces:
        target = canonical[piece.canonical][piece.region.slices()]
        target.copy_(local[piece.tensor][piece.local.slices()].view(target.shape))


def rollout_expected(config: ModelConfig, trainer: Shard, rollout: Shard,
                     weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a full load of the trainer's bf16 ``weights`` gives the rollout shard."""
    device = next(iter(weights.values())).device
    canonical = {n: torch.empty(s.shape, dtype=s.dtype, device=device)
                 for n, s in canonical_tensors(config).items()}
    to_canonical(trainer, weights, canonical)
    return materialize(rollout, canonical)


def same_bits(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(expected[n].view(torch.int16), t.view(torch.int16))
               for n, t in got.items())


class Trainer:
    """The training loop: HF modules for forward/backward, Megatron-layout masters."""

    def __init__(self, args: argparse.Namespace, device: torch.device, sender):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        self.args, self.device = args, device
        self.config = config = model_config(args)
        torch.manual_seed(0)
        hf = Qwen3Config(vocab_size=config.vocab, hidden_size=config.hidden,
                         num_hidden_layers=config.layers, num_attention_heads=config.heads,
                         num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
                         intermediate_size=config.intermediate, tie_word_embeddings=True,
                         torch_dtype=torch.bfloat16)
        with torch.device(device):
            self.model = Qwen3ForCausalLM(hf).to(torch.bfloat16)
        self.params = dict(self.model.named_parameters())
        self.shard = megatron_shard(config, MegatronLayout(tp=1), rank=0)
        fp32 = attrs.evolve(self.shard, tensors={n: attrs.evolve(s, dtype=torch.float32)
                                                 for n, s in self.shard.tensors.items()})
        self.fp32_shard = fp32
        masters = {n: torch.nn.Parameter(t) for n, t in
                   materialize(fp32, {n: p.detach().float() for n, p in self.params.items()})
                   .items()}
        optimizer = torch.optim.AdamW(masters.values(), lr=args.lr, weight_decay=0.003,
                                      fused=device.type == "cuda")
        self.actor = TorchActor(masters, optimizer, sender, method=Method(args.method))
        self.numel = sum(p.numel() for p in masters.values())
        self.gen = torch.Generator(device=device).manual_seed(1)

    def step(self) -> None:
        ids = torch.randint(0, self.config.vocab, (self.args.batch, self.args.seq),
                            device=self.device, generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        grads = materialize(self.fp32_shard, {n: p.grad.float() for n, p in self.params.items()})
        for name, master in self.actor.masters.items():
            master.grad = grads[name]
        for param in self.params.values():
            param.grad = None
        self.actor.step()
        with torch.no_grad():
            to_canonical(self.shard, self.actor.model, self.params)
        for master in self.actor.masters.values():
            master.grad = None


def rollout_shard(config: ModelConfig, rank: int) -> Shard:
    return attrs.evolve(sglang_shard(config, SGLangLayout(tp=1), rank=0), rank=rank)


def zeros(shard: Shard, device: torch.device) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s.shape, dtype=s.dtype, device=device) for n, s in shard.tensors.items()}


def one_gpu(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    Stalls.watch_collections()
    config = model_config(args)
    shard = rollout_shard(config, 0)
    rollout = zeros(shard, device)
    trainer_shard = megatron_shard(config, MegatronLayout(tp=1), rank=0)
    receiver = Receiver(rollout, device=device,
                        stage=ShardStage.of(trainer_shard, shard, rollout))
    trainer = Trainer(args, device, Sender(Loopback(receiver), anchor_interval=0))
    for _ in range(args.warmup_steps):
        trainer.step()
    settled()
    dense_ms = copy_ms(trainer.actor.model, device)
    _, full_ms = timed(device, lambda: trainer.actor.sync(1))
    steps = []
    for version in range(2, args.steps + 2):
        trainer.step()
        stalls = Stalls(device)
        report, total_ms = timed(device, lambda: trainer.actor.sync(version))
        stalled = stalls.since()
        expected = rollout_expected(config, trainer.shard, shard, trainer.actor.model)
        steps.append(step_row(report, total_ms, same_bits(expected, rollout), stalled))
    # steady full syncs: the first one above also pays every kernel's first compile
    fulls = [timed(device, lambda: trainer.actor.sync_full(version, reason="bench"))
             for version in range(args.steps + 2, args.steps + 5)]
    expected = rollout_expected(config, trainer.shard, shard, trainer.actor.model)
    full_bitwise = same_bits(expected, rollout)
    version = args.steps + 5
    if args.profile and args.out:
        trainer.step()
        profiled(lambda: trainer.actor.sync(version), device, args.out / "profile_delta")
        trainer.step()
        profiled(lambda: trainer.actor.sync(version + 1), device,
                 args.out / "profile_delta_timeline", stacks=False)
        profiled(lambda: trainer.actor.sync_full(version + 2, reason="bench"), device,
                 args.out / "profile_full")
    results = summary(args, device, trainer.numel, steps, full_ms=full_ms, dense_ms=dense_ms,
                   dense_label="dense copy on one GPU (measured)",
                   bandwidth=2 * trainer.numel * 2 / dense_ms / 1e6, link_gbps=NVLINK_GBPS)
    results["steady_full"] = {"ms": [ms for _, ms in fulls],
                              "phases": [dict(r.ms) for r, _ in fulls],
                              "median_ms": statistics.median(ms for _, ms in fulls),
                              "bitwise": full_bitwise}
    return results


def two_gpus(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, device_id=device,
                                timeout=datetime.timedelta(minutes=10))
    Stalls.watch_collections()
    config = model_config(args)
    roles = Roles([0], [1])
    target = rollout_shard(config, 1)
    trainer_shard = megatron_shard(config, MegatronLayout(tp=1), rank=0)
    if rank == 0:
        sender = GroupSender(plan(trainer_shard, [target]), roles=roles, stream_id="bench",
                             device=device, anchor_interval=0)
        trainer = Trainer(args, device, sender)
        for _ in range(args.warmup_steps):
            trainer.step()
        settled()
        weights = list(trainer.actor.model.values())
        report, full_ms = timed(device, lambda: trainer.actor.sync(1))
    else:
        rollout = zeros(target, device)
        receiver = GroupReceiver(rollout, roles=roles, device=device, shard=target)
        weights = [torch.empty(s.shape, dtype=s.dtype, device=device)
                   for s in trainer_shard.tensors.values()]
        receiver.sync()
        settled()
    dense = [dense_send(rank, weights, device) for _ in range(3)]
    steps = []
    for version in range(2, args.steps + 2):
        if rank == 0:
            trainer.step()
            stalls = Stalls(device)
            report, total_ms = timed(device, lambda: trainer.actor.sync(version))
            stalled = stalls.since()
        else:
            receiver.sync()
        dense.append(dense_send(rank, weights, device))
        bitwise = torch.zeros(1, dtype=torch.int64, device=device)
        if rank == 1:
            trainer_weights = dict(zip(trainer_shard.tensors, weights))
            expected = rollout_expected(config, trainer_shard, target, trainer_weights)
            bitwise += int(same_bits(expected, rollout))
        dist.all_reduce(bitwise)
        if rank == 0:
            steps.append(step_row(report, total_ms, bool(bitwise.item()), stalled))
    if rank == 0:
        dense_ms = statistics.median(dense)
        label = f"dense {dist.get_backend()} send ({args.link}, measured)"
        hbm = 4 * trainer.numel / copy_ms(trainer.actor.model, device) / 1e6
        queue.put(summary(args, device, trainer.numel, steps, full_ms=full_ms,
                          dense_ms=dense_ms, dense_label=label, bandwidth=hbm,
                          link_gbps=2 * trainer.numel / dense_ms / 1e6))
    dist.destroy_process_group()


def spawn_two(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    if args.link == "sockets":
        os.environ.update(SOCKETS)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the device README: multicast stays off
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(two_gpus, args=(args, port, queue), nprocs=2, join=True,
                       start_method="spawn")
    return queue.get()


def main() -> None:
    args = parse()
    results = one_gpu(args) if args.gpus == 1 else spawn_two(args)
    print(markdown_row(results, args), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sync.json").write_text(json.dumps(results, indent=1))
        plot(results, args.out / "sync.png")


if __name__ == "__main__":
    main()
