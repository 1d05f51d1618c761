"""Speed of the fused detection kernels against the measured HBM copy bandwidth (GPU).

For each ``--numel``: N(0, 0.02) fp32 masters split into tensors of ``--tensor-numel``,
two real ``torch.optim.AdamW`` steps (fused); the bf16 casts before and after the second
step give the snapshot truth. Timed with CUDA events, median of ``--reps`` after
``--warmup`` (the torch references: ``--reference-reps``):

* copy: a bf16 device-to-device copy of ``numel`` elements, and an fp32 one of the same
  bytes; the faster one is the bandwidth the kernels are measured against;
* inversion: ``invert_adamw`` over every tensor, kernel and torch reference; minimal
  bytes 14 per element (fp32 master and moments, bf16 weight);
* cast: ``CastDetector.record_and_copy`` over every tensor (the model reset to the old
  weights and the detector cleared before each repetition, untimed), kernel and torch
  reference (``record`` + ``copy_``); minimal bytes 6 per element.

Each kernel's bandwidth is its minimal bytes over its time, as a fraction of the copy
bandwidth; ``missed`` counts changed elements (snapshot diff) that the detector did not
report (must be 0; the script exits 1 otherwise); ``== reference`` says whether the
kernel's change sets equal the torch reference's bit for bit. Prints Markdown rows for
``docs/benchmarks.md``; ``--profile`` adds torch.profiler's per-kernel table.

Run (GPU machine, from the repository root):
    PYTHONPATH=packages/dte-detector/src:tools python3 tools/gpu/bench_kernels.py \\
        --numel 1e9 4e9 --sha <sha>
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch
from provenance import git_sha, machine

from dte_detector import CastDetector, ChangeSet, diff, invert_adamw, torch_adamw_states
from dte_detector.dispatch import reference

INVERSION_BYTES = 14
CAST_BYTES = 6
COPY_BYTES = 4
"""A bf16 copy reads and writes 2 bytes per element."""


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, nargs="+", default=[1e9, 4e9])
    parser.add_argument("--tensor-numel", type=float, default=2**29)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--weight-decay", type=float, default=0.003)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--reference-reps", type=int, default=3)
    parser.add_argument("--sha", default=None, help="default: this checkout's")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def median_ms(fn, *, reps: int, warmup: int, reset=None) -> float:
    """Median of ``reps`` timed calls of ``fn`` (``reset`` runs untimed before each)."""
    times = []
    for i in range(warmup + reps):
        if reset is not None:
            reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(numel: int, args) -> float:
    """Bytes per ms of the faster of a bf16 and an fp32 copy of ``numel`` bf16 elements."""
    best = 0.0
    for dtype, count in ((torch.bfloat16, numel), (torch.float32, numel // 2)):
        src = torch.randn(count, device="cuda").to(dtype)
        dst = torch.empty_like(src)
        ms = median_ms(lambda: dst.copy_(src), reps=args.reps, warmup=args.warmup)
        best = max(best, COPY_BYTES * numel / ms)
        del src, dst
    return best


def trajectory(numel: int, args):
    """Optimizer states after the second step, the bf16 weights before it, the truth."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = int(args.tensor_numel)
    params = [torch.nn.Parameter(torch.randn(min(size, numel - s), device="cuda",
                                             generator=gen).mul_(0.02))
              for s in range(0, numel, size)]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                                  fused=True)
    for step in range(2):
        if step:
            old = [p.detach().to(torch.bfloat16) for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        optimizer.step()
    for p in params:
        p.grad = None
    states = torch_adamw_states(optimizer)
    truth = [diff(o, s.param.detach().to(torch.bfloat16)) for o, s in zip(old, states)]
    return states, old, truth


def invert_all(states) -> list[ChangeSet]:
    return [invert_adamw(str(i), s.param, s.exp_avg, s.exp_avg_sq, s.hyper,
                         previous_step=s.hyper.step - 1, dtype=torch.bfloat16)
            for i, s in enumerate(states)]


def missed(truth: list[ChangeSet], found: list[ChangeSet]) -> int:
    return sum(int((~torch.isin(t.indices, f.indices)).sum()) for t, f in zip(truth, found))


def same(a: list[ChangeSet], b: list[ChangeSet]) -> bool:
    def bits(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.int16)
    return all(torch.equal(x.indices, y.indices) and torch.equal(bits(x.base_low), bits(y.base_low))
               and torch.equal(bits(x.base_high), bits(y.base_high)) for x, y in zip(a, b))


class CastRun:
    """``record_and_copy`` over every tensor, from the old weights each time."""

    def __init__(self, states, old) -> None:
        self.states, self.old = states, old
        self.models = [o.clone() for o in old]
        self.detector = CastDetector()

    def reset(self) -> None:
        for model, o in zip(self.models, self.old):
            model.copy_(o)
        self.detector.clear()

    def __call__(self) -> None:
        for i, (s, model) in enumerate(zip(self.states, self.models)):
            self.detector.record_and_copy(str(i), s.param.detach(), model)

    def changes(self) -> list[ChangeSet]:
        return [self.detector.changes(str(i), m) for i, m in enumerate(self.models)]


def measure(numel: int, args) -> dict:
    bandwidth = copy_bandwidth(numel, args)
    states, old, truth = trajectory(numel, args)
    row = {"numel": numel, "copy_tb_s": bandwidth / 1e9,
           "changed_pct": 100 * sum(len(t) for t in truth) / numel}
    kernel = invert_all(states)
    with reference():
        ref = invert_all(states)
        row["inversion_ref_ms"] = median_ms(lambda: invert_all(states), reps=args.reference_reps,
                                            warmup=1)
    row["inversion_ms"] = median_ms(lambda: invert_all(states), reps=args.reps,
                                    warmup=args.warmup)
    row.update(inversion_missed=missed(truth, kernel), inversion_same=same(kernel, ref),
               inversion_reported=sum(len(k) for k in kernel))
    del ref
    cast = CastRun(states, old)
    row["cast_ms"] = median_ms(cast, reps=args.reps, warmup=args.warmup, reset=cast.reset)
    kernel, kernel_models = cast.changes(), [m.clone() for m in cast.models]
    with reference():
        row["cast_ref_ms"] = median_ms(cast, reps=args.reference_reps, warmup=1,
                                       reset=cast.reset)
        ref = cast.changes()
    row.update(cast_missed=missed(truth, kernel), cast_extra=sum(len(k) for k in kernel)
               - sum(len(t) for t in truth), cast_same=same(kernel, ref)
               and all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                       for a, b in zip(kernel_models, cast.models)))
    if args.profile:
        row["profile"] = profile(states, cast)
    return row


