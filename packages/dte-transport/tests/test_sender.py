"""Sender decisions: full seed, deltas, anchors, fallback after rejection, errors."""

import pytest
import torch
from dte_detector import diff
from dte_transport import LinkError, Loopback, Receiver, Sender, SyncError, SyncKind
from dte_transport.errors import VersionOrderError


class Pair:
    """A sender and a receiver on a loopback, with a trainer-side weight set to edit."""

    def __init__(self, anchor_interval=20):
        torch.manual_seed(0)
        self.weights = {"w": torch.randn(64, 8).bfloat16(), "b": torch.randn(8).bfloat16()}
        self.receiver = Receiver({n: torch.zeros_like(t) for n, t in self.weights.items()})
        self.link = Loopback(self.receiver)
        self.sender = Sender(self.link, anchor_interval=anchor_interval)
        self.previous = {n: t.clone() for n, t in self.weights.items()}

    def nudge(self):
        self.previous = {n: t.clone() for n, t in self.weights.items()}
        self.weights["w"][0, :3] += 1.0

    def changes(self):
        return {n: diff(self.previous[n], t) for n, t in self.weights.items()}

    def sync(self, version):
        report = self.sender.sync(self.weights, version=version, changes=self.changes)
        assert all(torch.equal(self.receiver.weights[n].view(torch.int16), t.view(torch.int16))
                   for n, t in self.weights.items())
        return report


def test_first_sync_is_full_then_deltas():
    """The first version goes in full (no base), the next ones as deltas on the last ack."""
    pair = Pair()
    first = pair.sync(1)
    pair.nudge()
    second = pair.sync(2)
    assert (SyncKind.FULL, "no_base", None) == (first.kind, first.reason, first.base_version)
    assert (SyncKind.DELTA, 1, 3) == (second.kind, second.base_version, second.changed)
    assert (64 * 8 + 8) * 2 == first.dense_bytes == second.dense_bytes
    assert second.payload_bytes < first.dense_bytes < first.payload_bytes


def test_anchor_after_n_committed_deltas():
    """With anchor_interval=2 the kinds run full, delta, delta, anchor, delta, delta, anchor."""
    pair = Pair(anchor_interval=2)
    kinds = []
    for version in range(1, 8):
        pair.nudge()
        kinds.append(pair.sync(version).kind)
    expected = [SyncKind.FULL, SyncKind.DELTA, SyncKind.DELTA, SyncKind.ANCHOR,
                SyncKind.DELTA, SyncKind.DELTA, SyncKind.ANCHOR]
    assert expected == kinds


def test_anchor_interval_zero_never_anchors():
    """anchor_interval=0 sends deltas forever after the first full sync."""
    pair = Pair(anchor_interval=0)
    kinds = []
    for version in range(1, 30):
        pair.nudge()
        kinds.append(pair.sync(version).kind)
    assert [SyncKind.FULL] + [SyncKind.DELTA] * 28 == kinds


def test_changes_not_computed_for_full_syncs():
    """The change callable runs only when a delta is sent."""
    pair = Pair()
    calls = []
    pair.sender.sync(pair.weights, version=1, changes=lambda: calls.append(1) or {})
    assert [] == calls


def test_rejected_delta_falls_back_to_full_at_once():
    """A delta onto a base the receiver lost is rejected; the same version then goes full."""
    pair = Pair()
    pair.sync(1)
    pair.receiver.version = None  # e.g. a rollout restarted without its weights
    pair.nudge()
    report = pair.sync(2)
    assert SyncKind.FULL == report.kind
    assert report.reason.startswith("delta_rejected: wrong_stream") or \
        report.reason.startswith("delta_rejected: wrong_base")
    assert 2 == pair.receiver.version == pair.sender.acknowledged


def test_rejected_full_raises_and_forces_full_next():
    """A full sync the receiver refuses raises SyncError; the sender forgets its base."""
    pair = Pair()
    pair.sync(1)
    pair.weights["extra"] = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(SyncError) as info:
        pair.sender.sync_full(pair.weights, version=2, reason="test")
    assert str(info.value).startswith("version 2 was not delivered: full sync rejected (mismatch)")
    assert None is pair.sender.acknowledged
    assert 1 == pair.receiver.version


def test_link_failure_raises_sync_error():
    """A link error surfaces as SyncError and the next sync is full."""

    class Broken:
        def send(self, data):
            raise LinkError("peer gone")

    sender = Sender(Broken())
    with pytest.raises(SyncError) as info:
        sender.sync_full({"w": torch.zeros(2)}, version=1, reason="test")
    assert ("version 1 was not delivered: link failed: peer gone; the next sync is full"
            == str(info.value))


def test_versions_must_increase():
    """A version not newer than the acknowledged one is refused before anything is sent."""
    pair = Pair()
    pair.sync(3)
    with pytest.raises(VersionOrderError) as info:
        pair.sync(3)
    assert "version 3 is not newer than the acknowledged 3" == str(info.value)
    assert 1 == pair.link.messages


def test_anchor_interval_validated():
    """A negative anchor interval is a ValueError naming the field."""
    with pytest.raises(ValueError, match="anchor_interval"):
        Sender(Loopback(Receiver({})), anchor_interval=-1)


def test_digests_turn_a_missed_change_into_a_full_sync():
    """``Sender(digests=True)``: a delta whose detector missed a change is refused by the
    receiver's digest check and the version goes in full; without digests it would be
    accepted and the receiver would be wrong."""
    for checked in (True, False):
        pair = Pair()
        pair.sender = Sender(pair.link, anchor_interval=20, digests=checked)
        pair.sync(1)
        pair.nudge()
        missed = {n: diff(t, t) for n, t in pair.weights.items()}  # finds nothing
        report = pair.sender.sync(pair.weights, version=2, changes=lambda: missed)
        same = all(torch.equal(pair.receiver.weights[n].view(torch.int16), t.view(torch.int16))
                   for n, t in pair.weights.items())
        if checked:
            assert (SyncKind.FULL, True) == (report.kind, same)
            assert report.reason.startswith("delta_rejected: digest_mismatch: 1 tensors differ")
        else:
            assert (SyncKind.DELTA, False) == (report.kind, same)
