"""How ``bench_sync.py`` measures a sync and reports it: device timers, host stalls, the
dense baselines (a device-to-device copy, one NCCL send), the profiler, then the run's JSON
summary with its computed wire times and floor, its Markdown row and its plot."""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from areal_dte import Method
from provenance import git_sha, machine

NVLINK_GBPS = 370.0
"""GPU0 -> GPU1 NCCL send measured on two H200s (DESIGN.md, section 6)."""
NETWORK_GBPS = 25.0
DETECTOR_BYTES = {Method.ADAMW: 14, Method.CAST: 6, Method.SNAPSHOT: 4}
APPLY_BYTES = 8


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stalls:
    """Host stalls that land in whichever phase runs into them, counted from creation: the
    interpreter's garbage collections (one of generation 2 scans every tracked object,
    100s of ms in a process holding torch and transformers) and the CUDA caching
    allocator's free-and-retry mallocs."""

    gc_ms = 0.0
    """Milliseconds in collections since ``watch_collections``."""
    _began = 0.0

    def __init__(self, device: torch.device):
        self.device, self.gc_ms_then, self.retries_then = device, Stalls.gc_ms, _retries(device)

    def since(self) -> dict:
        return {"gc_ms": Stalls.gc_ms - self.gc_ms_then,
                "alloc_retries": _retries(self.device) - self.retries_then}

    @staticmethod
    def watch_collections() -> None:
        def on(phase: str, _info: dict) -> None:
            if phase == "start":
                Stalls._began = time.perf_counter()
            else:
                Stalls.gc_ms += (time.perf_counter() - Stalls._began) * 1e3
        gc.callbacks.append(on)


def _retries(device: torch.device) -> int:
    return (torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            if device.type == "cuda" else 0)


def settled() -> None:
    """Collect, then leave what the setup built (modules, weights, optimizer state, caches)
    out of later collections (``gc.freeze``, as Megatron's ``--manual-gc`` and torchtitan
    do), so a generation-2 collection during a sync scans only what came after."""
    gc.collect()
    gc.freeze()


def timed(device: torch.device, fn):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, (time.perf_counter() - start) * 1e3


def copy_ms(tensors: dict[str, torch.Tensor], device: torch.device) -> float:
    """A device-to-device copy of every tensor, best of 3 after one warm-up."""
    sources = list(tensors.values())
    targets = [torch.empty_like(t) for t in sources]

    def copy():
        for target, source in zip(targets, sources):
            target.copy_(source)
    copy()
    return min(timed(device, copy)[1] for _ in range(3))


def dense_send(rank: int, tensors: list[torch.Tensor], device: torch.device) -> float:
    """One NCCL (gloo) send of every tensor from rank 0 into rank 1's ``tensors``."""
    ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank) for t in tensors]

    def go():
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return timed(device, go)[1]


