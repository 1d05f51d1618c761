"""Batched (flat) encode and decode against the per-tensor reference, on one GPU.

A 4.02e9-parameter Qwen3-4B-shaped set of bf16 tensors in Megatron's fused layout (290
tensors: per layer the fused qkv, the attention output, the fused gate/up, the down
projection and four norms; embeddings and the final norm) lives on the GPU with change
sets drawn at --changed (3.3 %) per tensor: each changed element moved from its base by
+-1 ulp (87 %) or by up to +-64 ulps, bounds exact. In one process it times and profiles:

* encode: ``encode_delta_per_tensor`` (the reference, the path before the batching),
  ``encode_delta_batched`` on torch ops (``dispatch.reference()``) and on the fused
  Triton kernels (``encode_delta``'s path on a GPU), checking that the bytes are identical;
* decode: ``decode_per_entry``, then ``decode_batched`` on torch ops and on the kernels,
  checking that the indices are identical;
* values: ``values.decode_values`` per entry, then ``flat_values.resolve_residues`` on
  torch ops and on the kernels, against the receiver's base values, checking the values;
* apply: ``apply_`` of the whole payload on torch ops (batched values, per-entry scatters)
  and on the kernels (one gather, one scatter), checking the receiver bit for bit.

Per path: wall time (median of --reps after one warm-up, CUDA synchronized), and from one
torch.profiler run the kernel launches, memcpys and host synchronizations
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, synchronous ``cudaMemcpy``; those
of an empty profiled window subtracted), the GPU kernel time and the top kernels. Prints
one JSON object and Markdown rows for ``docs/benchmarks.md``.

    PYTHONPATH=packages/dte-codec/src:tools python3 tools/gpu/bench_codec_batched.py
    PYTHONPATH=packages/dte-codec/src:tools python3 tools/gpu/bench_codec_batched.py --smoke

``--encoder-shape BLOCK WARPS`` and ``--decoder-block BLOCK`` set the fused kernels'
program shapes for the run (the bytes and indices are checked all the same), so one device
call can sweep them:

    for s in "1024 16" "512 8" "256 4" "128 2"; do PYTHONPATH=packages/dte-codec/src:tools \
        python3 tools/gpu/bench_codec_batched.py --encode-only --reps 5 --encoder-shape $s; done

``--encode-only`` times the fused encoder alone (the reference runs once, untimed, for the
bytes check): run it with two trees' ``PYTHONPATH`` in one session for a before/after.
``--decode-only`` times the fused decoder alone on a device frame, its indices checked
against the change sets; ``--payload FILE`` reads the encoded delta from FILE (the first
run encodes and writes it), so trees compared in one session decode the same bytes:

    PYTHONPATH=<tree>/packages/dte-codec/src:tools python3 tools/gpu/bench_codec_batched.py \
        --decode-only --payload /tmp/delta.bin
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from provenance import git_sha, machine
from torch.profiler import ProfilerActivity, profile

from dte_codec import Frame, apply_
from dte_codec.decode import decode_batched, decode_per_entry
from dte_codec.dispatch import reference
from dte_codec.encode import encode_delta_batched, encode_delta_per_tensor
from dte_codec.encodings import ValueEncoding
from dte_codec.flat_values import resolve_residues
from dte_codec.values import decode_values

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
MEMCPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 36), ("--hidden", 2560), ("--intermediate", 9728),
                          ("--heads", 32), ("--kv-heads", 8), ("--head-dim", 128),
                          ("--vocab", 151936)):  # Qwen3-4B
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--changed", type=float, default=0.033)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="a tiny model, to check the script")
    p.add_argument("--encode-only", action="store_true",
                   help="time the fused encoder alone (its bytes still checked against the "
                        "reference, run once untimed), e.g. to compare two trees in one run")
    p.add_argument("--decode-only", action="store_true",
                   help="time the fused decoder alone (its indices checked against the change "
                        "sets), e.g. to compare two trees in one run")
    p.add_argument("--payload", type=Path, default=None,
                   help="with --decode-only: the encoded delta's file, written if missing")
    p.add_argument("--encoder-shape", type=int, nargs=2, metavar=("BLOCK", "WARPS"),
                   default=None, help="the fused encoder's elements and warps per program "
                   "(default: encode_kernel's), e.g. to sweep them in one run")
    p.add_argument("--decoder-block", type=int, default=None,
                   help="the fused decoder's elements per program (default: decode_kernel's)")
    p.add_argument("--write-registers", type=int, default=None,
                   help="cap _write's registers per thread (maxnreg; 0: no cap)")
    p.add_argument("--fields-registers", type=int, default=None,
                   help="cap _fields' registers per thread (maxnreg; 0: no cap)")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.intermediate, args.vocab = 2, 64, 192, 1000
        args.heads, args.kv_heads, args.head_dim = 4, 2, 16
    return args


def shapes(a: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    q, kv, h = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.hidden
    out = {"embedding.word_embeddings.weight": (a.vocab, h)}
    for i in range(a.layers):
        p = f"decoder.layers.{i}."
        out.update({p + "self_attention.linear_qkv.layer_norm_weight": (h,),
                    p + "self_attention.linear_qkv.weight": (q + 2 * kv, h),
                    p + "self_attention.q_layernorm.weight": (a.head_dim,),
                    p + "self_attention.k_layernorm.weight": (a.head_dim,),
                    p + "self_attention.linear_proj.weight": (h, q),
                    p + "mlp.linear_fc1.layer_norm_weight": (h,),
                    p + "mlp.linear_fc1.weight": (2 * a.intermediate, h),
                    p + "mlp.linear_fc2.weight": (h, a.intermediate)})
    out["decoder.final_layernorm.weight"] = (h,)
    return out


class Change:
    def __init__(self, indices: torch.Tensor, base: torch.Tensor):
        self.indices, self.base_low, self.base_high = indices, base, base


def trajectory(a: argparse.Namespace, device: torch.device):
    """Current weights, base weights (the receiver's) and exact change sets."""
    gen = torch.Generator(device=device).manual_seed(0)
    weights, bases, changes = {}, {}, {}
    for name, shape in shapes(a).items():
        w = (torch.randn(shape, device=device, generator=gen) * 0.02).to(torch.bfloat16)
        flat = w.view(-1).view(torch.int16)
        mask = torch.rand(flat.numel(), device=device, generator=gen) < a.changed
        indices = torch.nonzero(mask).view(-1)
        small = torch.rand(indices.numel(), device=device, generator=gen) < 0.87
        step = torch.where(small, 1, torch.randint(2, 65, indices.shape, device=device,
                                                   generator=gen))
        sign = torch.where(torch.rand(indices.numel(), device=device, generator=gen) < 0.5,
                           -1, 1)
        old = (flat[indices].to(torch.int32) + sign * step).to(torch.int16)
        base = w.clone()
        base.view(-1).view(torch.int16)[indices] = old
        weights[name], bases[name] = w, base
        changes[name] = Change(indices, old.view(torch.bfloat16))
        del mask, small, step, sign
    return weights, bases, changes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> tuple[list[float], object]:
    out = fn()  # warm-up
    sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times, out


def profiled(fn: Callable[[], object], device: torch.device) -> dict[str, float]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sync(device)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    counts = {"launches": 0, "memcpys": 0, "syncs": 0, "kernel_ms": 0.0}
    for event in prof.key_averages():
        if event.key in LAUNCH_CALLS:
            counts["launches"] += event.count
        if event.key in MEMCPY_CALLS:
            counts["memcpys"] += event.count
        if event.key in SYNC_CALLS:
            counts["syncs"] += event.count
        device_time = getattr(event, "self_device_time_total", 0.0)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts["kernel_ms"] += device_time / 1e3
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -getattr(e, "self_device_time_total", 0.0))
    counts["top_kernels"] = [(e.key[:60], e.count,
                              round(getattr(e, "self_device_time_total", 0.0) / 1e3, 2))
                             for e in kernels[:6]]
    return counts