def profile(states, cast: CastRun) -> str:
    cast.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        invert_all(states)
        cast()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)


def markdown(row: dict, meta: dict) -> list[str]:
    lines = []
    for what, minimal in (("inversion", INVERSION_BYTES), ("cast", CAST_BYTES)):
        ms = row[f"{what}_ms"]
        tb_s = minimal * row["numel"] / ms / 1e9
        extra = f" (+{row['cast_extra']} extra)" if what == "cast" else ""
        lines.append(
            f"| {meta['date']} | `{meta['sha']}` | {meta['machine']} | `{meta['command']}` "
            f"| {what} | {row['numel']:.2g} | {row['changed_pct']:.2f} | {row['copy_tb_s']:.2f} "
            f"| {ms:.2f} | {tb_s:.2f} | {tb_s / row['copy_tb_s']:.0%} "
            f"| {row[f'{what}_ref_ms']:.1f} | {row[f'{what}_ref_ms'] / ms:.1f}x "
            f"| {row[f'{what}_missed']}{extra} | {'yes' if row[f'{what}_same'] else 'NO'} |")
    return lines


def main() -> int:
    args = parse()
    meta = {"date": datetime.date.today().isoformat(), "sha": args.sha or git_sha(),
            "machine": machine("cuda"),
            "command": "python3 tools/gpu/bench_kernels.py " + " ".join(sys.argv[1:])}
    rows = []
    for numel in args.numel:
        rows.append(measure(int(numel), args))
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
        if args.profile:
            print(rows[-1]["profile"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("| date | sha | machine | command | kernel | numel | changed % | copy TB/s | ms "
          "| TB/s over minimal bytes | of copy | torch ms | speed-up | missed | == reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("\n".join(markdown(row, meta)))
    bad = any(r["inversion_missed"] or r["cast_missed"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
