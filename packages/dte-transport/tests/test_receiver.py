"""Receiver: applies onto exactly its base, rejects everything else and keeps its bytes."""

import importlib

import torch
import pytest
from dte_codec import Frame, decode, digests, encode_delta, encode_full
from dte_codec.decode import QueuedChecks
from dte_codec.encode import encode_delta_batched
from dte_detector import diff
from dte_transport import Receiver, Rejection
from dte_transport.receiver import by_name


def weights():
    torch.manual_seed(1)
    return {"w": torch.randn(16, 4).bfloat16(), "v": torch.randn(4)}


def seeded():
    source = weights()
    receiver = Receiver({n: torch.zeros_like(t) for n, t in source.items()})
    assert receiver.receive(encode_full(source, stream_id="s", version=1)).accepted
    return source, receiver


def delta(source, *, base=1, version=2, stream="s", encoder=encode_delta):
    new = {n: t.clone() for n, t in source.items()}
    new["w"][0, 0] += 1
    changes = {n: diff(source[n], new[n]) for n in source}
    return new, encoder(new, changes, stream_id=stream, base_version=base, version=version)


def snapshot(receiver):
    return {n: t.clone() for n, t in receiver.weights.items()}


def unchanged(receiver, before, version):
    return version == receiver.version and all(
        torch.equal(before[n].view(torch.uint8), t.view(torch.uint8))
        for n, t in receiver.weights.items())


def test_full_then_delta_accepted():
    """A full payload seeds stream and version; a delta on it moves to the next version."""
    source, receiver = seeded()
    new, data = delta(source)
    ack = receiver.receive(data)
    assert (True, 2, None) == (ack.accepted, ack.version, ack.rejection)
    assert torch.equal(new["w"].view(torch.int16), receiver.weights["w"].view(torch.int16))


def test_wrong_base_rejected():
    """A delta onto another version is rejected with WRONG_BASE; nothing changes."""
    source, receiver = seeded()
    before = snapshot(receiver)
    ack = receiver.receive(delta(source, base=0, version=2)[1])
    assert (False, Rejection.WRONG_BASE, "delta onto version 0, holding 1") == (
        ack.accepted, ack.rejection, ack.detail)
    assert unchanged(receiver, before, 1)


def test_wrong_stream_rejected():
    """A delta of another sender's stream is rejected with WRONG_STREAM."""
    source, receiver = seeded()
    before = snapshot(receiver)
    ack = receiver.receive(delta(source, stream="other")[1])
    assert (Rejection.WRONG_STREAM, "delta of stream 'other', holding 's'") == (
        ack.rejection, ack.detail)
    assert unchanged(receiver, before, 1)


def test_bad_bytes_rejected():
    """Garbage is BAD_PAYLOAD; the receiver keeps its version and bytes."""
    _, receiver = seeded()
    before = snapshot(receiver)
    ack = receiver.receive(b"not a payload at all, certainly")
    assert (False, Rejection.BAD_PAYLOAD) == (ack.accepted, ack.rejection)
    assert unchanged(receiver, before, 1)


def _flipped(frame: Frame, segment: int, byte: int) -> Frame:
    segments = [s.clone() for s in frame.segments]
    segments[segment][byte] ^= 0x80
    return Frame(frame.head, segments, pending_digest=frame.pending_digest)


@pytest.mark.parametrize("kind", ["delta", "queued", "full"])
def test_frame_with_one_changed_body_byte_rejected(kind):
    """A frame whose body differs from what was sealed in one byte (any byte of any
    segment) is BAD_PAYLOAD naming the body digest; the receiver keeps its version and
    every bit of its tensors. Also for a batched delta, whose digest is still queued when
    it is handed over (``Frame.pending_digest``)."""
    source, receiver = seeded()
    new, frame = delta(source, encoder=encode_delta_batched if kind == "queued" else encode_delta)
    assert (frame.pending_digest is not None) == (kind == "queued")
    if kind == "full":
        frame = encode_full(new, stream_id="s", version=2)
    before = snapshot(receiver)
    for k, segment in enumerate(frame.segments):
        for byte in range(0, segment.numel(), 5):
            ack = receiver.receive(_flipped(frame, k, byte))
            assert (False, Rejection.BAD_PAYLOAD) == (ack.accepted, ack.rejection)
            assert ack.detail.startswith("body_digest: expected ")
            assert unchanged(receiver, before, 1)
    assert receiver.receive(frame).accepted


def test_frame_with_reordered_segments_rejected():
    """A full frame whose two segments arrive in each other's place is refused."""
    source, receiver = seeded()
    frame = encode_full({"a": source["v"], "b": source["v"] + 1}, stream_id="s", version=2)
    receiver = Receiver({"a": torch.zeros(4), "b": torch.zeros(4)})
    a, b = frame.segments
    ack = receiver.receive(Frame(frame.header, (b, a)))
    assert (False, Rejection.BAD_PAYLOAD, None) == (ack.accepted, ack.rejection,
                                                    receiver.version)
    assert all(0 == t.abs().sum() for t in receiver.weights.values())