def measure(name: str, fn: Callable[[], object], a: argparse.Namespace,
            device: torch.device, results: dict) -> object:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    times, out = timed(fn, a.reps, device)
    counts = profiled(fn, device)
    for key, baseline in profiled(lambda: None, device).items():
        if key in ("launches", "memcpys", "syncs"):
            counts[key] -= baseline  # the profiler window's own (its closing synchronize)
    extra = {}
    if device.type == "cuda":
        extra["peak_extra_gb"] = (torch.cuda.max_memory_allocated(device) - before) / 1e9
    results[name] = {"median_ms": statistics.median(times), "times_ms": times, **extra,
                     **counts}
    print(name, json.dumps(results[name]), flush=True)
    return out


def main() -> None:
    a = parse()
    if a.encoder_shape is not None:  # read by the encoder's host code at each call
        from dte_codec import encode_kernel
        encode_kernel.BLOCK, encode_kernel.WARPS = a.encoder_shape
    if a.decoder_block is not None:
        from dte_codec import decode_kernel
        decode_kernel.BLOCK = a.decoder_block
    if a.write_registers is not None:
        from dte_codec import encode_kernel
        encode_kernel.REGISTERS = a.write_registers or None
    if a.fields_registers is not None:
        from dte_codec import decode_kernel
        decode_kernel.REGISTERS = a.fields_registers or None
    device = torch.device(a.device)
    weights, bases, changes = trajectory(a, device)
    changed = sum(c.indices.numel() for c in changes.values())
    params = sum(w.numel() for w in weights.values())
    results: dict = {"params": params, "tensors": len(weights), "changed": changed}
    args = {"stream_id": "bench", "base_version": 0, "version": 1}
    if a.encode_only:
        _encode_only(weights, changes, args, a, device, results)
        return
    if a.decode_only:
        _decode_only(weights, changes, args, a, device, results)
        return
    ref = measure("encode_reference", lambda: encode_delta_per_tensor(weights, changes, **args),
                  a, device, results)
    flat = both("encode", lambda: encode_delta_batched(weights, changes, **args), a, device,
                results)
    results["bytes_identical"] = all(bytes(ref) == bytes(out) for out in flat)
    flat = flat[1]
    results["payload_bytes"] = flat.nbytes
    results["bytes_per_changed"] = flat.nbytes / changed
    del ref
    expected = measure("decode_reference", lambda: decode_per_entry(flat, device=device), a,
                       device, results)
    decoded = both("decode", lambda: decode_batched(flat, device=device), a, device, results)
    results["indices_identical"] = all(
        all(torch.equal(w, g) for w, g in zip(expected.indices, out.indices))
        for out in decoded)
    payload = decoded[1]
    _values(payload, bases, a, device, results)
    receiver = {n: b.clone() for n, b in bases.items()}

    def apply_once() -> None:
        for n, b in bases.items():
            receiver[n].copy_(b)
        apply_(receiver, payload)

    def applied_equal() -> bool:
        return all(torch.equal(receiver[n].view(torch.int16), weights[n].view(torch.int16))
                   for n in weights)

    with reference():
        measure("apply_torch", apply_once, a, device, results)
    results["applied_equal_torch"] = applied_equal()
    measure("apply_fused", apply_once, a, device, results)
    results["applied_equal_fused"] = applied_equal()
    results.update(sha=git_sha(), machine=machine(a.device),
                   date=datetime.date.today().isoformat())
    print(json.dumps(results))
    _rows(results)


