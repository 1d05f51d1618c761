"""Versions synced from the trainer ranks to the rollout ranks of one process group.

Each trainer rank holds shards of the weights in its own layout; each rollout rank
holds its shards in another. A plan (``dte_codec.geometry.plan``) says which box of each
trainer tensor lands where. Every rank of the group calls ``sync`` once per version and
walks the same sequence of collectives:

1. agree: one all-reduce decides full or delta for everyone. Trainers ask for a full
   sync when they hold no acknowledged base, an anchor is due or the caller forces one;
   rollout ranks veto a delta when they hold no version, and any disagreement on the
   base version or stream is a full sync too;
2. exchange (``two_round``): each trainer sends every rollout rank one payload (a delta
   of remapped change sets, or dense boxes for a full sync);
3. prepare: each rollout rank checks its payloads against its tensors and resolves them;
4. vote: one all-reduce; only if every rollout rank prepared does any of them write.
   A rejected delta is followed at once by a full sync of the same version.

A failed collective (a dead peer, the group's timeout) raises ``SyncError`` on trainers
and ``LinkError`` on rollout ranks; receivers that had not written stay at their version
and the next sync is full.
"""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, MutableMapping, Sequence

import attrs
import torch
import torch.distributed as dist
import xxhash
from dte_codec import ChangeSet, CodecError, Kind, decode
from dte_codec.apply import prepare
from dte_codec.batched_remap import RemapItem, remap_all
from dte_codec.errors import ApplyError
from dte_codec.geometry import Shard, Transfer, held_counts
from dte_codec.parts import Part, assemble, box_part, sparse_part
from dte_codec.remap import Remapped

from .ack import Ack, Rejection
from .errors import LinkError, SyncError
from .report import SyncKind, SyncReport, Timer
from .sender import ANCHOR_DUE, DELTA, DELTA_REJECTED, NO_BASE, Sender
from .two_round import exchange

log = logging.getLogger(__name__)

FORCED = "forced"
ROLLOUT_VETO = "rollout_veto"
BASE_MISMATCH = "base_mismatch"
REJECTIONS = tuple(Rejection)


class _Slot(enum.IntEnum):
    """Positions in the agreement vector (all-reduced with MAX)."""

    NO_BASE = 0
    ANCHOR_DUE = 1
    FORCED = 2
    VETO = 3
    BASE_HIGH = 4
    BASE_LOW_NEG = 5
    STREAM_HIGH = 6
    STREAM_LOW_NEG = 7


@attrs.frozen
class Roles:
    """Which ranks of the group train and which roll out (group ranks, disjoint)."""

    trainers: tuple[int, ...] = attrs.field(converter=tuple)
    rollouts: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not self.trainers or not self.rollouts or set(self.trainers) & set(self.rollouts):
            raise ValueError(f"roles need disjoint, non-empty trainer and rollout ranks, got "
                             f"{self.trainers} and {self.rollouts}")


@attrs.frozen
class _Decision:
    kind: SyncKind
    reason: str
    base: int | None


def _stream_key(stream_id: str | None) -> int:
    return -1 if stream_id is None else xxhash.xxh3_64_intdigest(stream_id.encode()) >> 1


def _all_reduce_max(values: list[int], group, device) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise LinkError(f"all-reduce over {dist.get_backend(group)} failed: {exc}") from exc
    return tensor.tolist()


def _agree(vote: list[int], group, device) -> _Decision:
    got = _all_reduce_max(vote, group, device)
    base_high, base_low = got[_Slot.BASE_HIGH], -got[_Slot.BASE_LOW_NEG]
    reasons = [(got[_Slot.NO_BASE], NO_BASE), (got[_Slot.ANCHOR_DUE], ANCHOR_DUE),
               (got[_Slot.FORCED], FORCED), (got[_Slot.VETO], ROLLOUT_VETO),
               (base_high != base_low, BASE_MISMATCH),
               (got[_Slot.STREAM_HIGH] != -got[_Slot.STREAM_LOW_NEG], BASE_MISMATCH)]
    reason = next((why for flag, why in reasons if flag), None)
    if reason is None:
        return _Decision(SyncKind.DELTA, DELTA, base_high)
    kind = SyncKind.ANCHOR if reason == ANCHOR_DUE else SyncKind.FULL
    return _Decision(kind, reason, None)


def _vote(rejection: Rejection | None, group, device) -> Rejection | None:
    code = 0 if rejection is None else REJECTIONS.index(rejection) + 1
    (worst,) = _all_reduce_max([code], group, device)
    return None if worst == 0 else REJECTIONS[worst - 1]


