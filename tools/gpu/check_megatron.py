"""megatron-core's own optimizer on a GPU: both detectors of ``areal_dte.megatron`` checked
against the bitwise snapshot truth after every sync, and a copy of the model kept by deltas.

A Qwen3-shaped ``GPTModel`` (GQA, SwiGLU, qk-norm, RMSNorm, RoPE; megatron-core's local
layer spec, no TransformerEngine or apex) in bf16 (``Float16Module``), wrapped in
megatron-core's ``DistributedDataParallel`` with the distributed optimizer and built with
``get_megatron_optimizer`` (torch AdamW inside, fp32 main shards), trained on random token
batches (real forward and backward). ``attach`` hooks both detectors into that optimizer.
Runs, each a list of syncs:

* ``steady``: one optimizer step per sync at a constant lr;
* ``multi``: four steps per sync (``cast`` stays exact; ``adamw`` must say ``step_gap``);
* ``schedule``: one step per sync, the lr and weight decay of every group changed before
  each step (warm-up then decay), so each step inverts with its own hyper-parameters.

Per sync and detector: missed elements against ``diff`` of the bf16 params before and
after (must be 0: the script exits 1 otherwise), over-reported ones, and a model copy
that only ever receives the detector's deltas (``dte_codec`` encode, decode, apply) must
equal the trainer's bf16 params bit for bit. Times: ``collect`` per detector, and the cast
hook (compare, then Megatron's copy) against a plain copy of the same bytes.

``--dp N`` runs N data-parallel ranks on N GPUs: each rank detects inside its own range
of every param and ``collect`` merges the ranks' change sets (``dp_union``); every rank
checks the merged sets against its own whole params.

Run on one GPU (megatron-core's wheel carried in ``.whl``), repository root:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megatron_core-*.whl
    PYTHONPATH=/tmp/site:packages/dte-detector/src:packages/dte-codec/src:\
packages/dte-transport/src:packages/dte-config/src:packages/areal-dte/src \
    python3 tools/gpu/check_megatron.py --out $OUT/megatron.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from areal_dte import Method
from areal_dte.megatron import attach
from dte_codec import apply_, decode, encode_delta
from dte_detector import diff
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

METHODS = (Method.CAST, Method.ADAMW)
SEEDS = {"steady": 11, "multi": 12, "schedule": 13}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=6144)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--syncs", type=int, default=20, help="syncs of the steady run")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel ranks, one GPU each (the distributed optimizer shards "
                        "the masters over them)")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction,
                   default=True, help="megatron-core's DistributedOptimizer (default) or "
                                      "its non-distributed mixed-precision optimizer")
    p.add_argument("--out", default=None)
    return p.parse_args()


def build(args):
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, num_query_groups=args.groups, kv_channels=128,
        qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                     vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    model = Float16Module(config, model.cuda())
    distributed = args.distributed_optimizer
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, weight_decay=0.003, adam_beta2=0.95, bf16=True,
        use_distributed_optimizer=distributed, clip_grad=1.0), [ddp])
    return ddp, optimizer


def bf16_params(ddp) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in ddp.named_parameters():
        while name.startswith("module."):
            name = name[len("module."):]
        out[name] = param.detach()
    return out


def train_step(ddp, optimizer, args, gen) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda",
                           generator=gen)
    positions = torch.arange(args.seq, device="cuda").expand(args.batch, -1)
    loss = ddp(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - start) * 1e3


class Copy:
    """A model copy that only ever receives ``method``'s deltas through the codec."""

    def __init__(self, params, method):
        self.method = method
        self.weights = {n: t.clone() for n, t in params.items()}
        self.version = 1

    def reseed(self, params):
        for name, tensor in params.items():
            self.weights[name].copy_(tensor)

    def apply(self, params, changes) -> bool:
        payload = encode_delta(params, changes, stream_id="check", base_version=self.version,
                               version=self.version + 1)
        apply_(self.weights, decode(payload, device="cuda"))
        self.version += 1
        return all(torch.equal(self.weights[n].view(torch.int16), t.view(torch.int16))
                   for n, t in params.items())