def _values(payload, bases: dict, a: argparse.Namespace, device: torch.device,
            results: dict) -> None:
    """The residue values of ``payload`` resolved against ``bases``: per entry (the
    reference) and batched, and whether they are identical (what they hold is freed on
    return)."""
    residue = [(e, w, v) for e, w, v in zip(payload.header.entries, payload.indices,
                                            payload.values)
               if e.value_encoding == ValueEncoding.RESIDUE]
    base_values = [bases[e.name].view(-1)[w] for e, w, _ in residue]
    want = measure("values_reference", lambda: [decode_values(e, v, b) for (e, _, v), b
                                                in zip(residue, base_values)], a, device,
                   results)
    got = both("values", lambda: resolve_residues([e for e, _, _ in residue],
                                                  [v for _, _, v in residue], base_values),
               a, device, results)
    results["values_identical"] = all(
        all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(want, out[0]))
        for out in got)


def _encode_only(weights: dict, changes: dict, args: dict, a: argparse.Namespace,
                 device: torch.device, results: dict) -> None:
    expected = bytes(encode_delta_per_tensor(weights, changes, **args))
    out = measure("encode_fused", lambda: encode_delta_batched(weights, changes, **args), a,
                  device, results)
    results.update(bytes_identical=expected == bytes(out), payload_bytes=out.nbytes,
                   sha=git_sha(), machine=machine(a.device),
                   date=datetime.date.today().isoformat())
    print(json.dumps(results))
    _rows(results, keys=("encode_fused",))