class GroupSender:
    """A trainer rank's side of ``sync``.

    It has ``Sender``'s interface, so a trainer-side driver (``areal_dte.TorchActor``)
    works with either.

    Args:
        plan: per local tensor, its transfers to the rollout ranks (from
            ``dte_codec.geometry.plan``); tensors without transfers send nothing.
        roles: the group's trainer and rollout ranks.
        stream_id: the same on every trainer rank of one trajectory.
        group, device: the process group and the device buffers travel on.
        anchor_interval: full anchor after this many committed deltas; 0 never.
        coalesce: batch the point-to-point operations (``two_round``).
    """

    def __init__(self, plan: Mapping[str, Sequence[Transfer]], *, roles: Roles, stream_id: str,
                 group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu",
                 anchor_interval: int = 20, coalesce: bool = True):
        if anchor_interval < 0:
            raise ValueError(f"anchor_interval must be >= 0, got {anchor_interval}")
        self.plan, self.roles = plan, roles
        self.stream_id, self.group, self.device = stream_id, group, torch.device(device)
        self.anchor_interval, self.coalesce = anchor_interval, coalesce
        self.acknowledged: int | None = None
        self.deltas_since_full = 0

    anchor_due = Sender.anchor_due  # the same rule on the same two counters

    def sync(self, weights: Mapping[str, torch.Tensor], *, version: int,
             changes: Callable[[], Mapping[str, ChangeSet]]) -> SyncReport:
        """Deliver this rank's ``weights`` (local tensors in the payload dtype) as
        ``version`` to every rollout rank: a delta when all agree, else full.

        Raises:
            SyncError: the group failed, or not even a full sync was accepted.
        """
        return self._sync(weights, version, changes, forced=False)

    def sync_full(self, weights: Mapping[str, torch.Tensor], *, version: int,
                  reason: str) -> SyncReport:
        """Deliver ``version`` in full, for the caller's ``reason`` (e.g. a step gap)."""
        log.info("v%d: full sync requested (%s)", version, reason)
        return self._sync(weights, version, dict, forced=True)

    def _sync(self, weights, version, changes, *, forced) -> SyncReport:
        base = -1 if self.acknowledged is None else self.acknowledged
        stream = _stream_key(self.stream_id)
        vote = [int(self.acknowledged is None), int(self.anchor_due), int(forced), 0, base, -base,
                stream, -stream]
        try:
            decision = _agree(vote, self.group, self.device)
            report = self._deliver(weights, version, decision, changes)
        except LinkError as exc:
            self.acknowledged = None
            raise SyncError(version, str(exc)) from exc
        self.acknowledged = version
        self.deltas_since_full = self.deltas_since_full + 1 if report.kind == SyncKind.DELTA else 0
        log.info("v%d %s (%s) %d B sent, %.1f ms", version, report.kind.value, report.reason,
                 report.payload_bytes, sum(report.ms.values()))
        return report

    def _deliver(self, weights, version: int, decision: _Decision, changes) -> SyncReport:
        timer, changed, sent = Timer(), None, 0
        if decision.kind == SyncKind.DELTA:
            with timer.phase("detect"):
                change_sets = changes()
            changed = sum(len(c.indices) for c in change_sets.values())
            with timer.phase("encode"):
                outgoing = self._delta_payloads(weights, change_sets, decision.base, version)
            sent += sum(len(d) for d in outgoing.values())
            with timer.phase("send"):
                exchange(outgoing, group=self.group, device=self.device, coalesce=self.coalesce)
                rejection = _vote(None, self.group, self.device)
            if rejection is None:
                return self._report(weights, version, decision, sent, changed, timer.ms)
            decision = _Decision(SyncKind.FULL, f"{DELTA_REJECTED}: {rejection.value}", None)
            log.warning("v%d delta rejected by a rollout rank (%s); syncing in full", version,
                        rejection.value)
        with timer.phase("encode"):
            outgoing = self._full_payloads(weights, version)
        sent += sum(len(d) for d in outgoing.values())
        with timer.phase("send"):
            exchange(outgoing, group=self.group, device=self.device, coalesce=self.coalesce)
            rejection = _vote(None, self.group, self.device)
        if rejection is not None:
            raise LinkError(f"full sync rejected by a rollout rank ({rejection.value})")
        return self._report(weights, version, decision, sent, None, timer.ms)

    def _report(self, weights, version, decision, sent, changed, ms) -> SyncReport:
        dense = sum(t.numel() * t.element_size() for t in weights.values())
        return SyncReport(version=version, kind=decision.kind, reason=decision.reason,
                          base_version=decision.base, payload_bytes=sent, dense_bytes=dense,
                          changed=changed, ms=ms)

    def _full_payloads(self, weights, version: int) -> dict[int, bytes]:
        parts: dict[int, list[Part]] = defaultdict(list)
        for name, tensor in weights.items():
            for transfer in self.plan.get(name, ()):
                parts[transfer.target_rank].append(_box(transfer, tensor))
        return {rank: bytes(assemble(parts.get(rank, []), stream_id=self.stream_id,
                                     kind=Kind.FULL, base_version=-1, version=version))
                for rank in self.roles.rollouts}

    def _delta_payloads(self, weights, change_sets: Mapping[str, ChangeSet], base: int,
                        version: int) -> dict[int, bytes]:
        parts: dict[int, list[Part]] = defaultdict(list)
        changed = [(tensor, change_sets[name], RemapItem(
                        self.plan[name], tuple(tensor.shape),
                        change_sets[name].indices.to(device=tensor.device, dtype=torch.int64),
                        tensor=name))
                   for name, tensor in weights.items()
                   if self.plan.get(name) and len(change_sets[name].indices)]
        remapped = remap_all([item for _, _, item in changed])
        for (tensor, change, item), routed in zip(changed, remapped):
            for rank, part_list in _routed(item, tensor, change, routed):
                parts[rank].extend(part_list)
        return {rank: bytes(assemble(parts.get(rank, []), stream_id=self.stream_id,
                                     kind=Kind.DELTA, base_version=base, version=version))
                for rank in self.roles.rollouts}


