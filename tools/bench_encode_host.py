"""Host time of the sender's encoders for a Qwen3-4B-shaped tensor set (290 tensors in
Megatron's layout, dimensions divided by ``--shrink``): ``encode_delta`` on its fused
path (``encode_delta_batched``, what a GPU runs) and ``encode_full``. Two deltas: about
half the tensors changed (the matrices; the rest empty change sets), and every tensor
changed as in ``bench_sync``, with change sets shaped as the batched detectors leave them
(groups of up to ``batch.GROUP_ELEMENTS`` elements of the full-size model, each one
flat indices buffer and two bounds buffers): as per-tensor views, and, where the tree
has it, as ``dte_detector.FlatChanges``.

The Triton launches are replaced by no-ops and the kernels run on CPU tensors
(``dispatch.interpreted()``), so what is timed is exactly the Python, numpy and torch
host work a GPU sync waits on between kernels (table building, plan, header, digest
tables), not the device work; also the part of it before ``_stats`` is queued (the GPU
idles meanwhile), and from then until ``_escape_counts`` is (the statistics' kernel,
1.9 ms on an H200 for bench_sync's delta, covers the host work before their read; the
rest, after it, is GPU idle time). Only kernel names the encoder has had since the fused path
landed are stubbed (and ``block_kernel``'s where the tree has it; an older tree's
``repeat_interleave`` in its place runs as CPU torch ops), so the script times an older
tree too (``PYTHONPATH`` pointing at its ``src`` folders) for before/after figures on
one machine.

Times are the process's CPU time (one torch thread), so other work on a shared host
does not count.

    uv run python tools/bench_encode_host.py --reps 30
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from types import SimpleNamespace

import torch
from dte_codec import body_digest_kernel, dispatch, encode_full, encode_kernel
from dte_codec.encode import encode_delta_batched
from dte_detector.batch import GROUP_ELEMENTS
from provenance import git_sha, machine
from torch.utils._python_dispatch import TorchDispatchMode


class _NoLaunch:
    """Stands for a Triton kernel: ``kernel[grid](...)`` does nothing but count."""

    launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _NoLaunch.launches += 1
        return launch


_NOT_KERNELS = ("empty", "empty_strided", "_to_copy", "copy_", "lift_fresh", "lift_fresh_copy",
                "_local_scalar_dense", "is_pinned", "_pin_memory", "set_", "resize_")
"""Aten ops that launch no kernel on a GPU (allocations, the scalar read), or copies
(on CPU tensors a host-device copy is no op to see; those are counted from the code)."""


class _DeviceOps(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel on a GPU: all but views and
    ``_NOT_KERNELS``. An op that is one aten call may be several CUDA kernels (a cumsum
    over a 1-d tensor: two; ``repeat_interleave``: three, besides its arange and gather)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in _NOT_KERNELS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def device_ops(fn) -> int:
    """Aten kernel ops (``_DeviceOps``) and Triton launches of one ``fn()``."""
    launched = _NoLaunch.launches
    with _DeviceOps() as mode:
        fn()
    return mode.ops + _NoLaunch.launches - launched


def qwen3_4b(shrink: int) -> dict[str, tuple[int, ...]]:
    """The 290 tensors of Qwen3-4B in Megatron's layout (fused QKV and FC1)."""
    hidden, ffn, heads, groups, head_dim, vocab = 2560, 9728, 32, 8, 128, 151936
    h, f, d, v = hidden // shrink, ffn // shrink, head_dim // shrink, vocab // shrink
    shapes = {"embedding.word_embeddings.weight": (v, h)}
    for layer in range(36):
        p = f"decoder.layers.{layer}."
        shapes |= {p + "self_attention.linear_qkv.layer_norm_weight": (h,),
                   p + "self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, h),
                   p + "self_attention.q_layernorm.weight": (d,),
                   p + "self_attention.k_layernorm.weight": (d,),
                   p + "self_attention.linear_proj.weight": (h, heads * d),
                   p + "mlp.linear_fc1.layer_norm_weight": (h,),
                   p + "mlp.linear_fc1.weight": (2 * f, h),
                   p + "mlp.linear_fc2.weight": (h, f)}
    return shapes | {"decoder.final_layernorm.weight": (h,)}


def changes(weights: dict[str, torch.Tensor], fraction: float) -> dict[str, SimpleNamespace]:
    """Every ``1/fraction``-th element of each matrix; vectors unchanged."""
    out = {}
    for name, w in weights.items():
        step = int(1 / fraction) if w.dim() > 1 else w.numel() + 1
        idx = torch.arange(0, w.numel() if w.dim() > 1 else 0, step, dtype=torch.int32)
        base = w.reshape(-1)[idx.long()]
        out[name] = SimpleNamespace(indices=idx, base_low=base, base_high=base)
    return out


