"""The payload header: pack/unpack, every validation failure, and the pinned byte layout."""

from __future__ import annotations

import struct

import pytest
import torch
from dte_codec import Kind, decode, encode_delta, encode_full
from dte_codec.encodings import ALIGNMENT, IndexEncoding, ValueEncoding, align, index_itemsize
from dte_codec.entry import Entry
from dte_codec.errors import DigestError, HeaderError
from dte_codec.header import (BODY_DIGEST_OFFSET, CODEC_VERSION, DIGEST_OFFSET, MAGIC, NO_BASE,
                              Header, header_digest)
from dte_codec.parts import dense_part
from forge import redigest
from dte_detector import ChangeSet

PRELUDE = struct.Struct("<4sHBBIIqqQQHQ")
"""The prelude as FORMAT.md lays it out, written here independently of header.py."""
ENTRY = struct.Struct("<BBBBBBHQQQ")
BF16, FP32, INT8 = 1, 3, 5


def _entry_bytes(name: bytes, dtype: int, shape: tuple[int, ...], count: int, *,
                 index=0, value=0, index_width=0, value_width=0, reserved=0, index_escapes=0,
                 value_escapes=0, ndim: int | None = None) -> bytes:
    ndim = len(shape) if ndim is None else ndim
    return (struct.pack("<H", len(name)) + name
            + ENTRY.pack(dtype, ndim, index, value, index_width, value_width, reserved, count,
                         index_escapes, value_escapes)
            + b"".join(struct.pack("<Q", d) for d in shape))


def _forge(entries: bytes = b"", *, n_entries: int = 0, stream: bytes = b"s", body: int = 0,
           magic=MAGIC, version=CODEC_VERSION, kind=Kind.FULL, reserved=0, length=None,
           base=NO_BASE, payload=1, body_length=None, stream_length=None,
           digest: bool = True) -> bytes:
    """Payload bytes from raw field values, with a correct digest unless told otherwise."""
    size = PRELUDE.size + len(stream) + len(entries)
    length = size if length is None else length
    prelude = PRELUDE.pack(magic, version, kind, reserved, length, n_entries, base, payload,
                           body if body_length is None else body_length, 0,
                           len(stream) if stream_length is None else stream_length, 0)
    data = (prelude + stream + entries).ljust(align(size), b"\0") + bytes(body)
    return redigest(data) if digest else data


def _message(data: bytes, error: type = HeaderError) -> str:
    with pytest.raises(error) as info:
        Header.unpack(memoryview(data))
    return str(info.value)


def _header(*entries: Entry, kind: Kind = Kind.DELTA, base: int = 1,
            payload: int = 2) -> Header:
    return Header(stream_id="s", kind=kind, base_version=base, payload_version=payload,
                  entries=entries)


def _with_body(header: Header) -> bytes:
    return redigest(header.pack() + bytes(header.body_size()))


SPARSE = Entry(name="w", dtype=torch.bfloat16, shape=(4, 8), count=3,
               index_encoding=IndexEncoding.GAP8, index_escapes=1,
               value_encoding=ValueEncoding.RESIDUE, value_width=3, value_escapes=1)


def test_pack_unpack_round_trip():
    """``Header.unpack`` inverts ``Header.pack`` and returns the aligned body offset."""
    header = _header(
        SPARSE,
        Entry(name="dense", dtype=torch.float32, shape=(), count=1),
        Entry(name="ef", dtype=torch.float16, shape=(0, 3, 70000), count=0,
              index_encoding=IndexEncoding.DENSE),
        Entry(name="gewicht.ü", dtype=torch.bool, shape=(5,), count=2,
              index_encoding=IndexEncoding.ELIAS_FANO, index_width=1),
    )
    header = Header(stream_id="strøm", kind=Kind.DELTA, base_version=0, payload_version=2**63 - 1,
                    entries=header.entries)
    data = _with_body(header)
    unpacked, offset = Header.unpack(memoryview(data))
    assert header == unpacked
    assert len(header.pack()) == offset
    assert 0 == offset % ALIGNMENT


