"""What each rank process runs in the multi-process group-sync tests (gloo on CPU).

Every rank rebuilds the same canonical model from one seed, so each one can compute the
bf16 weights a full sync would give and compare bit for bit: trainer ranks optimise their
Megatron shards with real AdamW on gradients cut from one canonical gradient per step,
and AdamW being elementwise, the canonical trajectory run by every rank is the reference.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import uuid

import attrs
import torch
import torch.distributed as dist
from areal_dte import Method, TorchActor
from dte_codec import Frame
from dte_codec.geometry import materialize, plan
from dte_codec.layouts import ModelConfig
from dte_codec.megatron_layout import MegatronLayout, megatron_shard
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_transport import SyncError
from dte_transport.errors import LinkError
from dte_transport import group as group_module
from dte_transport.group import GroupReceiver, GroupSender, Roles
from dte_transport.two_round import exchange
from dte_transport.windows import DEFAULT_WINDOW_BYTES

LR, WD = 1e-3, 0.01


def rendezvous(folder) -> str:
    """A fresh file for ``init_process_group``: no port to pick, so no port to lose to
    another test between picking and binding it."""
    return f"file://{folder}/rendezvous-{uuid.uuid4().hex}"


RANK_MODULES = ("group_worker", "two_round_worker", "megatron_world", "torch._dynamo",
                "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.parallel_state")
"""What every rank of the default run's multi-process tests imports: the rank modules,
torch and the packages, ``torch._dynamo`` (the first ``torch.optim`` optimizer imports
it) and megatron-core. A name not importable where the fork server starts (a rank
module whose conftest did not put its folder on ``sys.path``) is skipped there and
imported by each rank instead."""


def ranks() -> multiprocessing.context.ForkServerContext:
    """The context to start rank processes with: each rank is forked from one fork server
    per test process that has imported ``RANK_MODULES`` once, where a spawned rank would
    import them again (3-15 s of CPU each on the 2-core machine). The server only
    imports: it joins no group and computes nothing, so a rank forked from it starts as
    clean as a spawned one (as DataLoader workers forked after ``import torch`` do)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_MODULES))
    return context


def finish(processes, seconds: float) -> tuple[list, list]:
    """Join every spawned process within ``seconds`` in all; kill and reap the ones still
    running.

    Returns:
        The processes that hung (killed) and every process's exit code.
    """
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(1.0, deadline - time.monotonic()))
    hung = [process for process in processes if process.is_alive()]
    stop(hung)
    return hung, [process.exitcode for process in processes]


def stop(processes) -> None:
    """Kill every started process that still runs, then reap each one: a killed process
    left unjoined stays a zombie child of the test process, which later tests' checks of
    their own children would find."""
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.is_alive():
            process.kill()
    for process in started:
        process.join()


@attrs.frozen
class Case:
    config: ModelConfig
    trainer: MegatronLayout
    rollout: SGLangLayout
    method: Method = Method.CAST
    versions: int = 12
    anchor: int = 4
    coalesce: bool = True
    """False: the per-op point-to-point variant (``DTE_DELTA_P2P_COALESCE=0``)."""
    window: int = DEFAULT_WINDOW_BYTES
    """Bytes per window of a full sync (``GroupSender(window_bytes=)``)."""
    fault: str | None = None
    """None; "kill_rollout": the first rollout rank dies in version 3's exchange; "corrupt": a
    byte of one payload flips in flight at version 5; "corrupt_full": one flips in the
    second window round of the full version 1; "wrong_base": the first rollout rank holds
    version 3 when version 4 comes; "restart": it restarts empty before version 5."""

    @property
    def trainers(self) -> int:
        return self.trainer.world_size

    @property
    def world(self) -> int:
        return self.trainer.world_size + self.rollout.world_size


def is_router(name: str) -> bool:
    return name.endswith("mlp.gate.weight")


def canonical_masters(config: ModelConfig) -> dict[str, torch.Tensor]:
    from dte_codec.layouts import canonical_tensors
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, spec in canonical_tensors(config).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = base + torch.randn(spec.shape, generator=gen) * 0.02
    return out


def canonical_grads(masters: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(t.shape, generator=gen) for name, t in masters.items()}