def detected(weights: dict[str, torch.Tensor], fraction: float, shrink: int) -> list:
    """Every tensor with about ``fraction`` of its elements changed, as detector runs:
    ``(names, counts, indices, low, high)`` per group of the full-size model."""
    limit = GROUP_ELEMENTS // shrink ** 2  # the groups of the full-size model
    groups, size = [[]], 0
    for name, w in weights.items():
        if groups[-1] and size + w.numel() > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += w.numel()
    step = int(1 / fraction)
    runs = []
    for names in groups:
        idx = [torch.arange(k % min(step, weights[n].numel()), weights[n].numel(), step,
                            dtype=torch.int32)
               for k, n in enumerate(names)]
        bounds = torch.stack([torch.cat([weights[n].reshape(-1)[i.long()] for n, i in
                                         zip(names, idx)])] * 2)
        runs.append((tuple(names), tuple(i.numel() for i in idx), torch.cat(idx), bounds[0],
                     bounds[1]))
    return runs


def as_views(runs: list) -> dict[str, SimpleNamespace]:
    """The runs as per-tensor change sets (views), as the detectors returned them before
    ``FlatChanges``."""
    out = {}
    for names, counts, idx, low, high in runs:
        for name, i, lo, hi in zip(names, idx.split(counts), low.split(counts),
                                   high.split(counts)):
            out[name] = SimpleNamespace(indices=i, base_low=lo, base_high=hi)
    return out


def as_flat(runs: list, names: list[str]):
    """The runs as ``FlatChanges``, or None in a tree without it."""
    try:
        from dte_detector import ChangeRun, FlatChanges
    except ImportError:
        return None
    return FlatChanges(names, [ChangeRun(*run) for run in runs], {})


class _FirstLaunch(_NoLaunch):
    """``_NoLaunch`` that notes when it is first launched after ``start``: the host time
    before the encoder's first kernel, which the GPU spends idle."""

    def __init__(self):
        self.at = None

    def __getitem__(self, grid):
        if self.at is None:
            self.at = time.process_time()
        return super().__getitem__(grid)


def timed(fn, reps: int, first: _FirstLaunch, second: _FirstLaunch
          ) -> tuple[float, float, float, float]:
    """Median and least ms of ``fn()`` over ``reps`` runs after two warm-ups, the median
    ms before ``first`` was launched, and from then until ``second`` was."""
    fn(), fn()
    samples, before, between = [], [], []
    for _ in range(reps):
        first.at = second.at = None
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1e3)
        before.append(((first.at or start) - start) * 1e3)
        between.append(((second.at or start) - (first.at or start)) * 1e3)
    return (statistics.median(samples), min(samples), statistics.median(before),
            statistics.median(between))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shrink", type=int, default=64,
                   help="divide the dimensions: the host work does not depend on sizes")
    p.add_argument("--fraction", type=float, default=0.03)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--label", default="")
    a = p.parse_args()
    torch.set_num_threads(1)  # the host work is single-threaded; pool wake-ups are noise
    torch.manual_seed(0)
    weights = {n: torch.randn(s).bfloat16() for n, s in qwen3_4b(a.shrink).items()}
    change = changes(weights, a.fraction)
    encode_kernel._write = _NoLaunch()
    encode_kernel._stats = first = _FirstLaunch()
    encode_kernel._escape_counts = second = _FirstLaunch()
    body_digest_kernel._digest = _NoLaunch()
    try:  # the block -> segment table's kernel, in trees that have it
        from dte_codec import block_kernel
        block_kernel._owners = _NoLaunch()
    except ImportError:
        pass
    runs = detected(weights, a.fraction, a.shrink)
    cases = {"matrices changed": change, "all changed, views": as_views(runs),
             "all changed, flat": as_flat(runs, list(weights))}
    version = iter(range(1, 1 << 30))
    with dispatch.interpreted():
        for label, found in cases.items():
            if found is None:
                continue
            def encode():
                return encode_delta_batched(weights, found,  # noqa: B023 (called at once)
                                            stream_id="s", base_version=next(version),
                                            version=1 << 40)
            delta = timed(encode, a.reps, first, second)
            ops = device_ops(encode)
            changed = sum(1 for name in found if found[name].indices.numel())
            print(f"| encode host {a.label} | {len(weights)} tensors, {changed} changed "
                  f"({label}) | encode_delta {delta[0]:.2f} ms (least {delta[1]:.2f}; "
                  f"{delta[2]:.2f} before ``_stats`` is queued, then {delta[3]:.2f} until "
                  f"``_escape_counts`` is; {ops} device ops) | "
                  f"{machine('cpu')} | {git_sha()} | {datetime.date.today()} |")
        full = timed(lambda: encode_full(weights, stream_id="s", version=next(version)), a.reps,
                     _FirstLaunch(), _FirstLaunch())
    print(f"| encode host {a.label} | {len(weights)} tensors | encode_full {full[0]:.2f} ms "
          f"(least {full[1]:.2f}) | {machine('cpu')} | {git_sha()} | {datetime.date.today()} |")


if __name__ == "__main__":
    main()
