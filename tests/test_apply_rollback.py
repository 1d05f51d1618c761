"""A write that fails midway through an apply rolls every tensor back, whether it is
called directly (``ApplyError``) or through ``Receiver.receive`` (``APPLY_FAILED``)."""

from __future__ import annotations

import pytest
from bitwise import first_difference
from dte_codec import apply_, decode
from dte_codec.apply import Staged
from dte_codec.encodings import IndexEncoding
from dte_codec.errors import ApplyError
from dte_transport import Rejection
from sample_payloads import STREAM, Sample, build_sample, fresh_receiver, snapshot


@pytest.fixture(scope="module")
def setup() -> Sample:
    return build_sample()


def _failing_write(monkeypatch, k: int, *, after_writing: bool) -> list[str]:
    """Make the k-th ``Staged.write`` (1-based) raise, before or after it writes."""
    original = Staged.write
    calls: list[str] = []

    def write(self):
        calls.append(self.name)
        if len(calls) == k and not after_writing:
            raise RuntimeError("injected write failure")
        result = original(self)
        if len(calls) == k:
            raise RuntimeError("injected write failure")
        return result

    monkeypatch.setattr(Staged, "write", write)
    return calls


@pytest.mark.parametrize("after_writing", [False, True], ids=["before", "after"])
def test_failure_midway_through_apply_rolls_back(setup, monkeypatch, after_writing):
    """A write failing at any entry (sparse or dense, before or after it wrote) raises
    ``ApplyError`` and every tensor is bytewise as before."""
    payload = decode(setup.delta)
    entries = payload.header.entries
    assert {IndexEncoding.DENSE} < {e.index_encoding for e in entries}
    for k in range(1, len(entries) + 1):
        receiver = fresh_receiver(setup)
        before = snapshot(receiver)
        with monkeypatch.context() as patch:
            calls = _failing_write(patch, k, after_writing=after_writing)
            with pytest.raises(ApplyError) as info:
                apply_(receiver.weights, payload)
        assert k == len(calls)
        assert (f"writing tensor {entries[k - 1].name!r} failed after {k - 1} of {len(entries)} "
                "entries: RuntimeError('injected write failure'); every tensor was restored"
                ) == str(info.value)
        assert first_difference(before, receiver.weights) is None


@pytest.mark.parametrize("after_writing", [False, True], ids=["before", "after"])
def test_receiver_rejects_failed_apply(setup, monkeypatch, after_writing):
    """Through ``Receiver.receive`` a failed write is ``APPLY_FAILED``; the receiver stays
    at version 1 with its bytes, and a later retry of the same delta is accepted."""
    entries = decode(setup.delta).header.entries
    for k in range(1, len(entries) + 1):
        receiver = fresh_receiver(setup)
        before = snapshot(receiver)
        with monkeypatch.context() as patch:
            _failing_write(patch, k, after_writing=after_writing)
            ack = receiver.receive(setup.delta)
        assert (False, Rejection.APPLY_FAILED, 1) == (ack.accepted, ack.rejection, ack.version)
        assert (1, STREAM) == (receiver.version, receiver.stream_id)
        assert first_difference(before, receiver.weights) is None
        assert receiver.receive(setup.delta).accepted
