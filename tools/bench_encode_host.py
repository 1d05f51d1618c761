"""Host time of the sender's encoders for a Qwen3-4B-shaped tensor set (290 tensors in
Megatron's layout, dimensions divided by ``--shrink``): ``encode_delta`` on its fused
path (``encode_delta_batched``, what a GPU runs; about half the tensors changed, the
rest empty change sets) and ``encode_full``.

The Triton launches are replaced by no-ops and the kernels run on CPU tensors
(``dispatch.interpreted()``), so what is timed is exactly the Python, numpy and torch
host work a GPU sync waits on between kernels (table building, plan, header, digest
tables), not the device work. Only kernel names the encoder has had since the fused path
landed are stubbed, so the script times an older tree too (``PYTHONPATH`` pointing at
its ``src`` folders) for before/after figures on one machine.

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
from provenance import git_sha, machine


class _NoLaunch:
    """Stands for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


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


def timed(fn, reps: int) -> tuple[float, float]:
    """Median and least ms of ``fn()`` over ``reps`` runs after two warm-ups."""
    fn(), fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), min(samples)


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
    for kernel in ("_stats", "_escape_counts", "_write"):
        setattr(encode_kernel, kernel, _NoLaunch())
    body_digest_kernel._digest = _NoLaunch()
    version = iter(range(1, 1 << 30))
    with dispatch.interpreted():
        delta = timed(lambda: encode_delta_batched(weights, change, stream_id="s",
                                           base_version=next(version), version=1 << 40), a.reps)
        full = timed(lambda: encode_full(weights, stream_id="s", version=next(version)), a.reps)
    changed = sum(1 for c in change.values() if c.indices.numel())
    print(f"| encode host {a.label} | {len(weights)} tensors, {changed} changed | encode_delta "
          f"{delta[0]:.2f} ms (least {delta[1]:.2f}) | encode_full {full[0]:.2f} ms "
          f"(least {full[1]:.2f}) | {machine('cpu')} | {git_sha()} | "
          f"{datetime.date.today()} |")


if __name__ == "__main__":
    main()
