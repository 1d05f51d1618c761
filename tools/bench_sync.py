"""End-to-end weight sync of a Qwen3-4B-shaped model on one GPU: deltas against dense.

The trainer is a real training loop: a ``transformers`` Qwen3 model (random weights, bf16)
does forward and backward on random token batches, its gradients step fp32 masters with
fused ``torch.optim.AdamW`` (lr 3e-6, wd 0.003) inside ``areal_dte.TorchActor``
(``--method``), whose bf16 copy goes back into the model for the next step. The rollout
holds the weights in SGLang's layout (fused ``qkv_proj`` and ``gate_up_proj``), so every
index is remapped (``areal_dte.shard_stage.ShardStage``). Trainer and rollout share the
GPU; the link is ``dte_transport.Loopback``, so ``send`` is the rollout's decode, remap
and apply. The trainer is in the Hugging Face layout: the Megatron layout's trainer side
is measured by ``tools/gpu/check_megatron.py`` (detectors) and, over NCCL between two
GPUs, by ``tools/gpu/bench_p2p.py``.

Per sync after ``--warmup-steps``: changed fraction; bytes (ours, int32 index + bf16
value, dense); time per phase and end to end, with every rollout tensor compared bit for
bit with the layout's conversion of the trainer's bf16 weights. In the same run: a
device-to-device copy of every bf16 weight (the one-GPU dense wire), our own full sync,
the HBM copy bandwidth, and wire times computed from measured link bandwidths (NVLink
between two H200s, 370 GB/s, DESIGN.md section 6; a 25 GB/s network link) for dense and
for our payload, labelled as computed. The floor adds the detector's minimal bytes (14 B
per element for ``adamw``, 6 B for ``cast``) at the copy bandwidth, the payload at the
link and the apply (8 B per changed element).

    python3 tools/bench_sync.py --out $OUT        # on the GPU machine, src folders on PYTHONPATH
    uv run python tools/bench_sync.py --smoke     # a tiny model on the CPU: the script itself
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from areal_dte import Method, TorchActor
from areal_dte.shard_stage import ShardStage
from dte_codec.geometry import materialize
from dte_codec.layouts import ModelConfig, hf_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_transport import Loopback, Receiver, Sender
from provenance import git_sha, machine

QWEN3_4B = dict(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                intermediate=9728)
SMOKE = dict(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=64)
NVLINK_GBPS = 370.0
"""GPU0 -> GPU1 NCCL send measured on two H200s (DESIGN.md, section 6)."""
NETWORK_GBPS = 25.0
DETECTOR_BYTES = {Method.ADAMW: 14, Method.CAST: 6, Method.SNAPSHOT: 4}
APPLY_BYTES = 8


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="adamw", choices=[m.value for m in Method])
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--layers", type=int, default=QWEN3_4B["layers"])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--out", type=Path, default=None, help="folder for sync.json and sync.png")
    return p.parse_args()


class Bench:
    """Trainer, rollout and clocks of one run."""

    def __init__(self, args: argparse.Namespace):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        self.args = args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        shape = dict(SMOKE if args.smoke else QWEN3_4B, layers=2 if args.smoke else args.layers)
        self.config = ModelConfig(**shape, tie_word_embeddings=True)
        torch.manual_seed(0)
        hf = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                         intermediate_size=shape["intermediate"], tie_word_embeddings=True,
                         torch_dtype=torch.bfloat16)
        with torch.device(self.device):
            self.model = Qwen3ForCausalLM(hf).to(torch.bfloat16)
        self.params = dict(self.model.named_parameters())
        masters = {n: torch.nn.Parameter(p.detach().float()) for n, p in self.params.items()}
        optimizer = torch.optim.AdamW(masters.values(), lr=args.lr, weight_decay=0.003,
                                      fused=not args.smoke)
        shard = sglang_shard(self.config, SGLangLayout(tp=1), rank=0)
        self.shard = shard
        rollout = {n: torch.zeros(s.shape, dtype=s.dtype, device=self.device)
                   for n, s in shard.tensors.items()}
        stage = ShardStage.of(hf_shard(self.config), shard, rollout)
        self.receiver = Receiver(rollout, device=self.device, stage=stage)
        self.actor = TorchActor(masters, optimizer, Sender(Loopback(self.receiver),
                                                           anchor_interval=0),
                                method=Method(args.method))
        self.numel = sum(p.numel() for p in masters.values())
        self.gen = torch.Generator(device=self.device).manual_seed(1)

    def sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn):
        self.sync_device()
        start = time.perf_counter()
        out = fn()
        self.sync_device()
        return out, (time.perf_counter() - start) * 1e3

    def train_step(self) -> None:
        ids = torch.randint(0, self.config.vocab, (self.args.batch, self.args.seq),
                            device=self.device, generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        for name, param in self.params.items():
            self.actor.masters[name].grad = param.grad.float()
            param.grad = None
        self.actor.step()
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.actor.model[name])
        for master in self.actor.masters.values():
            master.grad = None

    def bitwise(self) -> bool:
        expected = materialize(self.shard, self.actor.model)
        return all(torch.equal(expected[n].view(torch.int16), t.view(torch.int16))
                   for n, t in self.receiver.weights.items())

    def copy_all_ms(self) -> float:
        """Every bf16 weight copied device to device: the one-GPU dense wire."""
        sources = list(self.actor.model.values())
        targets = [torch.empty_like(t) for t in sources]

        def copy():
            for target, source in zip(targets, sources):
                target.copy_(source)
        copy()
        return min(self.timed(copy)[1] for _ in range(3))


def run(args: argparse.Namespace) -> dict:
    bench = Bench(args)
    for _ in range(args.warmup_steps):
        bench.train_step()
    copy_ms = bench.copy_all_ms()
    dense_bytes = 2 * bench.numel
    report, full_ms = bench.timed(lambda: bench.actor.sync(1))
    steps = []
    for version in range(2, args.steps + 2):
        bench.train_step()
        report, total_ms = bench.timed(lambda: bench.actor.sync(version))
        steps.append({"kind": report.kind.value, "changed": report.changed,
                      "payload_bytes": report.payload_bytes, "ms": dict(report.ms),
                      "total_ms": total_ms, "bitwise": bench.bitwise()})
    bandwidth = 2 * dense_bytes / copy_ms / 1e6  # read + write, GB/s
    deltas = [s for s in steps if s["kind"] == "delta"]
    median = statistics.median(s["total_ms"] for s in deltas) if deltas else float("nan")
    payload = statistics.median(s["payload_bytes"] for s in deltas) if deltas else 0
    changed = statistics.median(s["changed"] for s in deltas) if deltas else 0
    floor = (DETECTOR_BYTES[Method(args.method)] * bench.numel / bandwidth / 1e6
             + payload / NVLINK_GBPS / 1e6 + APPLY_BYTES * changed / bandwidth / 1e6)
    return {
        "date": datetime.date.today().isoformat(), "sha": git_sha(),
        "machine": machine(str(bench.device)), "args": {k: str(v) for k, v in vars(args).items()},
        "params": bench.numel, "dense_bytes": dense_bytes, "copy_bandwidth_gbps": bandwidth,
        "dense_copy_ms": copy_ms, "full_sync_ms": full_ms, "first_kind": report.kind.value,
        "steps": steps, "delta_median_ms": median, "payload_median_bytes": payload,
        "changed_median": changed, "floor_ms": floor,
        "computed": {"dense_nvlink_ms": dense_bytes / NVLINK_GBPS / 1e6,
                     "delta_nvlink_wire_ms": payload / NVLINK_GBPS / 1e6,
                     "dense_network_ms": dense_bytes / NETWORK_GBPS / 1e6,
                     "delta_network_wire_ms": payload / NETWORK_GBPS / 1e6},
    }


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
    lines = ((results["dense_copy_ms"], "dense copy on one GPU (measured)", "black"),
             (results["computed"]["dense_nvlink_ms"], "dense over NVLink (computed)", "red"),
             (results["floor_ms"], "floor (computed)", "grey"))
    for value, label, color in lines:
        ax.axhline(value, linestyle="--", color=color, label=f"{label}: {value:.2f} ms")
    ax.set_xticks(range(len(deltas)))
    ax.set_yscale("log")
    ax.set_xlabel("sync after warm-up")
    ax.set_ylabel("ms")
    ax.set_title(f"{results['params'] / 1e9:.2f}e9 params, {results['args']['method']}, "
                 f"{results['machine'].split(';')[0]}, {results['date']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse()
    results = run(args)
    c = results["computed"]
    print(f"| {results['date']} | `{results['sha']}` | {results['machine']} | "
          f"`python3 tools/bench_sync.py --method {args.method} --steps {args.steps}` | "
          f"{results['params'] / 1e9:.2f}e9 | {100 * results['changed_median'] / results['params']:.2f} % | "
          f"{results['payload_median_bytes'] / max(results['changed_median'], 1):.2f} B/chg | "
          f"{results['delta_median_ms']:.1f} ms | {results['dense_copy_ms']:.1f} ms | "
          f"{results['full_sync_ms']:.0f} ms | {c['dense_nvlink_ms']:.1f} / "
          f"{c['delta_nvlink_wire_ms']:.2f} ms | {c['dense_network_ms']:.0f} / "
          f"{c['delta_network_wire_ms']:.1f} ms | {results['floor_ms']:.1f} ms | "
          f"{all(s['bitwise'] for s in results['steps'])} |", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sync.json").write_text(json.dumps(results, indent=1))
        plot(results, args.out / "sync.png")


if __name__ == "__main__":
    main()
