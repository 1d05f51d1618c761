"""Frames: payloads whose body stays on the device where it was encoded. Their bytes,
their zero-copy segments, and decode's refusal of a body that differs in one byte or
comes in another order."""

from __future__ import annotations

import operator

import pytest
import torch
from dte_codec import Frame, decode, encode_delta, encode_full
from dte_codec.errors import DigestError, HeaderError
from dte_detector import diff


def _weights() -> dict[str, torch.Tensor]:
    return {"a": torch.linspace(-3, 3, 48).to(torch.bfloat16).reshape(6, 8),
            "b": torch.linspace(5, 6, 48).to(torch.bfloat16).reshape(6, 8),
            "odd": torch.arange(3, dtype=torch.float16)}


def _delta() -> Frame:
    old = _weights()
    new = {name: t.clone() for name, t in old.items()}
    new["a"].view(torch.int16).view(-1)[::5] += 1
    return encode_delta(new, {n: diff(old[n], new[n]) for n in old}, stream_id="s",
                        base_version=1, version=2)


def _corrupt(frame: Frame, segment: int, byte: int) -> Frame:
    segments = [s.clone() for s in frame.segments]
    segments[segment][byte] ^= 0x01
    return Frame(frame.header, segments)


def test_full_frame_segments_are_views_of_the_weights():
    """A full payload copies no weight: each dense entry's segment is the weight's
    storage, followed by zero padding where the size is not a multiple of 8."""
    weights = _weights()
    frame = encode_full(weights, stream_id="s", version=1)
    assert [t.data_ptr() for t in weights.values()] == [s.data_ptr() for s in frame.segments[:3]]
    assert [96, 96, 6, 2] == [s.numel() for s in frame.segments]
    assert [0, 0] == frame.segments[-1].tolist()


@pytest.mark.parametrize("make", [lambda: encode_full(_weights(), stream_id="s", version=1),
                                  _delta], ids=["full", "delta"])
def test_bytes_round_trip(make):
    """``bytes(frame)`` is the payload; ``Frame.from_bytes`` gives a frame with the same
    header and body, and both decode to the same payload."""
    frame = make()
    data = bytes(frame)
    back = Frame.from_bytes(data)
    assert (frame.header, frame.nbytes) == (back.header, len(data))
    assert torch.equal(torch.cat(frame.segments), back.body())
    assert decode(frame).header == decode(back).header == decode(data).header
    assert data == bytes(back)


def test_delta_frame_is_one_segment():
    """A delta's body is one contiguous segment."""
    assert 1 == len(_delta().segments)


@pytest.mark.parametrize("make", [lambda: encode_full(_weights(), stream_id="s", version=1),
                                  _delta], ids=["full", "delta"])
def test_any_changed_body_byte_is_refused(make):
    """Every single byte of every segment, flipped on the device side (no bytes
    involved), fails ``decode`` with the body digest."""
    frame = make()
    for k, segment in enumerate(frame.segments):
        for byte in range(segment.numel()):
            with pytest.raises(DigestError) as info:
                decode(_corrupt(frame, k, byte))
            assert "body_digest" == info.value.field


def test_reordered_segments_are_refused():
    """Two dense entries of the same size sent in each other's place fail the body
    digest, though every segment is intact."""
    frame = encode_full(_weights(), stream_id="s", version=1)
    a, b, *rest = frame.segments
    with pytest.raises(DigestError) as info:
        decode(Frame(frame.header, (b, a, *rest)))
    assert "body_digest" == info.value.field


def test_segments_must_be_bytes_on_one_device():
    """Segments that are not 1-D uint8 are a ``HeaderError`` before anything is read."""
    frame = encode_full(_weights(), stream_id="s", version=1)
    with pytest.raises(HeaderError) as info:
        decode(Frame(frame.header, (frame.segments[0].view(torch.int16), *frame.segments[1:])))
    assert "body segments" == info.value.field


def test_header_bytes_must_end_at_the_body():
    """A frame whose header bytes run past the aligned header is refused."""
    frame = _delta()
    body = frame.body()
    with pytest.raises(HeaderError) as info:
        decode(Frame(frame.header + bytes(bytes(body[:8])), (body[8:],)))
    assert "header bytes" == info.value.field


def test_decode_moves_a_frame_to_the_requested_device():
    """``device`` puts the decoded tensors there; without it they stay with the body."""
    payload = decode(_delta(), device="cpu")
    assert {torch.device("cpu")} == {s.device for v in payload.values for s in v}


@pytest.mark.parametrize("cuts", [(5,), (0, 96, 96, 150), (1, 97, 193), (3, 4, 5, 6, 199)],
                         ids=["inside-one", "empty-segments", "across", "many"])
def test_full_sections_whatever_the_segments(cuts):
    """A full frame's body cut into other segments (sections inside one, across several,
    empty segments, an empty section) decodes to the sections of its bytes, before and
    after the frame as encoded with the same header (section places are kept per table
    and segment sizes); a dense section is its segment itself."""
    weights = _weights() | {"none": torch.zeros(0, 4, dtype=torch.bfloat16)}
    frame = encode_full(weights, stream_id="s", version=1)
    body = torch.cat(frame.segments)
    bounds = [0, *cuts, body.numel()]
    recut = Frame(frame.header, [body[a:b].clone() for a, b in zip(bounds, bounds[1:])])
    expected = decode(bytes(frame))
    for payload in (decode(recut), decode(frame), decode(recut)):
        assert [[bytes(s.numpy()) for s in v] for v in expected.values] == [
            [bytes(s.numpy()) for s in v] for v in payload.values]
        assert expected.indices == payload.indices
    sections = [v[0] for v in decode(frame).values[:3]]  # then padding, then "none"
    assert all(map(operator.is_, sections, frame.segments[:3]))
