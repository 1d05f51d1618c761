"""Host time of receiving a full version on a rollout rank: a Megatron TP1 trainer's
weights as one full frame (one body segment per tensor) into an SGLang TP1 rank through
a ``ShardStage``, phase by phase.

The model has Qwen3-4B's structure (36 layers, 32 query heads in 8 groups, tied
embedding: 290 tensors, every fused ``linear_qkv`` cut into 24 boxes of ``qkv_proj``)
with every dimension scaled down (``--scale``), so the device work is negligible and
what is timed is the host's: header parse, section split, the fit checks, the copy plan
look-up and the address tables. Phases:

* ``parse``: ``Header.unpack_head``, ``section_views.entry_sections`` and
  ``decode._per_entry`` (decode without its body digest, which runs on the device);
* ``stage``: ``ShardStage`` on the decoded payload (on the CPU inside
  ``dispatch.interpreted()``, so the kernel path's staging is timed; it launches nothing);
* on CUDA only, as they launch kernels: ``digest`` (``body_digest`` of the segments),
  ``write`` (the staged copies) and ``receive`` (a whole ``Receiver.receive``).

Only names that older trees have are used, so ``PYTHONPATH`` pointing at another
checkout times it in the same way for before/after figures.

    python3 tools/bench_receive_full_host.py --device cuda
    python3 tools/bench_receive_full_host.py --reps 200
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from areal_dte.shard_stage import ShardStage
from bench_frame_host import timed
from dte_codec import decode, encode_full
from dte_codec.body_digest import body_digest
from dte_codec.decode import _per_entry
from dte_codec.dispatch import interpreted
from dte_codec.header import Header
from dte_codec.layouts import ModelConfig
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.section_views import entry_sections
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_transport import Receiver

QWEN3_4B = dict(vocab=151936, hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                intermediate=9728)


def scaled(scale: int) -> ModelConfig:
    """Qwen3-4B's structure with hidden, head and MLP widths and the vocabulary divided by
    ``scale`` (heads, groups and layers kept: they fix the number of tensors and boxes)."""
    shape = dict(QWEN3_4B, hidden=QWEN3_4B["hidden"] // scale,
                 head_dim=max(QWEN3_4B["head_dim"] // scale, 1),
                 intermediate=QWEN3_4B["intermediate"] // scale,
                 vocab=QWEN3_4B["vocab"] // scale)
    return ModelConfig(**shape, tie_word_embeddings=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=64, help="divide Qwen3-4B's widths by this")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--label", default="")
    a = p.parse_args()
    device = torch.device(a.device)
    config = scaled(a.scale)
    trainer = megatron_shard(config, MegatronLayout(tp=1), rank=0)
    rollout = sglang_shard(config, SGLangLayout(tp=1), rank=0)
    weights = {n: torch.randn(s.shape, device=device).to(s.dtype)
               for n, s in trainer.tensors.items()}
    local = {n: torch.zeros(s.shape, dtype=s.dtype, device=device)
             for n, s in rollout.tensors.items()}
    stage = ShardStage.of(trainer, rollout, local)
    frame = encode_full(weights, stream_id="s", version=1)
    payload = decode(frame)
    kernel_path = interpreted if device.type == "cpu" else contextlib.nullcontext

    def parse():
        header = Header.unpack_head(memoryview(frame.header), frame.body_size)
        return _per_entry(header, entry_sections(header, frame.segments))

    def staged():
        with kernel_path():
            return stage(local, payload)

    rows = {"parse": timed(parse, reps=a.reps, device=device),
            "stage": timed(staged, reps=a.reps, device=device)}
    if device.type == "cuda":
        rows["digest"] = timed(lambda: body_digest(frame.segments), reps=a.reps,
                               device=device)
        receiver = Receiver(local, device=device, stage=stage)
        prepared = stage(local, payload)
        rows["write"] = timed(prepared.write, reps=a.reps, device=device)
        rows["receive"] = timed(lambda: receiver.receive(frame), reps=a.reps, device=device)
    cells = " | ".join(f"{name} {median:.3f} ms (p90 {p90:.3f})"
                       for name, (median, p90) in rows.items())
    print(f"| full receive host {a.label} | {len(weights)} tensors, Qwen3-4B / {a.scale} "
          f"on {a.device} | {cells} |")


if __name__ == "__main__":
    main()