def run(name, ddp, optimizer, detectors, args, *, syncs, steps_per_sync, schedule=False):
    params = bf16_params(ddp)
    copies = {m: Copy(params, m) for m in METHODS}
    for changes in detectors.values():
        changes.commit()
    gen = torch.Generator(device="cuda").manual_seed(SEEDS[name] + 1000 * dist.get_rank())
    rows, step = [], 0
    for sync in range(syncs):
        before = {n: t.clone() for n, t in params.items()}
        for _ in range(steps_per_sync):
            if schedule:
                scale = min(1.0, (step + 1) / 5) * (0.5 ** (step // 5))
                for group in optimizer.param_groups:
                    group["lr"] = args.lr * 10 * scale
            train_step(ddp, optimizer, args, gen)
            step += 1
        truth = {n: diff(before[n], t) for n, t in params.items()}
        changed = sum(len(c) for c in truth.values())
        row = {"run": name, "sync": sync, "steps": steps_per_sync, "changed": changed,
               "numel": sum(t.numel() for t in params.values())}
        for method, changes in detectors.items():
            reason = changes.full_reason
            if reason is not None:
                row[method.value] = {"full": reason}
                copies[method].reseed(params)
                continue
            found, ms = timed(changes.collect)
            missed = extra = 0
            for n, exact in truth.items():
                got = found[n].indices.to(torch.int64)
                want = exact.indices.to(torch.int64)
                missed += int((~torch.isin(want, got)).sum())
                extra += int((~torch.isin(got, want)).sum())
            row[method.value] = {"missed": missed, "extra": extra, "collect_ms": ms,
                                 "bitwise": copies[method].apply(params, found)}
        for changes in detectors.values():
            changes.commit()
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    return rows


def copy_times_ms(ddp, optimizer, detectors) -> tuple[float, float]:
    """The cast hook (compare, then Megatron's own copy of every main shard) and, on the
    same bytes, a plain fp32 -> bf16 copy: what a fused compare-and-copy has to reach."""
    inners = getattr(optimizer, "chained_optimizers", None) or [optimizer]

    def hook():
        for inner in inners:
            inner._copy_main_params_to_model_params()
    hook()
    hooked = min(timed(hook)[1] for _ in range(3))
    for changes in detectors.values():
        changes.commit()
    params = list(bf16_params(ddp).values())
    masters = [p.float() for p in params]

    def copy():
        for p, m in zip(params, masters):
            p.copy_(m)
    copy()
    return hooked, min(timed(copy)[1] for _ in range(3))


def worker(rank: int, args: argparse.Namespace) -> None:
    """One data-parallel rank; rank 0 reports. Exits 1 on every rank if any rank missed
    an element or lost bitwise equality."""
    dist.init_process_group("nccl", rank=rank, world_size=args.dp,
                            device_id=torch.device("cuda", rank))
    torch.cuda.set_device(rank)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    ddp, optimizer = build(args)
    numel = sum(p.numel() for p in ddp.parameters())
    detectors = {m: attach(optimizer, ddp, method=m) for m in METHODS}
    gen = torch.Generator(device="cuda").manual_seed(rank)  # each rank its own batches
    for _ in range(2):  # warm-up steps: optimizer state exists before the first sync
        train_step(ddp, optimizer, args, gen)
    _, step_ms = timed(lambda: train_step(ddp, optimizer, args, gen))
    rows = run("steady", ddp, optimizer, detectors, args, syncs=args.syncs, steps_per_sync=1)
    rows += run("multi", ddp, optimizer, detectors, args, syncs=4, steps_per_sync=4)
    rows += run("schedule", ddp, optimizer, detectors, args, syncs=10, steps_per_sync=1,
                schedule=True)
    hooked, bound = copy_times_ms(ddp, optimizer, detectors)
    results = {"params": numel, "dp": args.dp, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__,
               "date": datetime.date.today().isoformat(), "train_step_ms": step_ms,
               "cast_hook_ms": hooked, "copy_alone_ms": bound, "rows": rows,
               "args": vars(args)}
    # Minimal bytes per element: inversion 14 (fp32 master, exp_avg, exp_avg_sq; bf16
    # weight), compare-and-copy 6 (fp32 master in, bf16 out), at the copy's bandwidth.
    bandwidth = 6 * numel / bound
    results["bounds_ms"] = {"adamw": 14 * numel / bandwidth, "cast": 6 * numel / bandwidth}
    missed = sum(r[m.value].get("missed", 0) for r in rows for m in METHODS)
    unequal = sum(not r[m.value].get("bitwise", True) for r in rows for m in METHODS)
    failed = torch.tensor([missed + unequal], device="cuda")
    dist.all_reduce(failed)
    if rank == 0:
        report(results, optimizer, step_ms, hooked, bound, args)
    dist.destroy_process_group()
    if int(failed.item()):
        sys.exit(1)


def report(results, optimizer, step_ms, hooked, bound, args) -> None:
    rows, numel, bandwidth = results["rows"], results["params"], 6 * results["params"] / bound
    inners = [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    print(f"dp {args.dp}; copy bandwidth {bandwidth / 1e9:.2f} TB/s; bounds: inversion "
          f"{results['bounds_ms']['adamw']:.2f} ms, compare-and-copy "
          f"{results['bounds_ms']['cast']:.2f} ms; optimizer "
          f"{type(optimizer).__name__} of {inners}", flush=True)
    for method in METHODS:
        deltas = [r[method.value] for r in rows if "missed" in r[method.value]]
        fulls = sorted({r[method.value]["full"] for r in rows if "full" in r[method.value]})
        ms = sorted(d["collect_ms"] for d in deltas)
        print(f"| {method.value} | {numel / 1e9:.2f}e9 | {len(deltas)} deltas, fulls: "
              f"{fulls or 'none'} | missed {sum(d['missed'] for d in deltas)} | over-reported "
              f"{sum(d['extra'] for d in deltas)} | bitwise "
              f"{all(d['bitwise'] for d in deltas)} | collect median {ms[len(ms) // 2]:.1f} ms |"
              f" train step {step_ms:.0f} ms | cast hook {hooked:.1f} ms, copy alone "
              f"{bound:.1f} ms |", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


def main() -> int:
    args = parse()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        mp.spawn(worker, args=(args,), nprocs=args.dp, join=True)
    except mp.ProcessExitedException:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
