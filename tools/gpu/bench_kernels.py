"""Speed of the fused detection kernels against the measured HBM copy bandwidth (GPU).

Each run is a set of fp32 masters: for each ``--numel``, N(0, 0.02) masters split into
tensors of ``--tensor-numel``; with ``--model qwen3-4b``, also the 398 weights of
``tools/bench_sync.py``'s Qwen3-4B shape (4.02e9 parameters, norms at 1, the rest
N(0, 0.02)). Two real ``torch.optim.AdamW`` steps (fused) follow; the bf16 casts before
and after the second step give the snapshot truth. Timed with CUDA events, median of
``--reps`` after ``--warmup`` (the torch references: ``--reference-reps``), host
synchronisations included:

* copy: a bf16 device-to-device copy of ``numel`` elements, and an fp32 one of the same
  bytes; the faster one is the bandwidth the kernels are measured against;
* inversion: ``invert_adamw`` tensor by tensor (``per tensor``: one host
  synchronisation each) and all of them at once as a sync runs them (``batched``: the
  ``inverter.Inverter`` of ``AdamWSteps.changes_all``, its layout and plan kept across
  calls), and the torch reference; minimal bytes 14 per element (fp32 master and
  moments, bf16 weight);
* cast: ``CastDetector.record_and_copy`` tensor by tensor and ``record_and_copy_all``
  (the model reset to the old weights and the detector cleared before each repetition,
  untimed, as a sync clears it), and the torch reference (``record`` + ``copy_``);
  minimal bytes 6 per element.

``--modes`` picks the modes (default both). The batched calls are also profiled (each of
``--reps`` calls alone, after its untimed reset): ``kernel ms`` is the median of their
summed device time (kernels, copies, fills), the part target 1 of issue 11 measures, as
the wall above includes the host's work and synchronisations.

Also timed, on as many parameters as each run has tensors (the sizes do not matter, only
the count): ``AdamWSteps.commit`` after a fused AdamW step (reads every step count from the
device) and ``commit_recorded`` (reads none), median of ``--reps``.

Each kernel's bandwidth is its minimal bytes over its time, as a fraction of the copy
bandwidth; ``missed`` counts changed elements (snapshot diff) that the detector did not
report (must be 0; the script exits 1 otherwise, and also when a mode's change sets or
model bits differ from the torch reference's); ``== reference`` says whether they are
equal bit for bit. Prints Markdown rows for ``docs/benchmarks.md``; ``--profile`` adds
torch.profiler's per-kernel table of the batched calls.

Run (GPU machine, from the repository root):
    PYTHONPATH=packages/dte-detector/src:packages/dte-codec/src:tools \\
        python3 tools/gpu/bench_kernels.py --numel 1e9 4e9 --model qwen3-4b --sha <sha>
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
from dte_detector import cast_kernel, inversion_kernel
from dte_detector.dispatch import reference
from dte_detector.inversion import per_tensor
from dte_detector.inverter import Inverter
from dte_detector.steps import AdamWSteps

INVERSION_BYTES = 14
CAST_BYTES = 6
COPY_BYTES = 4
"""A bf16 copy reads and writes 2 bytes per element."""
QWEN3_4B = dict(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                intermediate=9728)
"""``tools/bench_sync.py``'s model shape."""
MODES = ("per tensor", "batched")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, nargs="*", default=[1e9, 4e9])
    parser.add_argument("--tensor-numel", type=float, default=2**29)
    parser.add_argument("--model", choices=["qwen3-4b"], default=None,
                        help="also run over this model's tensor shapes")
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--weight-decay", type=float, default=0.003)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--reference-reps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sha", default=None, help="default: this checkout's")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--inversion-registers", type=int, default=None,
                        help="registers per thread for _mark (maxnreg; 0: no cap)")
    parser.add_argument("--cast-registers", type=int, default=None,
                        help="registers per thread for _record (maxnreg; 0: no cap)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def case_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a script timing the kernels over one ``split`` trajectory of
    ``--numel`` elements (``tune_kernels.py``, ``cast_floor.py``); the caller adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--numel", type=float, default=1e9)
    parser.add_argument("--tensor-numel", type=float, default=2**28)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--weight-decay", type=float, default=0.003)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sha", default=None, help="default: this checkout's")
    return parser


