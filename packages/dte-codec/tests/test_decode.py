"""Decoding whole payloads: sections split by the header, indices and escapes validated."""

from __future__ import annotations

import struct

import pytest
import torch
from dte_codec.region import Box
from dte_codec import CodecError, Payload, decode, encode_delta, encode_full
from dte_codec.encodings import IndexEncoding, Kind, ValueEncoding, align
from dte_codec.entry import Entry
from dte_codec.errors import DigestError, EntryError, HeaderError
from dte_codec.header import BODY_DIGEST_OFFSET, DIGEST_OFFSET, Header, header_digest
from forge import redigest
from dte_detector import ChangeSet, diff


def _weights() -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-3, 3, 500).to(torch.bfloat16),
            "s": torch.tensor(2.0),
            "e": torch.empty(0, 2, dtype=torch.float16)}


def _forge(entries: tuple[Entry, ...], sections: list[bytes]) -> bytes:
    """A delta payload from header fields and raw section bytes, with a correct digest."""
    header = Header(stream_id="s", kind=Kind.DELTA, base_version=0, payload_version=1,
                    entries=entries)
    body = b"".join(s.ljust(align(len(s)), b"\0") for s in sections)
    return redigest(header.pack() + body)


def test_full_payload_sections():
    """Dense entries cover their whole tensor and have one raw value section with its bytes."""
    weights = _weights()
    payload = decode(encode_full(weights, stream_id="s", version=1))
    assert isinstance(payload, Payload)
    assert tuple(Box.whole(tuple(t.shape)) for t in weights.values()) == payload.indices
    for tensor, (values,) in zip(weights.values(), payload.values):
        assert torch.uint8 == values.dtype
        assert tensor.reshape(-1).view(torch.uint8).tolist() == values.tolist()
    assert 1000 + 8 + 0 == payload.nbytes == payload.header.body_size()


def test_delta_payload_indices():
    """Sparse entries come with their decoded int64 indices."""
    weights = _weights()
    new = dict(weights, w=weights["w"].clone())
    new["w"][[3, 200, 499]] = 0.0
    changes = {name: ChangeSet.empty(t) for name, t in weights.items()}
    changes["w"] = diff(weights["w"], new["w"])
    payload = decode(encode_delta(new, changes, stream_id="s", base_version=1, version=2))
    assert ["w"] == [e.name for e in payload.header.entries]
    assert (torch.int64, [3, 200, 499]) == (payload.indices[0].dtype,
                                            payload.indices[0].tolist())


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview], ids=lambda w: w.__name__)
def test_accepts_bytes_like(wrap):
    """``decode`` reads frames, bytes, bytearray and memoryview alike."""
    frame = encode_full(_weights(), stream_id="s", version=1)
    data = bytes(frame)
    assert decode(frame).header == decode(data).header
    assert decode(data).header == decode(wrap(data)).header


def test_device_argument():
    """Decoded tensors live on the requested device."""
    payload = decode(encode_full(_weights(), stream_id="s", version=1), device="cpu")
    assert {torch.device("cpu")} == {v.device for sections in payload.values for v in sections}


def test_empty_bytes():
    """No bytes at all is a truncated prelude."""
    with pytest.raises(HeaderError) as info:
        decode(b"")
    assert "prelude: expected 58 bytes at offset 0, got 0 bytes in all" == str(info.value)


def test_corrupted_body_byte():
    """One flipped body byte is caught by the body digest."""
    data = bytearray(bytes(encode_full(_weights(), stream_id="s", version=1)))
    stored = int.from_bytes(data[BODY_DIGEST_OFFSET:BODY_DIGEST_OFFSET + 8], "little")
    data[-20] ^= 0x10
    with pytest.raises(DigestError) as info:
        decode(bytes(data))
    got = int.from_bytes(redigest(data)[BODY_DIGEST_OFFSET:BODY_DIGEST_OFFSET + 8], "little")
    assert f"body_digest: expected {stored:#018x}, got {got:#018x}" == str(info.value)
    assert isinstance(info.value, (CodecError, ValueError))


def test_corrupted_header_byte():
    """One flipped header byte (here the body digest itself) is caught by the header
    digest."""
    data = bytearray(bytes(encode_full(_weights(), stream_id="s", version=1)))
    stored = int.from_bytes(data[DIGEST_OFFSET:DIGEST_OFFSET + 8], "little")
    data[BODY_DIGEST_OFFSET] ^= 0x01
    with pytest.raises(DigestError) as info:
        decode(bytes(data))
    assert (f"digest: expected {header_digest(data):#018x}, got {stored:#018x}"
            == str(info.value))


def test_rejects_invalid_indices():
    """Indices are validated at decode time, before any receiver is involved."""
    entry = Entry(name="w", dtype=torch.float32, shape=(10,), count=2,
                  index_encoding=IndexEncoding.INT32)
    data = _forge((entry,), [struct.pack("<ii", 7, 2), bytes(8)])
    with pytest.raises(EntryError) as info:
        decode(data)
    assert "tensor 'w': indices: expected strictly increasing, got 2 after 7 at 1" == str(
        info.value)


def test_rejects_invalid_escape_positions():
    """Residue escape positions are validated at decode time too."""
    entry = Entry(name="w", dtype=torch.bfloat16, shape=(10,), count=2,
                  index_encoding=IndexEncoding.INT32, value_encoding=ValueEncoding.RESIDUE,
                  value_width=2, value_escapes=1)
    data = _forge((entry,), [struct.pack("<ii", 1, 2), b"\x01", struct.pack("<i", 2),
                             bytes(2)])
    with pytest.raises(EntryError) as info:
        decode(data)
    assert "tensor 'w': value escape positions: expected inside [0, 2), got [2, 2]" == str(
        info.value)


def test_entries_split_at_aligned_offsets():
    """Each section starts at a multiple of 8 in the body, so typed views are aligned."""
    entries = (Entry(name="a", dtype=torch.bfloat16, shape=(3,), count=3),
               Entry(name="b", dtype=torch.float32, shape=(1,), count=1))
    data = _forge(entries, [struct.pack("<3H", 1, 2, 3), struct.pack("<f", 0.5)])
    payload = decode(data)
    assert [1, 2, 3] == payload.values[0][0].view(torch.int16).tolist()
    assert [0.5] == payload.values[1][0].view(torch.float32).tolist()