def test_mismatched_shape_rejected():
    """A full payload of other shapes is MISMATCH and writes nothing."""
    _, receiver = seeded()
    before = snapshot(receiver)
    ack = receiver.receive(encode_full({"w": torch.zeros(3).bfloat16(), "v": torch.zeros(4)},
                                       stream_id="t", version=5))
    assert (Rejection.MISMATCH, "tensor 'w': shape: expected (16, 4), got (3,)") == (
        ack.rejection, ack.detail)
    assert unchanged(receiver, before, 1)


def test_delta_before_any_full_rejected():
    """A receiver with no version rejects every delta."""
    source = weights()
    receiver = Receiver({n: torch.zeros_like(t) for n, t in source.items()})
    ack = receiver.receive(delta(source)[1])
    assert (False, None, Rejection.WRONG_STREAM) == (ack.accepted, ack.version, ack.rejection)


def test_digest_mismatch_rolls_a_delta_back():
    """With the sender's digests, a delta whose result differs from the sender's weights
    (here: a change the detector missed, in a tensor with no entry) is undone and refused."""
    source, receiver = seeded()
    new, _ = delta(source)
    new["v"][1] += 1  # changed, but not in the payload
    changes = {"w": diff(source["w"], new["w"]), "v": diff(source["v"], source["v"])}
    data = encode_delta(new, changes, stream_id="s", base_version=1, version=2)
    before = snapshot(receiver)
    ack = receiver.receive(data, digests=digests(new))
    assert (False, Rejection.DIGEST_MISMATCH) == (ack.accepted, ack.rejection)
    assert "1 tensors differ from the sender's weights after applying, e.g. 'v'" == ack.detail
    assert unchanged(receiver, before, 1)
    new["v"][1] -= 1
    assert receiver.receive(data, digests=digests(new)).accepted
    assert all(torch.equal(new[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in receiver.weights.items())


def test_digest_mismatch_after_a_full_leaves_no_version():
    """A full payload that does not match the sender's digests leaves no valid version,
    as a failed full write does; a digest naming an unknown tensor is a mismatch too."""
    source, receiver = seeded()
    other = {n: t + 1 for n, t in source.items()}
    ack = receiver.receive(encode_full(source, stream_id="s", version=2), digests=digests(other))
    assert (False, None, Rejection.DIGEST_MISMATCH) == (ack.accepted, receiver.version,
                                                        ack.rejection)
    ack = receiver.receive(encode_full(source, stream_id="s", version=3),
                           digests={**digests(source), "x": "00"})
    assert "no tensor 'x' to compare with the sender's digest" == ack.detail


def _delta_the_batched_decode_gives_way_on(monkeypatch, source):
    """A delta of ``source`` and the new weights; as on a GPU, its checks stay queued,
    and here they report one failure that the entry-by-entry decode does not have. The
    fallbacks the checks gave are appended to the returned list."""
    new = {n: t.clone() for n, t in source.items()}
    new["w"][::3] += 1
    new["v"][1:] -= 1
    data = encode_delta(new, {n: diff(source[n], new[n]) for n in source}, stream_id="s",
                        base_version=1, version=2)
    monkeypatch.setattr(importlib.import_module("dte_codec.decode"), "batched", lambda d: True)
    fallbacks, original = [], QueuedChecks.settle

    def failing(self, values=None):
        digest = (self.queued.tolist() if values is None else values)[0]
        fallbacks.append(original(self, (digest, 1)))
        return fallbacks[-1]

    monkeypatch.setattr(QueuedChecks, "settle", failing)
    return data, new, fallbacks


def test_a_delta_the_batched_decode_gives_way_on_is_staged_once(monkeypatch):
    """Where the batched decode's checks fail and the entry-by-entry decode's pass, a
    stage that reads the payload reads the entry-by-entry one: the delta is staged once
    and applied bit for bit."""
    source, receiver = seeded()
    data, new, fallbacks = _delta_the_batched_decode_gives_way_on(monkeypatch, source)
    staged = []

    def stage(weights, payload):
        staged.append(payload)
        return by_name(weights, payload)

    receiver.stage = stage
    ack = receiver.receive(data)
    assert (True, 2) == (ack.accepted, ack.version)
    assert 1 == len(staged)
    assert any(fallback is not None for fallback in fallbacks)
    assert all(torch.equal(new[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in receiver.weights.items())


def test_a_stage_that_leaves_the_checks_unread_is_staged_again(monkeypatch):
    """A stage that resolves the delta without reading the payload's queued checks (here
    from another decode of other weights) is called again with the entry-by-entry
    payload when the checks refuse the batched one: what is written is that payload's."""
    source, receiver = seeded()
    other = {n: t + 4 for n, t in source.items()}
    unrelated = decode(encode_delta(other, {n: diff(source[n], other[n]) for n in source},
                                    stream_id="s", base_version=1, version=2))
    data, new, fallbacks = _delta_the_batched_decode_gives_way_on(monkeypatch, source)
    staged = []

    def stage(weights, payload):
        staged.append(payload)
        return by_name(weights, unrelated if len(staged) == 1 else payload)

    receiver.stage = stage
    ack = receiver.receive(data)
    assert (True, 2) == (ack.accepted, ack.version)
    assert [False, True] == [payload is fallbacks[-1] for payload in staged]
    assert all(torch.equal(new[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in receiver.weights.items())