def payload_dtype(name: str) -> torch.dtype:
    return torch.float32 if is_router(name) else torch.bfloat16


def cut(shard, canonical):
    """The shard's tensors (fp32) cut out of canonical tensors."""
    return materialize(attrs.evolve(shard, tensors={
        n: attrs.evolve(s, dtype=torch.float32) for n, s in shard.tensors.items()}), canonical)


def expected_rollout(shard, canonical_master):
    local = cut(shard, canonical_master)
    dtype_of = {p.tensor: payload_dtype(p.canonical) for p in shard.pieces}
    return {n: t.to(dtype_of.get(n, torch.bfloat16)) for n, t in local.items()}


def run(rank: int, case: Case, store: str, out_dir: str, rejoin: str | None = None,
        replacement: bool = False) -> None:
    """One rank's whole life; with ``rejoin`` the survivors of a dead peer form a new
    group there with a ``replacement`` process, which starts empty at version 4."""
    reference = canonical_masters(case.config)
    role = _role(rank, case, reference, _join(rank, case, rejoin if replacement else store))
    reference_params = [torch.nn.Parameter(t.clone()) for t in reference.values()]
    reference_opt = torch.optim.AdamW(reference_params, lr=LR, weight_decay=WD, foreach=True)
    log = []
    for version in range(1, case.versions + 1):
        for param, grad in zip(reference_params, canonical_grads(reference, version).values()):
            param.grad = grad
        reference_opt.step()
        if replacement and version < REJOIN_VERSION:
            continue
        canonical = {n: p.detach() for n, p in zip(reference, reference_params)}
        outcome = role.version(version, canonical)
        log.append(f"{rank} v{version} {outcome}")
        if "Error" in outcome and rejoin is not None:
            # Drop the broken group before joining the new one: its gloo connections close
            # only once nothing holds it, and a survivor still waiting in one of its
            # collectives (one the dead rank had finished) learns of the failure from
            # them closing, where it would otherwise wait out the group's timeout.
            role.regroup(None)
            dist.destroy_process_group()
            role.regroup(_join(rank, case, rejoin))
    suffix = "-replacement" if replacement else ""
    with open(os.path.join(out_dir, f"rank{rank}{suffix}.log"), "w") as fh:
        fh.write("\n".join(log))
    _leave()


def _role(rank: int, case: Case, reference: dict[str, torch.Tensor], group):
    """The rank's trainer or rollout side on ``group``, the only holder of the group (the
    rejoin in ``run`` relies on that)."""
    roles = Roles(range(case.trainers), range(case.trainers, case.world))
    rollout_shards = [attrs.evolve(sglang_shard(case.config, case.rollout, rank=r),
                                   rank=case.trainers + r) for r in range(case.rollout.tp)]
    if rank < case.trainers:
        shard = megatron_shard(case.config, case.trainer, rank=rank)
        return _Trainer(case, shard, rollout_shards, roles, reference, group)
    return _Rollout(case, rollout_shards[rank - case.trainers], roles, group)


def _leave() -> None:
    """End the rank once every rank is done: gloo's teardown can abort a process whose
    peers are still closing their connections, so wait for all, then skip it."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


REJOIN_VERSION = 4
"""The first version a replacement process takes part in."""


SYNC_SECONDS = 60
"""How long a collective of the sync group waits for its peers (``new_group(timeout=)``):
a bound, not a wait any test sits out, since a dead rank's peers hear of it when its
connections close and the survivors of one close theirs (``run``'s rejoin)."""


RENDEZVOUS_SECONDS = 180
"""How long ``init_process_group`` waits for every rank: a test's first ranks start once
the fork server has imported ``RANK_MODULES`` (a replacement rank comes from the same
server; a spawned one, as ``awex_world`` starts, imports them itself), which takes up to
a minute on a loaded 2-core machine."""


def _join(rank: int, case: Case, store: str) -> dist.ProcessGroup:
    """Join the world at ``store``; return the group the syncs run on: every rank, with the
    ``SYNC_SECONDS`` timeout, shorter than the rendezvous's wait for slow starters."""
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=case.world,
                            timeout=datetime.timedelta(seconds=RENDEZVOUS_SECONDS))
    return dist.new_group(timeout=datetime.timedelta(seconds=SYNC_SECONDS))