def _box(transfer: Transfer, tensor: torch.Tensor) -> Part:
    block = tensor[transfer.source_box.slices()].reshape(transfer.target_box.size)
    return box_part(transfer.target_tensor, block, shape=transfer.target_shape,
                    start=transfer.target_box.start)


def _routed(item: RemapItem, tensor: torch.Tensor, change: ChangeSet,
            routed: Mapping[tuple[int, str], Remapped]):
    """Per target of one source tensor (``remap_all`` of its changes gave ``routed``): a
    sparse part, or its dense boxes when smaller."""
    flat = tensor.reshape(-1)
    for (rank, target), remapped in routed.items():
        if remapped.indices.numel() == 0:
            continue
        boxes = [t for t in item.transfers if t.target == (rank, target)]
        positions = remapped.positions
        part = sparse_part(target, flat[item.indices[positions]], shape=boxes[0].target_shape,
                           indices=remapped.indices, base_low=change.base_low[positions],
                           base_high=change.base_high[positions])
        dense = sum(t.target_box.numel for t in boxes) * tensor.element_size()
        yield rank, ([_box(t, tensor) for t in boxes] if part.nbytes >= dense else [part])


class GroupReceiver:
    """A rollout rank's side of ``sync``: its live tensors at one version of one stream."""

    def __init__(self, weights: MutableMapping[str, torch.Tensor], *, roles: Roles,
                 group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu",
                 coalesce: bool = True, shard: Shard | None = None):
        """``shard``: this rank's geometry, where some local elements come from no
        trainer (SGLang's vocab padding rows): a full version then covers exactly the
        elements its pieces hold, and the rest are never written."""
        self.weights, self.roles, self.group = weights, roles, group
        self.held = None if shard is None else held_counts(shard)
        self.device, self.coalesce = torch.device(device), coalesce
        self.version: int | None = None
        self.stream_id: str | None = None

    def sync(self) -> Ack:
        """Take part in one version's sync; the answer says what this rank ended with.

        Raises:
            LinkError: a collective failed; this rank did not write anything.
        """
        version = -1 if self.version is None else self.version
        stream = _stream_key(self.stream_id)
        vote = [0, 0, 0, int(self.version is None), version, -version, stream, -stream]
        decision = _agree(vote, self.group, self.device)
        ack = self._round(decision.kind != SyncKind.DELTA)
        if ack.accepted or decision.kind != SyncKind.DELTA:
            return ack
        return self._round(full=True)

    def _round(self, full: bool) -> Ack:
        inbox = exchange({}, group=self.group, device=self.device, coalesce=self.coalesce)
        rejection, detail, prepared, header = None, "", None, None
        try:
            payloads = [decode(inbox[rank], device=self.device) for rank in self.roles.trainers]
            header = payloads[0].header
            self._check(header, full)
            prepared = prepare(self.weights, payloads, held=self.held)
        except KeyError as exc:
            rejection, detail = Rejection.BAD_PAYLOAD, f"no payload from trainer rank {exc}"
        except _Refused as exc:
            rejection, detail = exc.rejection, str(exc)
        except CodecError as exc:
            rejection, detail = Rejection.BAD_PAYLOAD, str(exc)
        worst = _vote(rejection, self.group, self.device)
        if worst is not None:
            if rejection is not None:
                log.warning("rejected v%s (%s): %s; staying at version %s",
                            header and header.payload_version, rejection.value, detail,
                            self.version)
            return Ack(accepted=False, version=self.version, rejection=rejection or worst,
                       detail=detail or "another rollout rank rejected this version")
        try:
            prepared.write()
        except ApplyError as exc:  # rolled back (a delta) or no valid version (full)
            if prepared.full:
                self.version = self.stream_id = None
            log.error("writing v%d failed: %s", header.payload_version, exc)
            return Ack(accepted=False, version=self.version, rejection=Rejection.APPLY_FAILED,
                       detail=str(exc))
        self.version, self.stream_id = header.payload_version, header.stream_id
        return Ack(accepted=True, version=self.version)

    def _check(self, header, full: bool) -> None:
        if full != (header.kind == Kind.FULL):
            raise _Refused(Rejection.BAD_PAYLOAD, f"a {header.kind.name.lower()} payload in a "
                                                  f"{'full' if full else 'delta'} round")
        if not full and (header.stream_id, header.base_version) != (self.stream_id,
                                                                     self.version):
            raise _Refused(Rejection.WRONG_BASE, f"delta onto {header.base_version} of "
                                                 f"{header.stream_id!r}, holding {self.version}")


class _Refused(Exception):
    def __init__(self, rejection: Rejection, detail: str):
        self.rejection = rejection
        super().__init__(detail)