def profiled(fn, device: torch.device, out: Path, *, stacks: bool = True) -> None:
    """Run ``fn`` under torch.profiler into the folder ``out``: ops by self CPU and by
    device time (``profile.txt``, the ``dte.<phase>`` rows are the sync's phases), the same
    by call site (``stacks.txt``, with ``stacks``) and a Chrome trace (``trace.json.gz``).
    Recording Python stacks about doubles the host's time between kernels: a trace
    without them is the one whose device idle time is close to an unprofiled run's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities, record_shapes=False, with_stack=stacks) as prof:
        fn()
        synchronize(device)
    out.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages()
    (out / "profile.txt").write_text(
        table.table(sort_by="self_cpu_time_total", row_limit=50) + "\n\n"
        + table.table(sort_by=sort, row_limit=50))
    if stacks:
        by_site = prof.key_averages(group_by_stack_n=6)
        (out / "stacks.txt").write_text(
            by_site.table(sort_by="self_cpu_time_total", row_limit=60) + "\n\n"
            + by_site.table(sort_by=sort, row_limit=60))
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(out / "trace.json.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


def step_row(report, total_ms: float, bitwise: bool, stalled: dict) -> dict:
    return {"kind": report.kind.value, "changed": report.changed,
            "payload_bytes": report.payload_bytes, "ms": dict(report.ms),
            "total_ms": total_ms, "bitwise": bitwise, **stalled}


def summary(args, device, numel: int, steps: list[dict], *, full_ms: float, dense_ms: float,
            dense_label: str, bandwidth: float, link_gbps: float) -> dict:
    """The run's JSON: every step, medians of the deltas, computed wire times and floor."""
    dense_bytes = 2 * numel
    deltas = [s for s in steps if s["kind"] == "delta"]
    median = statistics.median(s["total_ms"] for s in deltas) if deltas else float("nan")
    payload = statistics.median(s["payload_bytes"] for s in deltas) if deltas else 0
    changed = statistics.median(s["changed"] for s in deltas) if deltas else 0
    floor = (DETECTOR_BYTES[Method(args.method)] * numel / bandwidth / 1e6
             + payload / link_gbps / 1e6 + APPLY_BYTES * changed / bandwidth / 1e6)
    return {
        "date": datetime.date.today().isoformat(), "sha": args.sha or git_sha(),
        "machine": machine(str(device)), "args": {k: str(v) for k, v in vars(args).items()},
        "params": numel, "dense_bytes": dense_bytes, "copy_bandwidth_gbps": bandwidth,
        "dense_ms": dense_ms, "dense_label": dense_label, "full_sync_ms": full_ms,
        "steps": steps, "delta_median_ms": median, "payload_median_bytes": payload,
        "changed_median": changed, "floor_ms": floor,
        "computed": {"dense_nvlink_ms": dense_bytes / NVLINK_GBPS / 1e6,
                     "delta_nvlink_wire_ms": payload / NVLINK_GBPS / 1e6,
                     "dense_network_ms": dense_bytes / NETWORK_GBPS / 1e6,
                     "delta_network_wire_ms": payload / NETWORK_GBPS / 1e6},
    }


def markdown_row(results: dict, args: argparse.Namespace) -> str:
    """The run's row for ``docs/benchmarks.md``."""
    c = results["computed"]
    full = results.get("steady_full")
    steady = f", {full['median_ms']:.1f} ms steady (bitwise {full['bitwise']})" if full else ""
    command = f"python3 tools/bench_sync.py --method {args.method} --gpus {args.gpus}" + (
        f" --link {args.link}" if args.gpus == 2 else "") + f" --steps {args.steps}"
    return (f"| {results['date']} | `{results['sha']}` | {results['machine']} | `{command}` | "
            f"{results['params'] / 1e9:.2f}e9 | "
            f"{100 * results['changed_median'] / results['params']:.2f} % | "
            f"{results['payload_median_bytes'] / max(results['changed_median'], 1):.2f} B/chg | "
            f"{results['delta_median_ms']:.1f} ms | {results['dense_label']}: "
            f"{results['dense_ms']:.1f} ms | {results['full_sync_ms']:.0f} ms first"
            f"{steady} | "
            f"{c['dense_nvlink_ms']:.1f} / {c['delta_nvlink_wire_ms']:.2f} ms | "
            f"{c['dense_network_ms']:.0f} / {c['delta_network_wire_ms']:.1f} ms | "
            f"{results['floor_ms']:.1f} ms | "
            f"{all(s['bitwise'] for s in results['steps'])} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deltas = [s for s in results["steps"] if s["kind"] == "delta"]
    phases = sorted({p for s in deltas for p in s["ms"]})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(deltas)
    for phase in phases:
        values = [s["ms"].get(phase, 0.0) for s in deltas]
        ax.bar(range(len(deltas)), values, bottom=bottom, label=f"delta: {phase}")
        bottom = [b + v for b, v in zip(bottom, values)]
    lines = [(results["dense_ms"], results["dense_label"], "black"),
             (results["floor_ms"], "floor (computed)", "grey")]
    if results["args"]["gpus"] == "1":
        lines.append((results["computed"]["dense_nvlink_ms"], "dense over NVLink (computed)",
                      "red"))
    for value, label, color in lines:
        ax.axhline(value, linestyle="--", color=color, label=f"{label}: {value:.2f} ms")
    ax.set_xticks(range(len(deltas)))
    ax.set_yscale("log")
    ax.set_xlabel("sync after warm-up")
    ax.set_ylabel("ms")
    gpus = results["args"]["gpus"]
    link = f", {results['args']['link']}" if gpus == "2" else ""
    ax.set_title(f"{results['params'] / 1e9:.2f}e9 params, {results['args']['method']}, "
                 f"{gpus} GPU{link}, {results['machine'].split(';')[0]}, {results['date']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
