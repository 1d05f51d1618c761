"""Soundness of the AdamW inversion on a GPU, at scale, against the snapshot reference.

For each setting (lr, weight decay, torch AdamW implementation, payload dtype) this runs
real ``torch.optim.AdamW`` steps on one large fp32 master on CUDA and compares, after
every step, ``invert_adamw``'s change set with the bitwise diff of the bf16 casts:
missed elements (must be 0), over-reported elements, and whether every reported old
value lies inside the reported bounds. It also times each detector and the codec's
decode + apply on the GPU, as ratios to the snapshot diff and to a dense copy.

Run (GPU machine, from the repository root):
    PYTHONPATH=packages/dte-detector/src:packages/dte-codec/src \
        python3 tools/gpu/check_inversion.py --numel 1e9 --steps 12
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time

import torch
from dte_codec import apply_, decode, encode_delta
from dte_codec.bits import order_keys
from dte_detector import CastDetector, diff, invert_adamw, torch_adamw_states
from dte_detector.inversion import estimate_previous, guard_band

SETTINGS = [(3e-6, 0.003), (1e-5, 0.1), (1e-3, 0.01)]
IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}}
INT_VIEW = {2: torch.int16, 4: torch.int32}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=1e9)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def qwen_like(numel: int, gen: torch.Generator) -> torch.Tensor:
    """N(0, 0.02) weights with 1 % of norm-like weights near 1.0."""
    master = torch.randn(numel, device="cuda", generator=gen).mul_(0.02)
    master[: numel // 100].add_(1.0)
    return master


def cuda_ms(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - start) * 1e3


def mask_of(indices: torch.Tensor, numel: int) -> torch.Tensor:
    mask = torch.zeros(numel, dtype=torch.bool, device="cuda")
    mask[indices.long()] = True
    return mask


def bounds_hold(old: torch.Tensor, change) -> bool:
    bits = old.element_size() * 8
    ints = INT_VIEW[old.element_size()]
    key = order_keys(old.reshape(-1)[change.indices.long()].view(ints), bits)
    return bool(((order_keys(change.base_low.view(ints), bits) <= key)
                 & (key <= order_keys(change.base_high.view(ints), bits))).all())


def error_in_ulps(row: dict, before: torch.Tensor, after: torch.Tensor, state) -> None:
    """Largest |p0 - e| as a fraction of the guard band (sound while below 1)."""
    worst, where = 0.0, None
    for start in range(0, before.numel(), 1 << 26):
        part = slice(start, start + (1 << 26))
        p, p0 = after[part], before[part]
        estimate = estimate_previous(p, state.exp_avg[part], state.exp_avg_sq[part],
                                     state.hyper)
        scale = guard_band(p, estimate, state.hyper)
        ratio = ((p0.double() - estimate.previous.double()).abs() / scale.double())
        ratio = torch.where(torch.isfinite(ratio), ratio, torch.zeros_like(ratio))
        top = int(ratio.argmax())
        if float(ratio[top]) > worst:
            worst = float(ratio[top])
            where = {"p0": float(p0[top]), "p": float(p[top]), "u": float(estimate.update[top]),
                     "m": float(state.exp_avg[part][top]),
                     "v": float(state.exp_avg_sq[part][top]), "e": float(estimate.previous[top])}
    if worst > row.get("worst_fraction", -1.0):
        row["worst_fraction"], row["worst_at"] = worst, where


def run_setting(numel, lr, wd, impl, dtype, args, gen) -> dict:
    param = torch.nn.Parameter(qwen_like(numel, gen))
    optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=wd, **IMPLS[impl])
    row = {"lr": lr, "wd": wd, "impl": impl, "dtype": str(dtype).removeprefix("torch."),
           "changed": 0, "missed": 0, "extra": 0, "bounds_ok": True, "ms": {}}
    times = {"snapshot": [], "adamw": [], "cast": []}
    for step in range(1, args.steps + 1):
        before = param.detach().clone()
        old = before.to(dtype)
        param.grad = torch.randn(numel, device="cuda", generator=gen)
        optimizer.step()
        param.grad = None
        state = torch_adamw_states(optimizer)[0]
        new = param.detach().to(dtype)
        ref, t_ref = cuda_ms(lambda: diff(old, new))
        inv, t_inv = cuda_ms(lambda: invert_adamw(
            "w", param, state.exp_avg, state.exp_avg_sq, state.hyper,
            previous_step=step - 1, dtype=dtype))
        cast = CastDetector()
        _, t_cast = cuda_ms(lambda: cast.record("w", param, old))
        got, want = mask_of(inv.indices, numel), mask_of(ref.indices, numel)
        row["changed"] += int(want.sum())
        row["missed"] += int((want & ~got).sum())
        row["extra"] += int((got & ~want).sum())
        row["bounds_ok"] &= bounds_hold(old, inv)
        error_in_ulps(row, before, param.detach(), state)
        if step > 1:
            for name, t in (("snapshot", t_ref), ("adamw", t_inv), ("cast", t_cast)):
                times[name].append(t)
    row["elements"] = numel * args.steps
    row["ms"] = {k: sorted(v)[len(v) // 2] for k, v in times.items() if v}
    return row


def codec_timing(numel: int, gen: torch.Generator) -> dict:
    """Encode, decode + apply of a ~3 % delta on the GPU, vs a dense bf16 copy."""
    old = (torch.randn(numel, device="cuda", generator=gen) * 0.02).bfloat16()
    new = old.clone()
    picked = torch.rand(numel, device="cuda", generator=gen) < 0.03
    new.view(torch.int16)[picked] += 1
    change = diff(old, new)
    data, t_enc = cuda_ms(lambda: encode_delta({"w": new}, {"w": change}, stream_id="s",
                                               base_version=1, version=2))
    target = {"w": old.clone()}
    payload, t_dec = cuda_ms(lambda: decode(data, device="cuda"))
    _, t_apply = cuda_ms(lambda: apply_(target, payload))
    assert torch.equal(target["w"].view(torch.int16), new.view(torch.int16))
    _, t_copy = cuda_ms(lambda: target["w"].copy_(new))
    return {"numel": numel, "changed": len(change), "payload_bytes": data.nbytes,
            "bytes_per_changed": data.nbytes / len(change), "encode_ms": t_enc,
            "decode_ms": t_dec, "apply_ms": t_apply, "dense_copy_ms": t_copy}


def main() -> None:
    args = parse()
    numel = int(args.numel)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    for lr, wd in SETTINGS:
        for impl in IMPLS:
            rows.append(run_setting(numel, lr, wd, impl, torch.bfloat16, args, gen))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    rows.append(run_setting(numel, 3e-6, 0.003, "fused", torch.float16, args, gen))
    print(json.dumps(rows[-1]), flush=True)
    codec = codec_timing(min(numel, 400_000_000), gen)
    print(json.dumps(codec), flush=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or "unknown"
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sha": sha,
            "date": datetime.date.today().isoformat(), "numel": numel, "steps": args.steps}
    print("| lr | wd | AdamW | dtype | changed | missed | over-reported | bounds hold "
          "| worst error / guard | adamw ms / snapshot ms | cast ms / snapshot ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        print(f"| {r['lr']:g} | {r['wd']:g} | {r['impl']} | {r['dtype']} "
              f"| {r['changed'] / r['elements']:.2%} | {r['missed']} "
              f"| {r['extra'] / r['elements']:.2e} | {r['bounds_ok']} "
              f"| {r['worst_fraction']:.3f} "
              f"| {ms['adamw']:.1f} / {ms['snapshot']:.1f} | {ms['cast']:.1f} / "
              f"{ms['snapshot']:.1f} |")
    print(f"meta: {json.dumps(meta)}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "inversion": rows, "codec": codec}, fh, indent=1)
    if any(r["missed"] or not r["bounds_ok"] for r in rows):
        raise SystemExit("UNSOUND: a change was missed or a bound did not hold")


if __name__ == "__main__":
    main()
