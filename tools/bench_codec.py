"""Bytes per changed element of the delta codec on real AdamW trajectories, peers alongside.

Model: a scaled-down Qwen3 (HF names; per layer q/k/v/o projections with GQA,
q_norm/k_norm, gate/up/down, input and post-attention RMSNorms; embeddings, final norm
and an untied lm_head) as fp32 masters, matrices ~N(0, 0.02), norms at 1.0, stepped by a
real ``torch.optim.AdamW`` (lr 3e-6, weight decay 0.003 by default).

Gradients: random with structure. Per tensor a log-uniform scale in [10^-4.5, 10^-3] and a
step-to-step correlation ``rho`` drawn from [0, --grad-corr-max] (a fixed direction plus
fresh noise); per output row a log-normal scale; embedding rows get a gradient only for
tokens drawn from a Zipf(1.1) distribution (--embed-tokens draws per step). Adam divides
the scale out (up to eps), so the share of bf16 elements that change per step follows
lr/|w|, ``rho`` and the age of the moments: ~10 % at step 1, falling under 5 % within a
few steps. The --warmup-steps steps before measuring are printed but not synced; one
full sync then seeds the receiver, and every measured step is a delta.

Ours: each measured step goes through the product path, ``areal_dte.TorchActor`` with
``Method.ADAMW`` (change sets inverted from the AdamW state, guard band included), a
``dte_transport.Sender`` and a ``Receiver`` over a loopback link; the receiver must end
bit-identical to the trainer's bf16 weights (asserted; so no true change is missing
from the change set, which may over-report). The snapshot-exact variant encodes the bitwise
diff with ``encode_delta``, decodes it and applies it onto the previous weights
(asserted equal). Bytes per changed element = whole payload (header included) / number
of truly changed elements (the snapshot diff), averaged over the measured steps.

Peers on the same steps, each one zstd frame per step, with no names, shapes or
versions (which favours them): int32 index + bf16 value; the same + zstd; slime's method
(XOR of the old and new bf16 tensors, dense, + zstd); int32 gaps + int16 bit-pattern
deltas + zstd; and our payload + zstd (information only).

Timing: on the last measured step, our encode and decode+apply against the dense path
(``encode_full``; decode + apply of the full payload), --timing-warmup untimed runs then
--reps timed runs, median and p90, ratios to dense. Absolute times are informational.

Output: a per-step table, where our bytes go, timings, one Markdown row for
``docs/benchmarks.md``, and as the last line ``bytes_per_changed=<ours> baseline=6.0``.

    uv run python tools/bench_codec.py            # ~29M params, a few minutes on 2 cores
    uv run python tools/bench_codec.py --quick    # tiny smoke run
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping

import torch
from provenance import git_sha, machine
from areal_dte import Method, TorchActor
from codec_measure import (RecordingLoopback, RecordingSender, assert_same, bits, clone,
                           measure_step, time_codec)
from dte_transport import Receiver, SyncKind

BASELINE_BYTES = 6.0
"""int32 index + bf16 value per changed element: the public anchor."""
DTYPE = torch.bfloat16
INIT_STD = 0.02
ADAMW_IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True},
               "fused": {"fused": True}}
QUICK = {"hidden": 64, "intermediate": 192, "layers": 2, "heads": 4, "kv_heads": 2,
         "head_dim": 16, "vocab": 1024, "embed_tokens": 256, "warmup_steps": 4, "steps": 3,
         "reps": 1, "timing_warmup": 0}
COLUMNS = ("adamw", "snapshot", "int32_bf16", "int32_bf16_zstd", "slime_xor_zstd",
           "gap_delta_zstd", "ours_zstd")
LABELS = {"adamw": "ours", "snapshot": "ours snap", "int32_bf16": "i32+bf16",
          "int32_bf16_zstd": "i32+bf16+zstd", "slime_xor_zstd": "slime xor+zstd",
          "gap_delta_zstd": "gap+delta+zstd", "ours_zstd": "ours+zstd"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    size = p.add_argument_group("model (Qwen3-shaped)")
    for flag, default, help_ in (("--hidden", 512, None), ("--intermediate", 1536, None),
                                 ("--layers", 4, None), ("--heads", 8, "query heads"),
                                 ("--kv-heads", 4, "key/value heads (GQA)"),
                                 ("--head-dim", 64, None), ("--vocab", 16384, None)):
        size.add_argument(flag, type=int, default=default, help=help_)
    run = p.add_argument_group("trajectory")
    run.add_argument("--warmup-steps", type=int, default=8,
                     help="optimizer steps before the full seed sync (not measured)")
    run.add_argument("--steps", type=int, default=10, help="measured delta steps")
    run.add_argument("--lr", type=float, default=3e-6)
    run.add_argument("--wd", type=float, default=0.003, help="AdamW weight decay")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--grad-corr-max", type=float, default=0.5,
                     help="per-tensor step-to-step gradient correlation drawn from [0, this]")
    run.add_argument("--embed-tokens", type=int, default=8192,
                     help="Zipf token draws per step giving embedding rows a gradient; 0: all")
    run.add_argument("--adamw-impl", choices=sorted(ADAMW_IMPLS), default="fused",
                     help="torch AdamW kernel (fused: one pass, the fastest on CPU)")
    run.add_argument("--device", default="cpu")
    meas = p.add_argument_group("measurement")
    meas.add_argument("--reps", type=int, default=5, help="timed runs (on the last step)")
    meas.add_argument("--timing-warmup", type=int, default=1, help="untimed runs before")
    meas.add_argument("--zstd-level", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    args = p.parse_args(argv)
    if args.quick:  # quick sizes; flags given explicitly still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.steps < 1 or args.reps < 1:
        p.error("--steps and --reps must be >= 1")
    return args


# --- model and gradients ---------------------------------------------------------------

def qwen3_shapes(a: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Qwen3 causal LM (HF names), untied lm_head."""
    q, kv, h = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.hidden
    shapes = {"model.embed_tokens.weight": (a.vocab, h)}
    for i in range(a.layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        shapes.update({
            attn + "q_proj.weight": (q, h), attn + "k_proj.weight": (kv, h),
            attn + "v_proj.weight": (kv, h), attn + "o_proj.weight": (h, q),
            attn + "q_norm.weight": (a.head_dim,), attn + "k_norm.weight": (a.head_dim,),
            mlp + "gate_proj.weight": (a.intermediate, h),
            mlp + "up_proj.weight": (a.intermediate, h),
            mlp + "down_proj.weight": (h, a.intermediate),
            f"model.layers.{i}.input_layernorm.weight": (h,),
            f"model.layers.{i}.post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (a.vocab, h)
    return shapes


def init_masters(shapes: Mapping[str, tuple[int, ...]], gen: torch.Generator,
                 device: str) -> dict[str, torch.Tensor]:
    """fp32 masters: RMSNorm weights at 1.0, matrices ~N(0, INIT_STD)."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, device=device)
        else:
            out[name] = torch.randn(shape, generator=gen, device=device).mul_(INIT_STD)
        out[name].requires_grad_(True)
    return out


class Gradients:
    """Structured random gradients (see the module docstring), one call per tensor per step."""

    def __init__(self, masters: Mapping[str, torch.Tensor], a: argparse.Namespace,
                 gen: torch.Generator):
        self.gen, self.embed_tokens = gen, a.embed_tokens
        dev = next(iter(masters.values())).device
        uniform = torch.rand(2 * len(masters), generator=gen, device=dev).tolist()
        self.rho, self.scale = {}, {}
        for k, (name, t) in enumerate(masters.items()):
            self.rho[name] = a.grad_corr_max * uniform[2 * k]
            scale = torch.full((), 10 ** (-4.5 + 1.5 * uniform[2 * k + 1]), device=dev)
            if t.dim() == 2:  # log-normal per output row
                scale = scale * torch.randn((t.shape[0], 1), generator=gen, device=dev).mul_(
                    0.5).exp_()
            self.scale[name] = scale
        self.persistent = {n: torch.randn(t.shape, generator=gen, device=dev)
                           for n, t in masters.items()}
        ranks = torch.arange(1, a.vocab + 1, dtype=torch.float64, device=dev)
        self.zipf = (ranks ** -1.1)[torch.randperm(a.vocab, generator=gen, device=dev)]

    def __call__(self, name: str, like: torch.Tensor) -> torch.Tensor:
        rho, scale = self.rho[name], self.scale[name]
        g = torch.randn(like.shape, generator=self.gen, device=like.device)
        g.mul_(math.sqrt(1 - rho * rho) * scale).addcmul_(self.persistent[name], rho * scale)
        if name.endswith("embed_tokens.weight") and self.embed_tokens:
            seen = torch.multinomial(self.zipf, self.embed_tokens, replacement=True,
                                     generator=self.gen)
            hit = torch.zeros(like.shape[0], 1, dtype=g.dtype, device=like.device)
            hit[seen] = 1
            g.mul_(hit)
        return g


# --- the trajectory -------------------------------------------------------------------

def trajectory(a) -> tuple[list[dict], dict, int]:
    """Warm-up, the full seed sync and the measured delta steps; time the last one."""
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    masters = init_masters(qwen3_shapes(a), gen, a.device)
    numel = sum(m.numel() for m in masters.values())
    grads = Gradients(masters, a, gen)
    optimizer = torch.optim.AdamW(list(masters.values()), lr=a.lr, weight_decay=a.wd,
                                  **ADAMW_IMPLS[a.adamw_impl])
    receiver = Receiver({n: torch.empty_like(m, dtype=DTYPE) for n, m in masters.items()},
                        device=a.device)
    link = RecordingLoopback(receiver)
    sender = RecordingSender(link, anchor_interval=0, stream_id="bench-codec")
    actor = TorchActor(masters, optimizer, sender, method=Method.ADAMW, dtype=DTYPE)

    def step() -> None:
        for name, master in masters.items():
            master.grad = grads(name, master)
        actor.step()

    _print_header(numel, a)
    for k in range(1, a.warmup_steps + 1):
        before = clone(actor.model)
        step()
        flips = sum(int((bits(before[n]) != bits(t)).sum()) for n, t in actor.model.items())
        print(f"{k:>4} {flips:>9} {100 * flips / numel:>5.2f}   (warm-up, not synced)",
              flush=True)
    assert actor.sync(0).kind == SyncKind.FULL
    rows = []
    for version in range(1, a.steps + 1):
        step()
        prev = clone(receiver.weights)
        report = actor.sync(version)
        assert report.kind == SyncKind.DELTA, report.reason
        assert_same(actor.model, receiver.weights, "receiver after the adamw delta")
        rows.append(measure_step(actor, sender, link, prev, version, a) | {"ms": report.ms})
        _print_row(a.warmup_steps + version, rows[-1], numel)
    timing = time_codec(actor.model, sender.last_changes, prev, stream=sender.stream_id,
                        version=a.steps, a=a)
    return rows, timing, numel


# --- output ---------------------------------------------------------------------------

def _cells(values: Mapping[str, float]) -> str:
    return " ".join(f"{values[c]:>{max(6, len(LABELS[c]))}.3f}" for c in COLUMNS)


def _print_header(numel: int, a) -> None:
    print(f"# {numel / 1e6:.1f}M params, {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; "
          f"AdamW ({a.adamw_impl}) lr {a.lr:g} wd {a.wd:g} on {a.device}; {a.warmup_steps} "
          f"warm-up steps, then {a.steps} deltas; bytes per truly changed element, headers "
          "included; over: extra elements in the adamw change set; 1ulp: share of changes by "
          "+-1 in the bit pattern; H0: zero-order entropy, B/changed")
    print(f"{'step':>4} {'changed':>9} {'%chg':>5} {'over':>6} {'1ulp':>5} {'H0':>5} | "
          + " ".join(f"{LABELS[c]:>{max(6, len(LABELS[c]))}}" for c in COLUMNS), flush=True)


def _print_row(step: int, row: dict, numel: int) -> None:
    n = row["changed"]
    print(f"{step:>4} {n:>9} {100 * n / numel:>5.2f} {row['reported'] - n:>6} "
          f"{row['one_ulp'] / n:>5.3f} {row['h0'] / n:>5.3f} | "
          + _cells({c: row["sizes"][c] / n for c in COLUMNS}), flush=True)


def _print_summary(rows: list[dict], means: Mapping[str, float], timing: dict) -> None:
    changed = sum(r["changed"] for r in rows)
    h0 = statistics.mean(r["h0"] / r["changed"] for r in rows)
    print(f"{'mean':>4} {'':>28} {h0:>5.3f} | {_cells(means)}")
    print(f"{'agg':>4} {'':>34} | "
          + _cells({c: sum(r["sizes"][c] for r in rows) / changed for c in COLUMNS}))
    parts = sum((r["parts"] for r in rows), Counter())
    size, entries = sum(r["sizes"]["adamw"] for r in rows), parts.pop("entries")
    print(f"\nwhere our bytes go (adamw path, all steps, {entries / len(rows):.0f} entries/step):")
    for part, nbytes in parts.most_common():
        print(f"  {part:<22} {nbytes / changed:7.3f} B/changed {100 * nbytes / size:6.1f} %")
    positions = sum(r["h0_positions"] for r in rows) / changed
    values = sum(r["h0"] for r in rows) / changed - positions
    print(f"  zero-order entropy: positions {positions:.3f} B/changed (Bernoulli per tensor) "
          f"+ values {values:.3f} (bit-pattern deltas) = {positions + values:.3f}")
    phases = {k: statistics.mean(r["ms"].get(k, 0.0) for r in rows) for k in rows[0]["ms"]}
    print("product path, Sender phases (mean ms per step): "
          + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
    print("\ntiming on the last step (ms, median and p90):")
    for what, (median, p90) in timing.items():
        print(f"  {what:<19} {median:9.1f} {p90:9.1f}")
    for what in ("encode", "decode+apply"):
        print(f"  {what} / dense: {timing[what][0] / timing[what + ' dense'][0]:.2f}x")


def markdown_row(rows, means, timing, numel, a, runtime: str) -> tuple[str, str]:
    chg = [100 * r["changed"] / numel for r in rows]
    cmd = "uv run python tools/bench_codec.py" + "".join(f" {x}" for x in sys.argv[1:])
    ms = {k: v[0] for k, v in timing.items()}
    ratio = {k: ms[k] / ms[k + " dense"] for k in ("encode", "decode+apply")}
    cells = [datetime.date.today().isoformat(), f"`{git_sha()}`", machine(a.device),
             f"`{cmd}`", (f"{numel / 1e6:.1f}M params, {a.steps} deltas after "
                          f"{a.warmup_steps} warm-up steps, "
                          f"{min(chg):.1f}-{max(chg):.1f} % changed"),
             *(f"{means[c]:.2f}" for c in COLUMNS),
             f"{ms['encode']:.0f} ms ({ratio['encode']:.2f}x)",
             f"{ms['decode+apply']:.0f} ms ({ratio['decode+apply']:.2f}x)", runtime]
    head = ["date", "sha", "machine", "command", "trajectory",
            *(LABELS[c] for c in COLUMNS), "encode (x dense)", "decode+apply (x dense)",
            "runtime"]
    return "| " + " | ".join(head) + " |", "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    start, cpu_start = time.perf_counter(), time.process_time()
    a = _parse(argv)
    logging.basicConfig(level=logging.WARNING)
    rows, timing, numel = trajectory(a)
    means = {c: statistics.mean(r["sizes"][c] / r["changed"] for r in rows) for c in COLUMNS}
    _print_summary(rows, means, timing)
    runtime = f"{time.perf_counter() - start:.0f} s ({time.process_time() - cpu_start:.0f} s CPU)"
    print(f"\nruntime {runtime}; load average {os.getloadavg()[0]:.1f}")
    head, row = markdown_row(rows, means, timing, numel, a, runtime)
    print(f"\nfor docs/benchmarks.md (bytes per changed element):\n{head}\n"
          f"|{'---|' * (head.count(' | ') + 1)}\n{row}")
    print(f"bytes_per_changed={means['adamw']:.3f} baseline={BASELINE_BYTES}")


if __name__ == "__main__":
    main()
