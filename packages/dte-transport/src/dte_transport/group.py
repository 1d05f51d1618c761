"""Versions synced from the trainer ranks to the rollout ranks of one process group.

Each trainer rank holds shards of the weights in its own layout; each rollout rank
holds its shards in another. A plan (``dte_codec.geometry.plan``) says which box of each
trainer tensor lands where. Every rank of the group calls ``sync`` once per version and
walks the same sequence of collectives:

1. agree: one all-reduce decides full or delta for everyone. Trainers ask for a full
   sync when they hold no acknowledged base, an anchor is due or the caller forces one;
   rollout ranks veto a delta when they hold no version, and any disagreement on the
   base version or stream is a full sync too;
2. exchange (``two_round``): each trainer sends every rollout rank one frame, its body
   on ``device`` (a delta of remapped change sets);
3. prepare: each rollout rank checks its payloads against its tensors and resolves them;
4. vote: one all-reduce; only if every rollout rank prepared does any of them write.
   A rejected delta is followed at once by a full sync of the same version.

A full sync (or anchor) goes in bounded windows instead (``windows``): one all-reduce
agrees on the number of rounds, each round exchanges one window per (trainer, rollout)
pair, and each rollout rank checks (digests included) and writes every window as it
comes; after the last one it checks coverage and votes, and only then takes the version.
A full sync that fails after some window was written leaves that rank with no version.
After any nonzero vote every rank gathers the refusing ranks' reasons, so the trainers
report the rollout's own words.

A failed collective (a dead peer, the group's timeout) raises ``SyncError`` on trainers
and ``LinkError`` on rollout ranks; receivers that had not written stay at their version
and the next sync is full.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, MutableMapping, Sequence

import attrs
import torch
import torch.distributed as dist
from dte_codec import ChangeSet, CodecError, Frame, Kind, decode
from dte_codec.apply import prepare, prepare_window
from dte_codec.fit import check_covered
from dte_codec.batched_remap import RemapItem, remap_all
from dte_codec.errors import ApplyError, MismatchError
from dte_codec.geometry import Shard, Transfer, held_counts
from dte_codec.parts import Part, assemble, box_part, sparse_part
from dte_codec.remap import Remapped

from .ack import Ack, Rejection
from .agreement import Decision, agree, all_reduce_max, stream_key, vote
from .errors import LinkError, SyncError
from .report import SyncKind, SyncReport, Timer
from .sender import DELTA_REJECTED, Sender
from .two_round import exchange
from .windows import DEFAULT_WINDOW_BYTES, windows

log = logging.getLogger(__name__)


@attrs.frozen
class Roles:
    """Which ranks of the group train and which roll out (group ranks, disjoint)."""

    trainers: tuple[int, ...] = attrs.field(converter=tuple)
    rollouts: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not self.trainers or not self.rollouts or set(self.trainers) & set(self.rollouts):
            raise ValueError(f"roles need disjoint, non-empty trainer and rollout ranks, got "
                             f"{self.trainers} and {self.rollouts}")


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
        window_bytes: a full sync goes in windows of at most this many bytes per rollout
            rank (a single row of a tensor may exceed it).
    """

    def __init__(self, plan: Mapping[str, Sequence[Transfer]], *, roles: Roles, stream_id: str,
                 group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu",
                 anchor_interval: int = 20, coalesce: bool = True,
                 window_bytes: int = DEFAULT_WINDOW_BYTES):
        if anchor_interval < 0:
            raise ValueError(f"anchor_interval must be >= 0, got {anchor_interval}")
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be >= 1, got {window_bytes}")
        self.plan, self.roles = plan, roles
        self.stream_id, self.group, self.device = stream_id, group, torch.device(device)
        self.anchor_interval, self.coalesce = anchor_interval, coalesce
        self.window_bytes = window_bytes
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
        stream = stream_key(self.stream_id)
        vote = [int(self.acknowledged is None), int(self.anchor_due), int(forced), 0, base, -base,
                stream, -stream]
        try:
            decision = agree(vote, self.group, self.device)
            report = self._deliver(weights, version, decision, changes)
        except LinkError as exc:
            self.acknowledged = None
            raise SyncError(version, str(exc)) from exc
        self.acknowledged = version
        self.deltas_since_full = self.deltas_since_full + 1 if report.kind == SyncKind.DELTA else 0
        log.info("v%d %s (%s) %d B sent, %.1f ms", version, report.kind.value, report.reason,
                 report.payload_bytes, sum(report.ms.values()))
        return report

    def _deliver(self, weights, version: int, decision: Decision, changes) -> SyncReport:
        timer, changed, sent = Timer(), None, 0
        if decision.kind == SyncKind.DELTA:
            with timer.phase("detect"):
                change_sets = changes()
            changed = sum(len(c.indices) for c in change_sets.values())
            with timer.phase("encode"):
                outgoing = self._delta_payloads(weights, change_sets, decision.base, version)
            sent += sum(f.nbytes for f in outgoing.values())
            with timer.phase("send"):
                exchange(outgoing, group=self.group, device=self.device, coalesce=self.coalesce)
                rejection, detail = vote(None, "", self.group, self.device)
            if rejection is None:
                return self._report(weights, version, decision, sent, changed, timer.ms)
            decision = Decision(SyncKind.FULL, f"{DELTA_REJECTED}: {rejection.value}: {detail}",
                                 None)
            log.warning("v%d delta rejected (%s); syncing in full", version, decision.reason)
        sent += self._send_windows(weights, version, timer)
        with timer.phase("send"):
            rejection, detail = vote(None, "", self.group, self.device)
        if rejection is not None:
            raise LinkError(f"full sync rejected by a rollout rank ({rejection.value}): {detail}")
        return self._report(weights, version, decision, sent, None, timer.ms)

    def _send_windows(self, weights, version: int, timer: Timer) -> int:
        """Every window of the full version to every rollout rank, round by round, each
        round voted on before any rank writes it; the bytes sent.

        Raises:
            LinkError: a rollout rank refused a window (every rank stops there).
        """
        pending = {rank: windows(self.plan, weights, rank, self.window_bytes)
                   for rank in self.roles.rollouts}
        (rounds,) = all_reduce_max([max(map(len, pending.values()), default=0)], self.group,
                                    self.device)
        sent = 0
        for k in range(rounds):
            with timer.phase("encode"):
                outgoing = {rank: self._window(weights, pieces[k], version)
                            for rank, pieces in pending.items() if k < len(pieces)}
            sent += sum(f.nbytes for f in outgoing.values())
            with timer.phase("send"):
                exchange(outgoing, group=self.group, device=self.device, coalesce=self.coalesce)
                rejection, detail = vote(None, "", self.group, self.device)
            if rejection is not None:
                raise LinkError(f"full sync rejected by a rollout rank ({rejection.value}): "
                                f"{detail}")
        return sent

    def _window(self, weights, pieces: Sequence[tuple[str, Transfer]], version: int) -> Frame:
        return assemble([_box(transfer, weights[name]) for name, transfer in pieces],
                        stream_id=self.stream_id, kind=Kind.FULL, base_version=-1,
                        version=version)

    def _report(self, weights, version, decision, sent, changed, ms) -> SyncReport:
        dense = sum(t.numel() * t.element_size() for t in weights.values())
        return SyncReport(version=version, kind=decision.kind, reason=decision.reason,
                          base_version=decision.base, payload_bytes=sent, dense_bytes=dense,
                          changed=changed, ms=ms)

    def _delta_payloads(self, weights, change_sets: Mapping[str, ChangeSet], base: int,
                        version: int) -> dict[int, Frame]:
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
        return {rank: assemble(parts.get(rank, []), stream_id=self.stream_id, kind=Kind.DELTA,
                               base_version=base, version=version)
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
            LinkError: a collective failed; this rank did not write anything, or (a full
                sync after some window was written) it holds no version now.
        """
        version = -1 if self.version is None else self.version
        stream = stream_key(self.stream_id)
        vote = [0, 0, 0, int(self.version is None), version, -version, stream, -stream]
        decision = agree(vote, self.group, self.device)
        if decision.kind != SyncKind.DELTA:
            return self._full()
        ack = self._delta()
        return ack if ack.accepted else self._full()

    def _delta(self) -> Ack:
        inbox = exchange({}, group=self.group, device=self.device, coalesce=self.coalesce)
        rejection, detail, prepared, header = None, "", None, None
        try:
            payloads = [decode(inbox[rank], device=self.device) for rank in self.roles.trainers]
            header = payloads[0].header
            self._check(header, full=False)
            prepared = prepare(self.weights, payloads, held=self.held)
        except KeyError as exc:
            rejection, detail = Rejection.BAD_PAYLOAD, f"no payload from trainer rank {exc}"
        except _Refused as exc:
            rejection, detail = exc.rejection, str(exc)
        except CodecError as exc:
            rejection, detail = Rejection.BAD_PAYLOAD, str(exc)
        refused = self._refused(rejection, detail, header)
        if refused is not None:
            return refused
        try:
            prepared.write()
        except ApplyError as exc:  # rolled back
            log.error("writing v%d failed: %s", header.payload_version, exc)
            return Ack(accepted=False, version=self.version, rejection=Rejection.APPLY_FAILED,
                       detail=str(exc))
        self.version, self.stream_id = header.payload_version, header.stream_id
        return Ack(accepted=True, version=self.version)

    def _full(self) -> Ack:
        """Every window as it comes: checked, voted on by every rollout rank, then
        written; then coverage and a last vote (``windows``). A version that fits one
        window is all or nothing on every rank; a larger one that a rank refuses leaves
        the windows before it written, and every rank without a version."""
        (rounds,) = all_reduce_max([0], self.group, self.device)
        rejection, detail, header = None, "", None
        regions: dict[str, list] = defaultdict(list)
        for _ in range(rounds):
            inbox = exchange({}, group=self.group, device=self.device, coalesce=self.coalesce)
            prepared, payloads = None, []
            try:
                payloads = [decode(frame, device=self.device) for frame in inbox.values()]
                for payload in payloads:
                    self._check(payload.header, full=True)
                    header = header or payload.header
                    self._same_version(header, payload.header)
                prepared = prepare_window(self.weights, payloads) if payloads else None
            except _Refused as exc:
                rejection, detail = exc.rejection, str(exc)
            except MismatchError as exc:
                rejection, detail = Rejection.MISMATCH, str(exc)
            except CodecError as exc:
                rejection, detail = Rejection.BAD_PAYLOAD, str(exc)
            refused = self._refused(rejection, detail, header)
            if refused is not None:
                return refused
            if prepared is None:
                continue  # this rank's windows may be fewer than others'
            # from the first write on, the version held before is gone, whatever happens
            # next (a refusal of a later window, a failed collective)
            self.version = self.stream_id = None
            try:
                prepared.write()
            except ApplyError as exc:  # the next vote (a window's or the last) carries it
                rejection, detail = Rejection.APPLY_FAILED, str(exc)
                continue
            for payload in payloads:
                for entry, where in zip(payload.header.entries, payload.indices):
                    regions[entry.name].append(where)
        if rejection is None:
            try:
                check_covered(self.weights, regions, held=self.held)
            except MismatchError as exc:
                rejection, detail = Rejection.MISMATCH, str(exc)
        refused = self._refused(rejection, detail, header)
        if refused is not None:
            return refused
        self.version, self.stream_id = header.payload_version, header.stream_id
        return Ack(accepted=True, version=self.version)

    def _refused(self, rejection: Rejection | None, detail: str, header) -> Ack | None:
        """The vote; a refusal as this rank's answer, or None when every rank agreed."""
        worst, reasons = vote(rejection, detail, self.group, self.device)
        if worst is None:
            return None
        if rejection is not None:
            log.warning("rejected v%s (%s): %s; staying at version %s",
                        header and header.payload_version, rejection.value, detail, self.version)
        return Ack(accepted=False, version=self.version, rejection=rejection or worst,
                   detail=detail or f"another rollout rank rejected this version: {reasons}")

    def _same_version(self, first, header) -> None:
        if (header.stream_id, header.payload_version) != (first.stream_id,
                                                          first.payload_version):
            raise _Refused(Rejection.BAD_PAYLOAD, f"a window of v{header.payload_version} of "
                                                  f"{header.stream_id!r} in the full sync of "
                                                  f"v{first.payload_version}")

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