def row_prefix(args: argparse.Namespace, script: str) -> str:
    """A markdown row's first cells: date, tree, machine and the command that ran."""
    return (f"| {datetime.date.today().isoformat()} | `{args.sha or git_sha()}` "
            f"| {machine('cuda')} | `python3 {script} {' '.join(sys.argv[1:])}` ")


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


def device_ms(fn, *, reps: int, reset=None) -> float:
    """Median over ``reps`` calls of ``fn`` of the device time it queued (summed over every
    kernel, copy and fill), each call profiled alone after an untimed ``reset``."""
    times = []
    for _ in range(reps):
        if reset is not None:
            reset()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        times.append(sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()
                         if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3)
    return statistics.median(times)


def copy_bandwidth(numel: int, args) -> float:
    """Bytes per ms of the faster of a bf16 and an fp32 copy of ``numel`` bf16 elements."""
    return max(_copy_rate(numel, dtype, count, args)
               for dtype, count in ((torch.bfloat16, numel), (torch.float32, numel // 2)))


def _copy_rate(numel: int, dtype: torch.dtype, count: int, args) -> float:
    """Bytes per ms of ``count`` elements of ``dtype`` (``numel`` bf16 elements' bytes)
    copied device to device (the buffers are freed on return)."""
    src = torch.randn(count, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    return COPY_BYTES * numel / median_ms(lambda: dst.copy_(src), reps=args.reps,
                                          warmup=args.warmup)


def split(numel: int, args) -> list[tuple[int, bool]]:
    """``numel`` elements in tensors of ``--tensor-numel``: (size, is a norm) each."""
    size = int(args.tensor_numel)
    return [(min(size, numel - s), False) for s in range(0, numel, size)]


def model_tensors(name: str) -> list[tuple[int, bool]]:
    """The weights of ``name`` (bench_sync's shape): (size, is a norm) each."""
    from dte_codec.layouts import ModelConfig, canonical_tensors

    specs = canonical_tensors(ModelConfig(**QWEN3_4B, tie_word_embeddings=True))
    return [(torch.Size(spec.shape).numel(), len(spec.shape) == 1) for spec in specs.values()]


def trajectory(tensors: list[tuple[int, bool]], args):
    """Optimizer states after the second step, the bf16 weights before it, the truth."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.ones(n, device="cuda") if norm else
                                 torch.randn(n, device="cuda", generator=gen).mul_(0.02))
              for n, norm in tensors]
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


def invert_each(states) -> list[ChangeSet]:
    return [invert_adamw(str(i), s.param, s.exp_avg, s.exp_avg_sq, s.hyper,
                         previous_step=s.hyper.step - 1, dtype=torch.bfloat16)
            for i, s in enumerate(states)]


class InvertBatched:
    """The inversion of every tensor as a sync runs it: the ``inverter.Inverter`` that
    ``AdamWSteps.changes_all`` calls, kept across calls (its layout and plan, replanned
    when the kernels' tile size changes, as ``tune_kernels.py`` does per candidate)."""

    def __init__(self, states) -> None:
        self.inverter = Inverter()
        self.columns = ([str(i) for i in range(len(states))],
                        [(s.param, s.exp_avg, s.exp_avg_sq) for s in states],
                        [s.hyper for s in states], [s.hyper.step - 1 for s in states],
                        [torch.bfloat16] * len(states))

    def __call__(self) -> list[ChangeSet]:
        return per_tensor(*self.inverter.runs(*self.columns))


def missed(truth: list[ChangeSet], found: list[ChangeSet]) -> int:
    return sum(int((~torch.isin(t.indices, f.indices)).sum()) for t, f in zip(truth, found))


def same(a: list[ChangeSet], b: list[ChangeSet]) -> bool:
    def bits(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.int16)
    return all(torch.equal(x.indices, y.indices) and torch.equal(bits(x.base_low), bits(y.base_low))
               and torch.equal(bits(x.base_high), bits(y.base_high)) for x, y in zip(a, b))


class CastRun:
    """``record_and_copy`` over every tensor (or ``record_and_copy_all``), from the old
    weights each time."""

    def __init__(self, states, old, *, batched: bool) -> None:
        self.states, self.old, self.batched = states, old, batched
        self.models = [o.clone() for o in old]
        self.detector = CastDetector()

    def reset(self) -> None:
        for model, o in zip(self.models, self.old):
            model.copy_(o)
        self.detector.clear()

    def __call__(self) -> None:
        pairs = {str(i): (s.param.detach(), model)
                 for i, (s, model) in enumerate(zip(self.states, self.models))}
        if self.batched:
            self.detector.record_and_copy_all(pairs)
        else:
            for name, (master, model) in pairs.items():
                self.detector.record_and_copy(name, master, model)

    def changes(self) -> list[ChangeSet]:
        return [self.detector.changes(str(i), m) for i, m in enumerate(self.models)]

    def model_bits(self) -> list[torch.Tensor]:
        return [m.view(torch.int16).clone() for m in self.models]


def measure(label: str, tensors: list[tuple[int, bool]], args) -> dict:
    numel = sum(n for n, _ in tensors)
    bandwidth = copy_bandwidth(numel, args)
    states, old, truth = trajectory(tensors, args)
    row = {"label": label, "numel": numel, "tensors": len(tensors),
           "copy_tb_s": bandwidth / 1e9, "changed_pct": 100 * sum(len(t) for t in truth) / numel}
    with reference():
        ref = invert_each(states)
        row["inversion_ref_ms"] = median_ms(lambda: invert_each(states),
                                            reps=args.reference_reps, warmup=1)
    batched = InvertBatched(states)
    for mode, run in zip(MODES, (lambda: invert_each(states), batched)):
        if mode not in args.modes:
            continue
        found = run()
        row[f"inversion {mode}"] = {
            "ms": median_ms(run, reps=args.reps, warmup=args.warmup),
            "missed": missed(truth, found), "same": same(found, ref),
            "reported": sum(len(f) for f in found)}
        if mode == "batched":
            row[f"inversion {mode}"]["kernel_ms"] = device_ms(run, reps=args.reps)
        del found
    del ref
    reference_run = CastRun(states, old, batched=False)
    with reference():
        row["cast_ref_ms"] = median_ms(reference_run, reps=args.reference_reps, warmup=1,
                                       reset=reference_run.reset)
    ref, ref_bits = reference_run.changes(), reference_run.model_bits()
    del reference_run
    for mode in args.modes:
        cast = CastRun(states, old, batched=mode == "batched")
        ms = median_ms(cast, reps=args.reps, warmup=args.warmup, reset=cast.reset)
        found = cast.changes()
        row[f"cast {mode}"] = {
            "ms": ms, "missed": missed(truth, found),
            "extra": sum(len(k) for k in found) - sum(len(t) for t in truth),
            "same": same(found, ref) and all(torch.equal(a, b) for a, b in
                                             zip(cast.model_bits(), ref_bits))}
        if mode == "batched":
            row[f"cast {mode}"]["kernel_ms"] = device_ms(cast, reps=args.reps, reset=cast.reset)
        if args.profile and mode == "batched":
            row["profile"] = profile(batched, cast)
        del cast, found
    return row


def commit_ms(count: int, args) -> dict:
    """``AdamWSteps.commit`` and ``commit_recorded`` over ``count`` parameters, each after
    an untimed fused AdamW step and ``record``."""
    params = [torch.nn.Parameter(torch.zeros(8, device="cuda")) for _ in range(count)]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                                  fused=True)
    names = {id(p): (str(i),) for i, p in enumerate(params)}
    steps = AdamWSteps(lambda p: names[id(p)])

    def step() -> None:
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        steps.record(optimizer)
    timed = {"commit": lambda: steps.commit([optimizer])}
    if hasattr(steps, "commit_recorded"):  # absent before it existed (a before/after run)
        timed["commit_recorded"] = steps.commit_recorded
    return {name: median_ms(fn, reps=args.reps, warmup=args.warmup, reset=step)
            for name, fn in timed.items()}


def profile(batched: InvertBatched, cast: CastRun) -> str:
    cast.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        batched()
        cast()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)


def markdown(row: dict, meta: dict) -> list[str]:
    lines = []
    for what, minimal in (("inversion", INVERSION_BYTES), ("cast", CAST_BYTES)):
        for mode in [m for m in MODES if f"{what} {m}" in row]:
            result = row[f"{what} {mode}"]
            ms = result["ms"]
            tb_s = minimal * row["numel"] / ms / 1e9
            extra = f" (+{result['extra']} extra)" if what == "cast" else ""
            kernel = "| - | - | - "
            if "kernel_ms" in result:
                kernel_tb_s = minimal * row["numel"] / result["kernel_ms"] / 1e9
                kernel = (f"| {result['kernel_ms']:.2f} | {kernel_tb_s:.2f} "
                          f"| {kernel_tb_s / row['copy_tb_s']:.0%} ")
            lines.append(
                f"| {meta['date']} | `{meta['sha']}` | {meta['machine']} | `{meta['command']}` "
                f"| {row['label']} | {row['tensors']} | {what} | {mode} | {row['numel']:.3g} "
                f"| {row['changed_pct']:.2f} | {row['copy_tb_s']:.2f} | {ms:.2f} | {tb_s:.2f} "
                f"| {tb_s / row['copy_tb_s']:.0%} {kernel}| {row[f'{what}_ref_ms']:.1f} "
                f"| {row[f'{what}_ref_ms'] / ms:.1f}x | {result['missed']}{extra} "
                f"| {'yes' if result['same'] else 'NO'} |")
    return lines


def main() -> int:
    args = parse()
    if args.inversion_registers is not None:
        inversion_kernel.REGISTERS = args.inversion_registers or None
    if args.cast_registers is not None:
        cast_kernel.REGISTERS = args.cast_registers or None
    meta = {"date": datetime.date.today().isoformat(), "sha": args.sha or git_sha(),
            "machine": machine("cuda"),
            "command": "python3 tools/gpu/bench_kernels.py " + " ".join(sys.argv[1:])}
    runs = [(f"{numel:.0e} in {args.tensor_numel:.3g}", split(int(numel), args))
            for numel in args.numel]
    if args.model:
        runs.append((args.model, model_tensors(args.model)))
    rows = []
    for label, tensors in runs:
        rows.append(measure(label, tensors, args))
        torch.cuda.empty_cache()
        rows[-1]["commit_ms"] = commit_ms(len(tensors), args)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
        if args.profile:
            print(rows[-1]["profile"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("| date | sha | machine | command | tensors | count | kernel | mode | numel "
          "| changed % | copy TB/s | ms | TB/s over minimal bytes | of copy | kernel ms "
          "| kernel TB/s | of copy | torch ms | speed-up | missed | == reference |")
    print("|---" * 21 + "|")
    for row in rows:
        print("\n".join(markdown(row, meta)))
    bad = any(row[f"{what} {mode}"]["missed"] or not row[f"{what} {mode}"]["same"]
              for row in rows for what in ("inversion", "cast") for mode in args.modes)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