def test_pack_pads_to_alignment_with_zero_digest():
    """``pack`` leaves both digest fields zero and pads the header to a multiple of 8."""
    packed = _header(SPARSE).pack()
    assert 0 == len(packed) % ALIGNMENT
    assert bytes(8) == packed[DIGEST_OFFSET:DIGEST_OFFSET + 8]
    assert bytes(8) == packed[BODY_DIGEST_OFFSET:BODY_DIGEST_OFFSET + 8]


def test_body_size_sums_aligned_sections():
    """The body is every section padded to 8 bytes, in entry order."""
    # GAP8: 3 gap bytes, 1 escape (int32); RESIDUE: 2 fields x 3 bits, 1 position, 1 value
    assert (3, 4, 1, 4, 2) == SPARSE.section_sizes()
    assert 5 * 8 == _header(SPARSE).body_size()


def test_index_itemsize_switches_at_2_31():
    """Positions into fewer than 2**31 elements take 4 bytes, others 8."""
    assert (4, 8) == (index_itemsize(2**31 - 1), index_itemsize(2**31))


def test_header_digest_ignores_its_own_field():
    """The header digest covers every header byte (the body digest and the padding too)
    except its own 8-byte field, and no body byte."""
    data = bytearray(_with_body(_header(SPARSE)))
    digest = header_digest(data)
    data[DIGEST_OFFSET:DIGEST_OFFSET + 8] = b"\xff" * 8
    data[-1] ^= 1
    assert digest == header_digest(data)
    data[BODY_DIGEST_OFFSET] ^= 1
    assert digest != header_digest(data)
    data[BODY_DIGEST_OFFSET] ^= 1
    data[len(_header(SPARSE).pack()) - 1] ^= 1
    assert digest != header_digest(data)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "prelude: expected 58 bytes at offset 0, got 0 bytes in all"),
    (b"DTEP" + bytes(52), "prelude: expected 58 bytes at offset 0, got 56 bytes in all"),
    (_forge(magic=b"PETD"), "magic: expected b'DTEP', got b'PETD'"),
    (_forge(version=2), "codec_version: expected 3, got 2"),
    (_forge(reserved=1), "reserved: expected 0, got 1"),
    (_forge(length=57), "header_length: expected 58..64, got 57"),
    (_forge(length=65), "header_length: expected 58..64, got 65"),
    (_forge(body_length=8), "payload size: expected 72 bytes (header + body), got 64"),
    (_forge(body=8, body_length=0), "payload size: expected 64 bytes (header + body), got 72"),
    (_forge(kind=2), "kind: expected one of [0, 1], got 2"),
    (_forge(stream=b"\xff"), "stream_id: expected UTF-8 text, got b'\\xff'"),
    (_forge(stream_length=2), "stream_id: expected 2 bytes at offset 58, got 59 bytes in all"),
    (_forge(length=64), "header_length: expected 59, got 64"),
    (_forge(n_entries=1), "entry name length: expected 2 bytes at offset 59, got 59 bytes in all"),
    (_forge(b"\x05\x00ab", n_entries=1),
     "entry name: expected 5 bytes at offset 61, got 63 bytes in all"),
    (_forge(b"\x02\x00\xc3(", n_entries=1), "entry name: expected UTF-8 text, got b'\\xc3('"),
    (_forge(b"\x01\x00w" + bytes(31), n_entries=1),
     "entry fields: expected 32 bytes at offset 62, got 93 bytes in all"),
    (_forge(_entry_bytes(b"w", 11, (2,), 2), n_entries=1, body=8),
     "tensor 'w': dtype: expected one of [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], got 11"),
    (_forge(_entry_bytes(b"w", 0, (2,), 2), n_entries=1, body=8),
     "tensor 'w': dtype: expected one of [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], got 0"),
    (_forge(_entry_bytes(b"w", FP32, (2,), 2, reserved=7), n_entries=1, body=8),
     "tensor 'w': reserved: expected 0, got 7"),
    (_forge(_entry_bytes(b"w", FP32, (1,) * 17, 1), n_entries=1, body=8),
     "tensor 'w': ndim: expected <= 16, got 17"),
    (_forge(_entry_bytes(b"w", FP32, (2,), 2, ndim=2), n_entries=1, body=8),
     "shape: expected 8 bytes at offset 102, got 102 bytes in all"),
    (_forge(_entry_bytes(b"w", FP32, (2**62,), 1), n_entries=1),
     "tensor 'w': shape: expected dimensions < 2**62, got (4611686018427387904,)"),
    (_forge(_entry_bytes(b"w", FP32, (2,), 2, index=7), n_entries=1, body=8),
     "tensor 'w': index_encoding: expected one of [0, 1, 2, 3, 4, 5, 6], got 7"),
    (_forge(_entry_bytes(b"w", FP32, (2,), 2, value=2), n_entries=1, body=8),
     "tensor 'w': value_encoding: expected one of [0, 1], got 2"),
    (_forge(_entry_bytes(b"w", FP32, (2,), 2), n_entries=1, body=16),
     "body_length: expected 8, got 16"),
    (_forge(_entry_bytes(b"w", FP32, (2,), 2), n_entries=1, body=8, payload=-1),
     "payload_version: expected 0..2**63-1, got -1"),
])
def test_unpack_rejects(data, message):
    """Each malformed prelude or entry raises ``HeaderError`` naming the field, in the
    validation order of FORMAT.md."""
    assert message == _message(data)


