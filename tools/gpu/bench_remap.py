"""Per-tensor ``remap`` against ``remap_all``'s flat path over a whole sync of a Qwen3-4B-shaped model.

The trainer holds Megatron's TP1 layout (fused, query-group-interleaved ``linear_qkv``,
fused ``linear_fc1``; 290 tensors, 4.02e9 elements); every tensor gets --changed (3.3 %)
random changed elements, sorted unique int64 indices on the GPU. Two plans:

* ``receiver``: into one SGLang TP1 rank (what ``ShardStage`` remaps per payload);
* ``sender``: into every rank of SGLang TP4 (what ``GroupSender`` remaps per sync;
  norms replicated four times, qkv split per rank).

Per plan and path: wall time (median of --reps after a warm-up, CUDA synchronized),
kernel launches and GPU kernel time from one torch.profiler run, host synchronizations
counted by ``torch.cuda.set_sync_debug_mode``, and a bitwise check that both paths give
the same indices and positions. Prints Markdown rows for ``docs/benchmarks.md``.

    PYTHONPATH=packages/dte-codec/src:tools python3 tools/gpu/bench_remap.py --out $OUT
    uv run python tools/gpu/bench_remap.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
from provenance import git_sha, machine
from torch.profiler import ProfilerActivity, profile

from dte_codec.batched_remap import RemapItem, remap_flat
from dte_codec.geometry import plan
from dte_codec.layouts import ModelConfig
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.remap import remap
from dte_codec.sglang_layout import SGLangLayout, sglang_shard

QWEN3_4B = ModelConfig(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8,
                       head_dim=128, intermediate=9728)
SMOKE = ModelConfig(vocab=96, hidden=32, layers=2, heads=4, kv_heads=4, head_dim=8,
                    intermediate=64)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--changed", type=float, default=0.033)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sha", default=None, help="the tree's sha, where the machine has no git")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    return p.parse_args()


def items_for(config: ModelConfig, targets: int, changed: float,
              device: torch.device) -> list[RemapItem]:
    source = megatron_shard(config, MegatronLayout(tp=1), rank=0)
    shards = [sglang_shard(config, SGLangLayout(tp=targets), rank=r) for r in range(targets)]
    gen = torch.Generator(device=device).manual_seed(0)
    items = []
    for name, transfers in plan(source, shards).items():
        shape = tuple(source.tensors[name].shape)
        picked = torch.rand(shape, generator=gen, device=device).view(-1) < changed
        items.append(RemapItem(transfers, shape, picked.nonzero().view(-1), tensor=name))
    return items


def per_tensor(items: list[RemapItem]):
    return [remap(i.transfers, i.source_shape, i.indices, tensor=i.tensor) for i in items]


def batched(items: list[RemapItem]):
    return remap_flat(items)  # remap_all's path on a GPU; --smoke runs it on the CPU


def same(a, b) -> bool:
    return all(x.keys() == y.keys() and all(
        torch.equal(x[k].indices, y[k].indices) and torch.equal(x[k].positions, y[k].positions)
        for k in x) for x, y in zip(a, b, strict=True))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn, items, reps: int) -> dict:
    fn(items)  # warm-up: table caches, allocator
    times = []
    for _ in range(reps):
        synchronize()
        start = time.perf_counter()
        fn(items)
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(items)
        synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    kernel_ms = sum(getattr(e, "self_device_time_total", 0.0) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    top = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:5]
    syncs = None
    if torch.cuda.is_available():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            fn(items)
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {"median_ms": statistics.median(times), "times_ms": times, "launches": launches,
            "kernel_ms": kernel_ms, "host_syncs": syncs,
            "top_kernels": [(e.key[:50], e.count,
                             round(getattr(e, "self_device_time_total", 0.0) / 1e3, 2))
                            for e in top]}


def main() -> None:
    a = parse()
    device = torch.device("cpu" if a.smoke else "cuda")
    config = SMOKE if a.smoke else QWEN3_4B
    results = {"sha": a.sha or git_sha(), "machine": machine(device.type),
               "date": datetime.date.today().isoformat(), "changed": a.changed}
    for name, targets in (("receiver", 1), ("sender", 4)):
        items = items_for(config, targets, a.changed, device)
        elements = sum(i.indices.numel() for i in items)
        row = {"tensors": len(items), "elements": elements,
               "bitwise_equal": same(per_tensor(items), batched(items))}
        for path, fn in (("per_tensor", per_tensor), ("batched", batched)):
            row[path] = measure(fn, items, a.reps)
        results[name] = row
        print(name, json.dumps(row), flush=True)
        del items
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("| plan | tensors | changed elements | path | median ms | launches | host syncs "
          "| kernel ms | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("receiver", "sender"):
        row = results[name]
        for path in ("per_tensor", "batched"):
            r = row[path]
            print(f"| {name} | {row['tensors']} | {row['elements']:.3g} | {path} | "
                  f"{r['median_ms']:.1f} | {r['launches']} | {r['host_syncs']} | "
                  f"{r['kernel_ms']:.1f} | {row['bitwise_equal']} |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "remap.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
