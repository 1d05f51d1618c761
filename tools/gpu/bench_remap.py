"""The remap's per-tensor and flat paths, and the receiver's stage, on a Qwen3-4B sync (GPU).

Per-tensor ``remap`` against ``remap_all``'s flat path over a whole sync of a
Qwen3-4B-shaped model, and the receiver's decode, stage and apply.

The trainer holds Megatron's TP1 layout (fused, query-group-interleaved ``linear_qkv``,
fused ``linear_fc1``; 290 tensors, 4.02e9 elements); every tensor gets --changed (3.3 %)
random changed elements, sorted unique int64 indices on the GPU. Two plans:

* ``receiver``: into one SGLang TP1 rank (what ``ShardStage`` remaps per payload);
* ``sender``: into every rank of SGLang TP4 (what ``GroupSender`` remaps per sync;
  norms replicated four times, qkv split per rank).

Per plan and path: wall time (median of --reps after a warm-up, CUDA synchronized),
kernel launches and GPU kernel time from one torch.profiler run, host synchronizations
counted by ``torch.cuda.set_sync_debug_mode``, and a bitwise check that both paths give
the same indices and positions.

``--parts stage``: a ``ShardStage`` from that trainer layout into one SGLang TP1 rank, on
the GPU. A delta (--changed elements flipped by one ulp) and its inverse alternate, each
decoded, staged and written; a full version is staged and written. Each through the
stage's previous path (``before``: ``remap_all`` per target, one ``copy_`` per box) and
its kernel paths (``after``: ``dte_codec.routes``, ``dte_codec.box_copy``), the rank's
tensors compared bit for bit after every write with a full load by the reference; the
dense baseline is one copy of a buffer of all bf16 weights. Prints Markdown rows for
``docs/benchmarks.md``.

    PYTHONPATH=packages/dte-codec/src:tools python3 tools/gpu/bench_remap.py --out $OUT
    uv run python tools/gpu/bench_remap.py --smoke [--parts stage]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import time
import warnings
from unittest import mock
from pathlib import Path

import torch
from provenance import git_sha, machine
from torch.profiler import ProfilerActivity, profile

from dte_codec import decode, encode_delta, encode_full
from dte_codec.batched_remap import RemapItem, remap_flat
from dte_codec.dispatch import reference
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
    p.add_argument("--parts", default="remap,stage", help="comma-separated: remap, stage")
    p.add_argument("--profile", action="store_true",
                   help="stage: write the torch profile of one delta and one full write per path")
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
    parts = a.parts.split(",")
    if "stage" in parts:
        results["stage"] = stage_rows(config, a.changed, a.reps, device,
                                      profile_to=a.out if a.profile else None)
        print_stage(results["stage"])
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "stage.json").write_text(json.dumps(results, indent=1))
    if "remap" not in parts:
        return
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


def stage_rows(config: ModelConfig, changed: float, reps: int, device: torch.device, *,
               profile_to: Path | None = None) -> dict:
    """Decode, stage and write of a delta and of a full version into one SGLang TP1 rank,
    reference against kernels, bitwise after every write."""
    case = StageCase.of(config, changed, device)
    stage, local, deltas, full, expected = (case.stage, case.local, case.deltas, case.full,
                                            case.expected)
    rows = {"tensors": len(case.old), "elements": sum(t.numel() for t in case.old.values()),
            "changed_elements": case.changed_elements,
            "dense_copy_ms": _dense_copy_ms(local, reps, device)}
    for path, mode in (("before", _previous_path), ("after", contextlib.nullcontext)):
        rows[path] = _stage_path(stage, local, deltas, full, expected, mode, reps, device)
        print(path, json.dumps(rows[path]), flush=True)
        if profile_to is not None:
            with mode():
                _profile(profile_to / f"stage_profile_{path}.txt", stage, local, deltas, full,
                         device)
    return rows


@dataclasses.dataclass
class StageCase:
    """A Megatron TP1 trainer's weights, a delta flipping ``changed`` of their elements
    by one ulp and its inverse, a full version, and one SGLang TP1 rank's local tensors
    behind a ``ShardStage``, with the rank's expected bits after each version (a full
    load by the reference)."""

    source: object
    shard: object
    old: dict
    local: dict
    stage: object
    deltas: list
    full: object
    expected: dict
    changed_elements: int

    @classmethod
    def of(cls, config: ModelConfig, changed: float, device: torch.device) -> StageCase:
        from areal_dte.shard_stage import ShardStage
        from dte_detector import diff
        source = megatron_shard(config, MegatronLayout(tp=1), rank=0)
        shard = sglang_shard(config, SGLangLayout(tp=1), rank=0)
        gen = torch.Generator(device=device).manual_seed(0)
        old = {n: (torch.randn(spec.shape, generator=gen, device=device) * 0.05).to(spec.dtype)
               for n, spec in source.tensors.items()}
        new = {}
        for n, t in old.items():
            bits = t.view(torch.int16)
            moved = torch.rand(t.shape, generator=gen, device=device) < changed
            new[n] = torch.where(moved, bits ^ 1, bits).view(t.dtype)  # one ulp
        local = {n: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
                 for n, spec in shard.tensors.items()}
        stage = ShardStage.of(source, shard, local)
        expected = {}
        for name, weights in (("old", old), ("new", new)):
            with reference():
                stage(local, decode(encode_full(weights, stream_id="s", version=1),
                                    device=device)).write()
            expected[name] = {n: t.clone() for n, t in local.items()}
        forward = {n: diff(old[n], new[n]) for n in new}
        deltas = [encode_delta(new, forward, stream_id="s", base_version=1, version=2),
                  encode_delta(old, {n: diff(new[n], old[n]) for n in old}, stream_id="s",
                               base_version=2, version=3)]
        changed_elements = sum(int(c.indices.numel()) for c in forward.values())
        full = decode(encode_full(new, stream_id="s", version=9), device=device)
        return cls(source, shard, old, local, stage, deltas, full, expected, changed_elements)

    def fresh_stage(self) -> None:
        """A new stage over the same layouts and local tensors (nothing kept from before,
        e.g. after kernel constants changed); the local tensors keep their bits."""
        from areal_dte.shard_stage import ShardStage
        self.stage = ShardStage.of(self.source, self.shard, self.local)


def _profile(path: Path, stage, local, deltas, full, device) -> None:
    """Ops by self CPU and by device time of one delta (decode, stage, write) and one
    full version (stage, write), the delta undone after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, run in (("delta", lambda: stage(local, decode(deltas[0], device=device)).write()),
                      ("full", lambda: stage(local, full).write())):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            synchronize()
        stage(local, decode(deltas[1], device=device)).write()
        events = prof.key_averages()
        lines += [f"## {name}", events.table(sort_by="self_cpu_time_total", row_limit=25),
                  events.table(sort_by="self_cuda_time_total", row_limit=15)]
    path.write_text("\n".join(lines))