def _decode_only(weights: dict, changes: dict, args: dict, a: argparse.Namespace,
                 device: torch.device, results: dict) -> None:
    if a.payload is not None and a.payload.exists():
        data = a.payload.read_bytes()
    else:
        data = bytes(encode_delta_batched(weights, changes, **args))
        if a.payload is not None:
            a.payload.write_bytes(data)
    frame = Frame.from_bytes(data).to(device)
    out = measure("decode_fused", lambda: decode_batched(frame, device=device), a, device,
                  results)
    found = {entry.name: at for entry, at in zip(out.header.entries, out.indices)}
    empty = torch.empty(0, dtype=torch.int64, device=device)
    results.update(indices_identical=found.keys() <= changes.keys() and all(
        torch.equal(found.get(name, empty), change.indices) for name, change in changes.items()),
        payload_bytes=len(data), sha=git_sha(), machine=machine(a.device),
        date=datetime.date.today().isoformat())
    print(json.dumps(results))
    _rows(results, keys=("decode_fused",))


def both(what: str, fn: Callable[[], object], a: argparse.Namespace, device: torch.device,
         results: dict) -> tuple[object, object]:
    """``fn`` measured on torch ops (``dispatch.reference()``), then on the kernels."""
    with reference():
        torch_out = measure(f"{what}_torch", fn, a, device, results)
    return torch_out, measure(f"{what}_fused", fn, a, device, results)


PATHS = (("encode_reference", "encode, per tensor"), ("encode_torch", "encode, batched torch"),
         ("encode_fused", "encode, fused kernels"), ("decode_reference", "decode, per entry"),
         ("decode_torch", "decode, batched torch"), ("decode_fused", "decode, fused kernels"),
         ("values_reference", "values, per entry"), ("values_torch", "values, batched torch"),
         ("values_fused", "values, fused kernels"), ("apply_torch", "apply_, batched torch"),
         ("apply_fused", "apply_, fused kernels"))


def _rows(r: dict, keys: tuple[str, ...] | None = None) -> None:
    """The rows of ``docs/benchmarks.md``'s table: wall ms, launches, host syncs, memcpys,
    kernel ms, peak extra GPU GB per path (``keys``: those paths only)."""
    command = ("`PYTHONPATH=packages/dte-codec/src:tools python3 "
               f"tools/gpu/bench_codec_batched.py {' '.join(sys.argv[1:])}`")
    for key, label in PATHS:
        if keys is not None and key not in keys:
            continue
        m = r[key]
        print(f"| {r['date']} | `{r['sha']}` | {r['machine']} | {command} | {label} | "
              f"{m['median_ms']:.1f} | {m['launches']:,} | {m['syncs']:,} | {m['memcpys']:,} | "
              f"{m['kernel_ms']:.1f} | {m.get('peak_extra_gb', 0.0):.2f} |")


if __name__ == "__main__":
    main()
