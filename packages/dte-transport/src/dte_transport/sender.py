"""The sending state machine: full seed, deltas, anchors, commit after acknowledgement."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping

import attrs
import torch
from attrs.validators import ge
from dte_codec import ChangeSet, Frame, digests, encode_delta, encode_full
from dte_codec.change_table import changed_elements

from .ack import Ack
from .errors import LinkError, SyncError, VersionOrderError
from .loopback import Link
from .report import SyncKind, SyncReport, Timer

log = logging.getLogger(__name__)

NO_BASE = "no_base"
ANCHOR_DUE = "anchor_due"
DELTA = "delta"
DELTA_REJECTED = "delta_rejected"


@attrs.define
class Sender:
    """Sends versions of a set of tensors over a ``Link``.

    The first sync, the one after any rejection and every ``anchor_interval``-th after
    committed deltas are full; the others are deltas onto the version the receiver last
    acknowledged. A version counts as committed only when the receiver accepts it.
    """

    link: Link
    anchor_interval: int = attrs.field(default=20, kw_only=True, validator=ge(0))
    """Full anchor after this many committed deltas; 0 never anchors."""
    stream_id: str = attrs.field(factory=lambda: uuid.uuid4().hex, kw_only=True)
    """Identifies this sender's sequence of versions to receivers."""
    digests: bool = attrs.field(default=False, kw_only=True)
    """Send ``dte_codec.digests`` of the weights with every version, so that a link that
    checks them (``Loopback``, ``StagedLink``) refuses a version whose result differs
    from the sender's weights, e.g. a delta with a missed change (a full sync follows).
    Costs a pass over every tensor on the host per sync."""
    acknowledged: int | None = attrs.field(default=None, init=False)
    """The version the receiver holds, as far as this sender knows."""
    deltas_since_full: int = attrs.field(default=0, init=False)

    @property
    def anchor_due(self) -> bool:
        """The next version is a full anchor (``anchor_interval`` committed deltas since
        the last full one)."""
        return bool(self.anchor_interval) and self.deltas_since_full >= self.anchor_interval

    def sync(self, weights: Mapping[str, torch.Tensor], *, version: int,
             changes: Callable[[], Mapping[str, ChangeSet]]) -> SyncReport:
        """Deliver ``version``: a delta when possible, else full.

        ``changes`` is called only for a delta and returns, per tensor, its changes since
        the acknowledged version. A rejected delta falls back to a full sync at once.

        Raises:
            VersionOrderError: ``version`` is not newer than the acknowledged one.
            SyncError: not even a full sync was accepted.
        """
        self._check_order(version)
        if self.acknowledged is None:
            return self.sync_full(weights, version=version, reason=NO_BASE)
        if self.anchor_due:
            return self._full(weights, version, ANCHOR_DUE, SyncKind.ANCHOR)
        timer, base = Timer(), self.acknowledged
        with timer.phase("detect"):
            change_sets = changes()
        with timer.phase("encode"):
            frame = encode_delta(weights, change_sets, stream_id=self.stream_id,
                                 base_version=base, version=version)
        with timer.phase("send"):
            ack = self._send(frame, version, weights)
        if not ack.accepted:
            reason = f"{DELTA_REJECTED}: {ack.rejection.value}: {ack.detail}"
            log.warning("v%d delta rejected (%s), falling back to a full sync", version, reason)
            self.acknowledged = None
            return self._full(weights, version, reason, SyncKind.FULL, extra_bytes=frame.nbytes)
        self.acknowledged, self.deltas_since_full = version, self.deltas_since_full + 1
        report = SyncReport(version=version, kind=SyncKind.DELTA, reason=DELTA, base_version=base,
                            payload_bytes=frame.nbytes, dense_bytes=_dense_bytes(weights),
                            changed=changed_elements(change_sets),
                            ms=timer.ms)
        _log(report)
        return report

    def sync_full(self, weights: Mapping[str, torch.Tensor], *, version: int,
                  reason: str) -> SyncReport:
        """Deliver ``version`` in full, for the caller's ``reason``."""
        self._check_order(version)
        return self._full(weights, version, reason, SyncKind.FULL)

    def _full(self, weights: Mapping[str, torch.Tensor], version: int, reason: str,
              kind: SyncKind, extra_bytes: int = 0) -> SyncReport:
        timer = Timer()
        with timer.phase("encode"):
            frame = encode_full(weights, stream_id=self.stream_id, version=version)
        with timer.phase("send"):
            ack = self._send(frame, version, weights)
        if not ack.accepted:
            self.acknowledged = None
            raise SyncError(version, f"full sync rejected ({ack.rejection.value}): {ack.detail}")
        self.acknowledged, self.deltas_since_full = version, 0
        report = SyncReport(version=version, kind=kind, reason=reason, base_version=None,
                            payload_bytes=frame.nbytes + extra_bytes,
                            dense_bytes=_dense_bytes(weights), changed=None, ms=timer.ms)
        _log(report)
        return report

    def _send(self, frame: Frame, version: int, weights: Mapping[str, torch.Tensor]) -> Ack:
        try:
            if self.digests:
                return self.link.send(frame, digests=digests(weights))
            return self.link.send(frame)
        except LinkError as exc:
            self.acknowledged = None  # the receiver may or may not hold it now
            raise SyncError(version, f"link failed: {exc}") from exc

    def _check_order(self, version: int) -> None:
        if self.acknowledged is not None and version <= self.acknowledged:
            raise VersionOrderError(version, self.acknowledged)


def _dense_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def _log(report: SyncReport) -> None:
    log.info("v%d %s (%s) %d B of %d dense, %.1f ms", report.version, report.kind.value,
             report.reason, report.payload_bytes, report.dense_bytes, sum(report.ms.values()))