def test_unpack_rejects_wrong_digest():
    """A header byte changed after the digest was computed raises ``DigestError``."""
    data = bytearray(_forge(body=8))
    expected = header_digest(data)
    stored = int.from_bytes(data[DIGEST_OFFSET:DIGEST_OFFSET + 8], "little")
    data[PRELUDE.size] = ord("t")  # the stream id
    assert (f"digest: expected {header_digest(data):#018x}, got {stored:#018x}"
            == _message(bytes(data), DigestError))
    assert expected == stored


def test_size_checks_precede_digest():
    """A truncated payload fails on its size before its digest is computed."""
    assert "payload size: expected 72 bytes (header + body), got 71" == _message(
        _forge(body=8, digest=False)[:-1])


@pytest.mark.parametrize(("header", "message"), [
    (_header(payload=-1), "payload_version: expected 0..2**63-1, got -1"),
    (_header(payload=2**63), "payload_version: expected 0..2**63-1, got 9223372036854775808"),
    (_header(payload=2.0), "payload_version: expected 0..2**63-1, got 2.0"),
    (_header(kind=Kind.FULL, base=0), "base_version: expected -1 for a full payload, got 0"),
    (_header(base=2), "base_version: expected 0..1 for a delta, got 2"),
    (_header(base=-1), "base_version: expected 0..1 for a delta, got -1"),
    (_header(base=1.0), "base_version: expected 0..1 for a delta, got 1.0"),
    (Header(stream_id="x" * 65536, kind=Kind.FULL, base_version=-1, payload_version=0,
            entries=()), "stream_id: expected <= 65535 UTF-8 bytes, got 65536"),
])
def test_validate_rejects_header(header, message):
    """``Header.validate`` checks versions against the kind and the stream id's length
    (entries of one tensor may repeat: ``apply_all`` checks that they do not overlap)."""
    with pytest.raises(HeaderError) as info:
        header.validate()
    assert message == str(info.value)


def _sparse(**fields) -> Entry:
    base = dict(name="t", dtype=torch.float32, shape=(10,), count=2,
                index_encoding=IndexEncoding.INT32)
    return Entry(**{**base, **fields})


