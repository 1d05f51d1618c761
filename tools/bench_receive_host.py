"""Host time of a rollout receiving deltas on the kernel path, measured on the CPU.

A Qwen3-4B-shaped model (290 tensors, 36 layers; small widths) sends deltas from
Megatron's layout; a ``Receiver`` with a ``ShardStage`` into SGLang's layout decodes,
routes and applies them with the codec's Triton kernels, which run under Triton's
interpreter (``TRITON_INTERPRET=1``, set here before anything imports Triton). The time
spent inside kernel launches is taken out of each receive: what is left is the host's
work (header, layout tables, torch ops on small tensors, launches' argument handling),
which on a GPU is where the device waits. Every element changes by one ulp or more, a
few per entry are escapes; the rollout is compared bit for bit with the trainer after
the last delta, and the kernels launched are listed so a run that fell back to the
reference is seen. Times are the process's CPU time (one torch thread), so other work on
a shared host does not count, with the garbage collector held off during a receive (the
interpreter leaves much garbage). ``decode`` is told that the CPU batches, as a GPU does.

Only public module names are used, so the same script times an older tree
(``PYTHONPATH`` pointing at its ``src`` folders) for before/after figures.

    uv run python tools/bench_receive_host.py --reps 8
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import attrs  # noqa: E402
import torch  # noqa: E402
from areal_dte.shard_stage import ShardStage  # noqa: E402
from dte_codec import encode_delta, encode_full  # noqa: E402
from dte_codec.dispatch import interpreted  # noqa: E402
from dte_codec.geometry import materialize  # noqa: E402
from dte_codec.layouts import ModelConfig, canonical_tensors  # noqa: E402
from dte_codec.megatron_layout import MegatronLayout, megatron_shard  # noqa: E402
from dte_codec.sglang_layout import SGLangLayout, sglang_shard  # noqa: E402
from dte_transport import Receiver  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

SHAPE = dict(vocab=1024, hidden=64, layers=36, heads=8, kv_heads=2, head_dim=8, intermediate=192)
"""Qwen3-4B's tensors and layer count at small widths: host work is per entry."""


@attrs.frozen
class Change:
    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor


class KernelClock:
    """Time spent inside interpreted kernel launches, and the launches by kernel."""

    def __init__(self):
        self.seconds = 0.0
        self.launches: collections.Counter[str] = collections.Counter()
        self.inside = False
        self._run = InterpretedFunction.run

    def __enter__(self) -> KernelClock:
        clock, run = self, self._run

        def timed_run(fn, *args, **kwargs):
            start = time.process_time()
            clock.inside = True
            try:
                return run(fn, *args, **kwargs)
            finally:
                clock.inside = False
                clock.seconds += time.process_time() - start
                clock.launches[fn.fn.__name__] += 1

        InterpretedFunction.run = timed_run
        return self

    def __exit__(self, *exc) -> None:
        InterpretedFunction.run = self._run


_READS = frozenset({torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__,
                    torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__,
                    torch.Tensor.cpu, torch.Tensor.numpy})
"""Tensor methods that read values to the host: on a GPU, a read of a device tensor is a
host synchronization."""


class TorchCalls(TorchFunctionMode):
    """The torch calls made outside kernel launches: on a GPU each is a launch or a
    host-side tensor operation, and the count does not depend on the host's load. Also
    the calls among them that read tensor values to the host (``_READS``; here every
    tensor is on the CPU, so a read of a host table counts too)."""

    def __init__(self, clock: KernelClock):
        super().__init__()
        self.clock = clock
        self.count = 0
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.clock.inside:
            self.count += 1
            self.reads += func in _READS
        return func(*args, **(kwargs or {}))