@contextlib.contextmanager
def _previous_path():
    """The stage without its kernel paths: what it ran before them."""
    from areal_dte.shard_stage import ShardStage
    with mock.patch.object(ShardStage, "_routed", return_value=None), \
            mock.patch.object(ShardStage, "_copied", return_value=None):
        yield


def _stage_path(stage, local, deltas, full, expected, mode, reps: int, device) -> dict:
    """Medians over ``reps`` alternating deltas (decode, stage, write) and full versions
    (stage, write); bitwise after every write."""
    times = {"decode": [], "stage": [], "write": [], "full_stage": [], "full_write": []}
    bitwise = True
    with mode():
        for rep in range(reps + 1):  # the first: warm-up (kernel compiles, plans)
            for frame, after in zip(deltas, ("new", "old")):
                payload, t_decode = _timed(lambda: decode(frame, device=device))
                prepared, t_stage = _timed(lambda: stage(local, payload))
                _, t_write = _timed(prepared.write)
                bitwise &= _same(local, expected[after])
                if rep and after == "new":
                    times["decode"].append(t_decode)
                    times["stage"].append(t_stage)
                    times["write"].append(t_write)
            prepared, t_stage = _timed(lambda: stage(local, full))
            _, t_write = _timed(prepared.write)
            bitwise &= _same(local, expected["new"])
            stage(local, decode(deltas[1], device=device)).write()  # back to "old"
            if rep:
                times["full_stage"].append(t_stage)
                times["full_write"].append(t_write)
        syncs = _syncs(lambda: stage(local, decode(deltas[0], device=device)).write())
        stage(local, decode(deltas[1], device=device)).write()
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(bitwise=bitwise, delta_host_syncs=syncs)
    return out


def _timed(fn):
    synchronize()
    start = time.perf_counter()
    out = fn()
    synchronize()
    return out, (time.perf_counter() - start) * 1e3


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def _syncs(fn) -> int | None:
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        fn()
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _dense_copy_ms(local: dict, reps: int, device) -> float:
    """One copy of a buffer as large as all local bf16 weights (median of ``reps``)."""
    numel = sum(t.numel() for t in local.values())
    source = torch.empty(numel, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    return statistics.median(_timed(lambda: target.copy_(source))[1] for _ in range(reps))


def print_stage(row: dict) -> None:
    print(f"tensors {row['tensors']}, elements {row['elements']:.3g}, changed "
          f"{row['changed_elements']:.3g}, dense copy {row['dense_copy_ms']:.2f} ms")
    print("| path | delta decode ms | delta stage ms | delta write ms | delta total ms "
          "| host syncs (decode+stage+write) | full stage ms | full write ms "
          "| full / dense copy | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in ("before", "after"):
        r = row[path]
        total = r["decode"] + r["stage"] + r["write"]
        full = r["full_stage"] + r["full_write"]
        print(f"| {path} | {r['decode']:.1f} | {r['stage']:.1f} | {r['write']:.1f} | "
              f"{total:.1f} | {r['delta_host_syncs']} | {r['full_stage']:.1f} | "
              f"{r['full_write']:.1f} | {full / row['dense_copy_ms']:.2f}x | "
              f"{r['bitwise']} |")


if __name__ == "__main__":
    main()