@pytest.mark.parametrize(("entry", "kind", "message"), [
    (_sparse(shape=(1,) * 17), Kind.DELTA, "ndim: expected <= 16, got 17"),
    (_sparse(shape=(2**31, 2**31)), Kind.DELTA,
     "numel: expected < 2**62, got 4611686018427387904"),
    (_sparse(count=11), Kind.DELTA, "count: expected <= numel 10, got 11"),
    (_sparse(), Kind.FULL, "index_encoding: expected DENSE or BOX in a full payload, got INT32"),
    (_sparse(index_encoding=IndexEncoding.DENSE, count=9), Kind.FULL,
     "count: expected numel 10 for a dense entry, got 9"),
    (_sparse(count=0), Kind.DELTA, "count: expected >= 1 for a sparse or box entry, got 0"),
    (_sparse(index_encoding=IndexEncoding.DENSE, count=10,
             value_encoding=ValueEncoding.RESIDUE, value_width=2), Kind.DELTA,
     "value_encoding: expected RAW for a dense or box entry, got RESIDUE"),
    (_sparse(shape=(2**31,)), Kind.DELTA,
     "index_encoding: expected INT64 for a tensor of >= 2**31 elements, got INT32"),
    (_sparse(index_escapes=1), Kind.DELTA, "index_escapes: expected 0..2 (GAP8 only), got 1"),
    (_sparse(index_encoding=IndexEncoding.GAP8, index_escapes=3), Kind.DELTA,
     "index_escapes: expected 0..2 (GAP8 only), got 3"),
    (_sparse(index_width=1), Kind.DELTA, "index_width: expected 0..62 (ELIAS_FANO only), got 1"),
    (_sparse(index_encoding=IndexEncoding.ELIAS_FANO, index_width=63), Kind.DELTA,
     "index_width: expected 0..62 (ELIAS_FANO only), got 63"),
    (_sparse(dtype=torch.int8, value_encoding=ValueEncoding.RESIDUE, value_width=2), Kind.DELTA,
     "value_encoding: expected RAW for dtype torch.int8, got RESIDUE"),
    (_sparse(value_encoding=ValueEncoding.RESIDUE), Kind.DELTA,
     "value_width: expected 1..31 (RESIDUE only), got 0"),
    (_sparse(dtype=torch.bfloat16, value_encoding=ValueEncoding.RESIDUE, value_width=16),
     Kind.DELTA, "value_width: expected 1..15 (RESIDUE only), got 16"),
    (_sparse(value_width=3), Kind.DELTA, "value_width: expected 1..31 (RESIDUE only), got 3"),
    (_sparse(value_escapes=1), Kind.DELTA, "value_escapes: expected 0..2 (RESIDUE only), got 1"),
    (_sparse(value_encoding=ValueEncoding.RESIDUE, value_width=2, value_escapes=3), Kind.DELTA,
     "value_escapes: expected 0..2 (RESIDUE only), got 3"),
])
def test_validate_rejects_entry(entry, kind, message):
    """``Entry.validate`` checks each field against the others and names the tensor."""
    with pytest.raises(HeaderError) as info:
        entry.validate(kind)
    assert f"tensor 't': {message}" == str(info.value)
    assert "t" == info.value.tensor


def test_header_error_carries_fields():
    """``HeaderError`` is a ``ValueError`` with ``field``, ``expected`` and ``got``."""
    with pytest.raises(ValueError) as info:
        _header(base=5).validate()
    assert ("base_version", "0..1 for a delta", 5, None) == (
        info.value.field, info.value.expected, info.value.got, info.value.tensor)


GOLDEN_FULL = bytes.fromhex(
    # prelude: magic, codec version 3, kind FULL, reserved, header length 145, 2 entries
    "44544550" "0300" "00" "00" "91000000" "02000000"
    # base version -1, payload version 3, body length 16, header digest (xxh3-64),
    # stream length 1, body digest (keyed multilinear, FORMAT.md section 3)
    "ffffffffffffffff" "0300000000000000" "1000000000000000" "a5f5dd4e1971b7cd" "0100"
    "8068e4a1e4183678"
    "73"  # stream id "s"
    # entry "w": dtype 1 (bf16), ndim 1, DENSE, RAW, widths 0, reserved, count 3, escapes 0
    "0100" "77" "01" "01" "00" "00" "00" "00" "0000" "0300000000000000"
    "0000000000000000" "0000000000000000" "0300000000000000"
    # entry "b": dtype 3 (fp32), ndim 1, DENSE, RAW, count 1, shape (1,)
    "0100" "62" "03" "01" "00" "00" "00" "00" "0000" "0100000000000000"
    "0000000000000000" "0000000000000000" "0100000000000000"
    "00000000000000"  # header padding to 152
    "803f00c0003f" "0000"  # body: bf16 [1.0, -2.0, 0.5], padded to 8
    "0000803e" "00000000"  # fp32 [0.25], padded to 8
)
GOLDEN_DELTA = bytes.fromhex(
    # prelude: kind DELTA, header length 102, 1 entry, base 3, payload 4, body 16
    "44544550" "0300" "01" "00" "66000000" "01000000"
    "0300000000000000" "0400000000000000" "1000000000000000" "b5a790f0b2e02fa0" "0100"
    "ea43640601000000"  # body digest: 2 * k_0, the body's only nonzero word being 2
    "73"
    # entry "w": bf16, ndim 1, GAP8, RESIDUE, index width 0, value width 1, count 1
    "0100" "77" "01" "01" "04" "01" "00" "01" "0000" "0100000000000000"
    "0000000000000000" "0000000000000000" "0300000000000000"
    "0000"  # header padding to 104
    "02" "00000000000000"  # GAP8 gaps: index 1 is gap 2 from -1
    # (empty GAP8 escape list, empty residue escape positions and values)
    "00" "00000000000000"  # residue field: low bit of key(0xc001) = 0x3ffe
)