def step(weights: dict[str, torch.Tensor], gen: torch.Generator, per_entry: int
         ) -> dict[str, Change]:
    """Change up to ``per_entry`` elements of every matrix in place, a count that moves
    from sync to sync as real deltas' do (so no entry table repeats), bit patterns moved
    by one, a few by 4096 (residue escapes); vectors stay (as norms do at lr 3e-6)."""
    changes = {}
    for name, tensor in weights.items():
        flat = tensor.view(-1).view(torch.int16)
        if tensor.dim() < 2:
            empty = torch.empty(0, dtype=tensor.dtype)
            changes[name] = Change(torch.empty(0, dtype=torch.int64), empty, empty)
            continue
        count = per_entry - int(torch.randint(per_entry // 4 + 1, (), generator=gen))
        indices = torch.randperm(flat.numel(), generator=gen)[:count].sort().values
        old = flat[indices].clone()
        move = torch.where(torch.rand(indices.numel(), generator=gen) < 0.5, 1, -1)
        move[:3] *= 4096
        flat[indices] = (old + move).to(torch.int16)
        changes[name] = Change(indices, old.view(tensor.dtype), old.view(tensor.dtype))
    return changes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--per-entry", type=int, default=200,
                   help="most changed elements per matrix (each sync 3/4 of it up to all)")
    p.add_argument("--label", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # process time then counts one thread's work
    config = ModelConfig(**SHAPE, tie_word_embeddings=True)
    trainer_shard = megatron_shard(config, MegatronLayout(tp=1), rank=0)
    shard = sglang_shard(config, SGLangLayout(tp=1), rank=0)
    canonical = {n: torch.randn(s.shape).to(s.dtype)
                 for n, s in canonical_tensors(config).items()}
    trainer = materialize(trainer_shard, canonical)
    rollout = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in shard.tensors.items()}
    receiver = Receiver(rollout, stage=ShardStage.of(trainer_shard, shard, rollout))
    assert receiver.receive(encode_full(trainer, stream_id="s", version=1)).accepted
    gen = torch.Generator().manual_seed(1)
    frames = []
    for version in range(2, a.warmup + a.reps + 3):
        changes = step(trainer, gen, a.per_entry)
        frames.append(encode_delta(trainer, changes, stream_id="s", base_version=version - 1,
                                   version=version))
    host_ms, entries = [], len(frames[-1].header)
    # a GPU decodes every entry together; CPU tensors would go entry by entry
    sys.modules["dte_codec.decode"].batched = lambda device: True
    with interpreted():
        for k, frame in enumerate(frames[:-1]):
            gc.collect()  # the interpreter's garbage is not the receiver's work
            gc.disable()
            with KernelClock() as clock:
                start = time.process_time()
                ack = receiver.receive(frame)
                total = time.process_time() - start
            gc.enable()
            assert ack.accepted, ack.detail
            if k >= a.warmup:
                host_ms.append((total - clock.seconds) * 1e3)
        with KernelClock() as clock, TorchCalls(clock) as calls:  # one more, not timed
            assert receiver.receive(frames[-1]).accepted
    canonical_now = {n: t.clone() for n, t in canonical.items()}
    for piece in trainer_shard.pieces:  # the trainer's weights in the canonical layout
        target = canonical_now[piece.canonical][piece.region.slices()]
        target.copy_(trainer[piece.tensor][piece.local.slices()].view(target.shape))
    expected = materialize(shard, canonical_now)
    bitwise = all(torch.equal(expected[n].view(torch.int16), t.view(torch.int16))
                  for n, t in rollout.items())
    host_ms.sort()
    print(f"| receive host {a.label} | {len(trainer)} tensors, header {entries} B, "
          f"<= {a.per_entry} changed per matrix | median {statistics.median(host_ms):.2f} ms "
          f"(least {host_ms[0]:.2f}) | {calls.count} torch calls, {calls.reads} value reads | "
          f"bitwise {bitwise} | "
          f"launches per delta "
          f"{dict(sorted(clock.launches.items()))} |")


if __name__ == "__main__":
    main()