def _die(outgoing, **kwargs):
    os._exit(0)


def _corrupting_second(outgoing, **kwargs):
    """``exchange`` as it is, then (from the second call) ``_corrupting``."""
    group_module.exchange = _corrupting
    return exchange(outgoing, **kwargs)


def _corrupting(outgoing, **kwargs):
    """``exchange`` with one byte of the first non-empty body flipped in flight, once."""
    group_module.exchange = exchange
    outgoing = dict(outgoing)
    for peer, frame in outgoing.items():
        if frame.body_size > 16:
            body = frame.body().clone()
            body[body.numel() // 2] ^= 0xFF
            outgoing[peer] = Frame(frame.header, (body,))
            break
    return exchange(outgoing, **kwargs)


class _Trainer:
    def __init__(self, case, shard, rollout_shards, roles, reference, group):
        self.case = case
        self.names = {p.tensor: p.canonical for p in shard.pieces}
        masters = {n: torch.nn.Parameter(t) for n, t in cut(shard, reference).items()}
        self.shard = shard
        optimizer = torch.optim.AdamW(masters.values(), lr=LR, weight_decay=WD, foreach=True)
        sender = GroupSender(plan(shard, rollout_shards), roles=roles, stream_id="trajectory",
                             group=group, anchor_interval=case.anchor, coalesce=case.coalesce,
                             window_bytes=case.window)
        dtypes = {n: payload_dtype(self.names[n]) for n in masters}
        self.actor = TorchActor(masters, optimizer, sender, method=case.method, dtype=dtypes)

    def regroup(self, group) -> None:
        self.actor.sender.group = group

    def version(self, version, canonical) -> str:
        if self.case.fault == "corrupt" and self.shard.rank == 0:
            group_module.exchange = _corrupting if version == 5 else exchange
        if self.case.fault == "corrupt_full" and self.shard.rank == 0 and version == 1:
            group_module.exchange = _corrupting_second
        grads = cut(self.shard, canonical_grads(canonical, version))
        for name, param in self.actor.masters.items():
            param.grad = grads[name]
        self.actor.step()
        try:
            report = self.actor.sync(version)
        except SyncError as exc:
            assert self.actor.sender.acknowledged is None
            return f"SyncError {type(exc.__cause__).__name__}"
        return f"{report.kind.value} {report.reason}"


class _Rollout:
    def __init__(self, case, shard, roles, group):
        self.case, self.shard = case, shard
        expected = expected_rollout(shard, canonical_masters(case.config))
        self.weights = {n: torch.zeros_like(t) for n, t in expected.items()}
        self.receiver = GroupReceiver(self.weights, roles=roles, group=group,
                                      coalesce=case.coalesce, shard=shard)

    def regroup(self, group) -> None:
        self.receiver.group = group

    def version(self, version, canonical) -> str:
        fault = self.case.fault
        if fault == "kill_rollout" and version == 3 and self.shard.rank == self.case.trainers:
            group_module.exchange = _die  # after the agreement, inside round 1
        first = self.shard.rank == self.case.trainers
        if first and (fault, version) in (("wrong_base", 4), ("restart", 5)):
            if fault == "restart":
                for tensor in self.weights.values():
                    tensor.zero_()
                self.receiver.version = self.receiver.stream_id = None
            else:
                self.receiver.version -= 1
        before = {n: t.clone() for n, t in self.weights.items()}
        held = self.receiver.version
        try:
            ack = self.receiver.sync()
        except LinkError:
            assert held == self.receiver.version
            assert all(torch.equal(before[n].view(torch.uint8), t.view(torch.uint8))
                       for n, t in self.weights.items() if t.numel())
            return "LinkError, unchanged"
        if not ack.accepted:
            return f"refused {ack.rejection.value}, version {self.receiver.version}"
        assert version == self.receiver.version, ack
        expected = expected_rollout(self.shard, canonical)
        for name, tensor in self.weights.items():
            want = expected[name]
            bad = (want.reshape(-1).view(torch.uint8) != tensor.reshape(-1).view(torch.uint8))
            assert not bool(bad.any()), f"rank {self.shard.rank} v{version} {name} differs"
        return "bitwise equal"