def _golden_inputs():
    base = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16),
            "b": torch.tensor([0.25])}
    new = {"w": base["w"].clone(), "b": base["b"]}
    new["w"].view(torch.int16)[1] += 1  # -2.0 -> the next pattern, one ulp away
    changes = {"w": ChangeSet.exact(torch.tensor([1], dtype=torch.int32), base["w"][1:2]),
               "b": ChangeSet.empty(base["b"])}
    return base, new, changes


def test_golden_full_bytes():
    """A small full payload has exactly the pinned bytes: any layout change fails here
    (and must bump ``CODEC_VERSION``)."""
    base, _, _ = _golden_inputs()
    assert GOLDEN_FULL.hex() == bytes(encode_full(base, stream_id="s", version=3)).hex()


def test_golden_delta_bytes():
    """A small delta payload has exactly the pinned bytes and decodes to its content."""
    _, new, changes = _golden_inputs()
    data = encode_delta(new, changes, stream_id="s", base_version=3, version=4)
    assert GOLDEN_DELTA.hex() == bytes(data).hex()
    payload = decode(GOLDEN_DELTA)
    assert [1] == payload.indices[0].tolist()
    assert Entry(name="w", dtype=torch.bfloat16, shape=(3,), count=1,
                 index_encoding=IndexEncoding.GAP8, value_encoding=ValueEncoding.RESIDUE,
                 value_width=1) == payload.header.entries[0]


def test_a_table_read_before_is_reused_and_a_changed_one_is_read_afresh():
    """The entry tables a reader remembers are keyed by their exact bytes: reading the
    same table again gives an equal header, and a table that differs in one byte (here
    the dtype code of its entry, digest fixed) is parsed and refused as if never seen."""
    data = bytearray(_with_body(_header(SPARSE)))
    first, _ = Header.unpack(memoryview(bytes(data)))
    again, _ = Header.unpack(memoryview(bytes(data)))
    assert first == again
    dtype_at = bytes(data).index(b"w") + 1
    data[dtype_at] = 99
    with pytest.raises(HeaderError) as info:
        Header.unpack(memoryview(redigest(bytes(data))))
    assert "tensor 'w': dtype: expected one of [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], got 99" == str(
        info.value)


def test_entries_valid_in_a_delta_are_still_refused_in_a_full_payload():
    """Validation is remembered per kind: entries that passed in a delta are checked
    again, and refused, in a full payload."""
    entries = (SPARSE,)
    Header(stream_id="s", kind=Kind.DELTA, base_version=0, payload_version=1,
           entries=entries).validate()
    with pytest.raises(HeaderError) as info:
        Header(stream_id="s", kind=Kind.FULL, base_version=-1, payload_version=1,
               entries=entries).validate()
    assert "tensor 'w': index_encoding: expected DENSE or BOX in a full payload, got GAP8" == str(
        info.value)


def test_full_table_read_where_it_was_built_is_that_table():
    """A full table read back in the process that built it is taken as that table (its
    ``Entry`` objects, so the header caches hit by identity, not by comparing entries)."""
    weights = {f"adopted.{k}": torch.zeros(k + 1, dtype=torch.bfloat16) for k in range(3)}
    header = decode(encode_full(weights, stream_id="s", version=1)).header
    assert all(entry is dense_part(name, t).entry
               for entry, (name, t) in zip(header.entries, weights.items()))
