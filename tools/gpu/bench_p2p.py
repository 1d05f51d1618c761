"""GPU0 -> GPU1 weight sync of a ~4e9-parameter Qwen3-shaped model: dense vs deltas.

Rank 0 (GPU0) is a Megatron-layout trainer (TP1) with fp32 masters, real fused AdamW
(lr 3e-6, wd 0.003) and a bf16 model copy; rank 1 (GPU1) is an SGLang-layout rollout
(TP1: fused qkv_proj and gate_up_proj, so every index is remapped). After warm-up steps
it times, in one run and process group (NCCL):

* dense: one NCCL send of every bf16 tensor (the full-weight path's floor);
* full: this project's full sync through ``GroupSender``/``GroupReceiver``;
* delta: per step ``TorchActor.sync`` with the AdamW inversion (detect, remap, encode,
  two-round exchange, decode, apply), checked bitwise by comparing digests.

Run (2-GPU machine, repository root):
    PYTHONPATH=packages/dte-detector/src:packages/dte-codec/src:packages/dte-transport/src:\
packages/areal-dte/src python3 tools/gpu/bench_p2p.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_dte import Method, TorchActor
from dte_codec.geometry import materialize, plan
from dte_codec.layouts import ModelConfig, canonical_tensors
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_transport.group import GroupReceiver, GroupSender, Roles

QWEN3_4B = ModelConfig(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8,
                       head_dim=128, intermediate=9728)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=QWEN3_4B.layers)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on CPU over gloo, to check the script itself")
    return parser.parse_args()


DEVICE = "cuda"


def sync_device() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_ms(fn):
    sync_device()
    start = time.perf_counter()
    result = fn()
    sync_device()
    return result, (time.perf_counter() - start) * 1e3


def checksum(tensors) -> torch.Tensor:
    """Sums of the bit patterns and of their squares (int64, wrapping): independent of
    how the elements are split into tensors, so the two layouts can be compared."""
    total = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    for tensor in tensors.values():
        bits = tensor.reshape(-1).view(torch.int16).to(torch.int64)
        total[0] += bits.sum()
        total[1] += (bits * bits).sum()
    return total


def canonical(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    out = {}
    for name, spec in canonical_tensors(config).items():
        tensor = torch.randn(spec.shape, device=DEVICE, generator=gen).mul_(0.02)
        out[name] = tensor.add_(1.0) if name.endswith("norm.weight") else tensor
    return out


def dense_send(rank: int, tensors: dict[str, torch.Tensor]) -> float:
    ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank)
           for t in tensors.values()]

    def go():
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    go()
    return min(cuda_ms(go)[1] for _ in range(3))


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    global DEVICE
    timeout = datetime.timedelta(minutes=10)
    if args.smoke:
        DEVICE = "cpu"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timeout)
        config = ModelConfig(vocab=64, hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4,
                             intermediate=32)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, device_id=torch.device("cuda", rank),
                                timeout=timeout)
        config = ModelConfig(vocab=QWEN3_4B.vocab, hidden=QWEN3_4B.hidden,
                             layers=args.layers, heads=QWEN3_4B.heads,
                             kv_heads=QWEN3_4B.kv_heads, head_dim=QWEN3_4B.head_dim,
                             intermediate=QWEN3_4B.intermediate)
    roles = Roles([0], [1])
    rollout_shard = sglang_shard(config, SGLangLayout(tp=1), rank=0)
    rollout_shard = attrs.evolve(rollout_shard, rank=1)
    results = {}
    if rank == 0:
        shard = megatron_shard(config, MegatronLayout(tp=1), rank=0)
        masters = {n: torch.nn.Parameter(t) for n, t in materialize(
            attrs.evolve(shard, tensors={n: attrs.evolve(s, dtype=torch.float32)
                                         for n, s in shard.tensors.items()}),
            canonical(config, 0)).items()}
        params = sum(p.numel() for p in masters.values())
        optimizer = torch.optim.AdamW(masters.values(), lr=args.lr, weight_decay=0.003,
                                      fused=True)
        sender = GroupSender(plan(shard, [rollout_shard]), roles=roles, stream_id="bench",
                             device=DEVICE, anchor_interval=0)
        actor = TorchActor(masters, optimizer, sender, method=Method.ADAMW)
        gen = torch.Generator(device=DEVICE).manual_seed(1)

        def train():
            for p in masters.values():
                p.grad = torch.randn(p.shape, device=DEVICE, generator=gen)
            actor.step()
            for p in masters.values():
                p.grad = None
        for _ in range(args.warmup_steps):
            train()
        results["dense_send_ms"] = dense_send(0, actor.model)
        report, results["full_sync_ms"] = cuda_ms(lambda: actor.sync(1))
        deltas = []
        for version in range(2, args.steps + 2):
            train()
            report, ms = cuda_ms(lambda: actor.sync(version))
            dist.all_reduce(check := checksum(actor.model) * -1)
            deltas.append({"ms": ms, "kind": report.kind.value, "changed": report.changed,
                           "payload_bytes": report.payload_bytes, "phases": report.ms,
                           "bitwise": bool((check == 0).all())})
        results.update(params=params, dense_bytes=report.dense_bytes, deltas=deltas)
    else:
        weights = {n: torch.zeros(s.shape, dtype=s.dtype, device=DEVICE)
                   for n, s in rollout_shard.tensors.items()}
        receiver = GroupReceiver(weights, roles=roles, device=DEVICE)
        dense_send(1, {n: torch.empty(s.shape, dtype=torch.bfloat16, device=DEVICE)
                       for n, s in megatron_shard(config, MegatronLayout(tp=1), rank=0)
                       .tensors.items()})
        receiver.sync()
        for _ in range(args.steps):
            receiver.sync()
            dist.all_reduce(checksum(weights))
    if rank == 0:
        results.update(gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                       torch=torch.__version__,
                       date=datetime.date.today().isoformat(), layers=args.layers,
                       lr=args.lr)
        print(json.dumps(results, indent=1), flush=True)
        delta_ms = sorted(d["ms"] for d in results["deltas"])[len(results["deltas"]) // 2]
        print(f"| {results['params'] / 1e9:.2f}e9 params | dense NCCL send "
              f"{results['dense_send_ms']:.1f} ms | our full sync {results['full_sync_ms']:.0f} ms"
              f" | delta sync (median) {delta_ms:.1f} ms | delta / dense "
              f"{delta_ms / results['dense_send_ms']:.2f}x | changed "
              f"{results['deltas'][-1]['changed'] / results['params']:.2%} | payload "
              f"{results['deltas'][-1]['payload_bytes'] / 1e6:.0f} MB vs "
              f"{results['dense_bytes'] / 1e6:.0f} MB | bitwise "
              f"{all(d['bitwise'] for d in results['deltas'])} |", flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(args, 29511), nprocs=2, join=True)


if __name__ == "__main__":
    main()
