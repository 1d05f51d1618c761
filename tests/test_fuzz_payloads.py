"""Fuzz the receiving side: thousands of mutated, truncated and forged payloads.

Acceptance: every mutation of a valid full or delta payload makes ``decode`` raise a
``CodecError`` (never ``IndexError``, ``struct.error``, ...) or yields a payload that is
valid in its own right; ``Receiver.receive`` never raises, and a rejected payload leaves
the receiver's bytes, version and stream as they were. (A write that fails midway
through an apply is covered by ``test_apply_rollback.py``.)

Two modes. ``raw``: the mutated bytes as they are, which the digest (or the size checks
before it) must catch. ``redigested``: the digest recomputed after the mutation, so that
the structural validation behind the digest is what has to catch it. A third family,
``reshaped``, edits an entry's fields through ``Header.pack`` with a consistent body
length, so that the section decoders themselves see inconsistent data.

The number of cases scales with the Hypothesis profile: 50 x ``max_examples`` per mode
(2,000 under the default ``ci`` profile, 100,000 under ``nightly``).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator

import attrs
import pytest
import torch
from bitwise import first_difference
from forge import redigest
from dte_codec import CodecError, Kind, decode, digests
from dte_codec.encodings import DTYPE_CODES, IndexEncoding, ValueEncoding, align
from dte_codec.errors import DigestError, EntryError, HeaderError
from dte_codec.header import Header
from dte_codec.region import Box
from dte_transport import Receiver, Rejection
from hypothesis import settings
from sample_payloads import STREAM, Sample, build_sample, fresh_receiver, snapshot, step

CASES_PER_EXAMPLE = 50
"""Fuzz cases per mode for each Hypothesis example of the active profile."""
MAX_BODY = 1 << 22
"""Largest body a reshaped payload may get (bytes); larger edits are skipped."""

_PRELUDE_FIELDS = (  # name, offset, width; the layout of FORMAT.md
    ("magic", 0, 4), ("codec_version", 4, 2), ("kind", 6, 1), ("reserved", 7, 1),
    ("header_length", 8, 4), ("entry_count", 12, 4), ("base_version", 16, 8),
    ("payload_version", 24, 8), ("body_length", 32, 8), ("digest", 40, 8),
    ("stream_id_length", 48, 2),
)
_PRELUDE_SIZE = 50
_ENTRY_FIELDS = (  # name, offset after the name, width
    ("dtype", 0, 1), ("ndim", 1, 1), ("index_encoding", 2, 1), ("value_encoding", 3, 1),
    ("index_width", 4, 1), ("value_width", 5, 1), ("entry_reserved", 6, 2), ("count", 8, 8),
    ("index_escapes", 16, 8), ("value_escapes", 24, 8),
)
_ENTRY_FIXED = 32


@pytest.fixture(scope="module")
def setup() -> Sample:
    return build_sample()


def _field_spans(data: bytes) -> list[tuple[str, int, int]]:
    """(name, offset, width) of every prelude and entry field of a valid payload."""
    header, _ = Header.unpack(memoryview(data))
    spans = list(_PRELUDE_FIELDS)
    pos = _PRELUDE_SIZE + len(header.stream_id.encode())
    for entry in header.entries:
        spans.append(("name_length", pos, 2))
        pos += 2 + len(entry.name.encode())
        spans += [(name, pos + off, width) for name, off, width in _ENTRY_FIELDS]
        pos += _ENTRY_FIXED
        spans += [("dim", pos + 8 * d, 8) for d in range(len(entry.shape))]
        pos += 8 * len(entry.shape)
    return spans


def _interesting(old: int, width: int, rng: random.Random) -> int:
    top = (1 << (8 * width)) - 1
    choices = [0, 1, 2, 7, 8, 255, top, top >> 1, (top >> 1) + 1, old + 1, old - 1, old ^ 1,
               old * 2, old + 8, 2**31, 2**62, rng.randrange(top + 1)]
    return rng.choice(choices) & top


def _mutate(data: bytes, spans: list[tuple[str, int, int]], rng: random.Random
            ) -> tuple[str, bytes]:
    """One random mutation of ``data`` and a description to reproduce it."""
    out = bytearray(data)
    header_end = spans[-1][1] + spans[-1][2]
    kind = rng.choice(["flip", "flip_header", "bit", "truncate", "extend", "insert", "delete",
                       "garbage", "field", "field", "swap"])
    if kind in ("flip", "flip_header"):
        limit = header_end if kind == "flip_header" else len(out)
        at = [rng.randrange(limit) for _ in range(rng.randint(1, 4))]
        for pos in at:
            out[pos] ^= rng.randrange(1, 256)
        return f"{kind} {at}", bytes(out)
    if kind == "bit":
        pos, bit = rng.randrange(len(out)), rng.randrange(8)
        out[pos] ^= 1 << bit
        return f"bit {bit} of byte {pos}", bytes(out)
    if kind == "truncate":
        size = rng.choice([rng.randrange(len(out)), rng.randrange(header_end + 1), len(out) - 1])
        return f"truncate to {size}", bytes(out[:size])
    if kind in ("extend", "insert"):
        pos = len(out) if kind == "extend" else rng.randrange(len(out) + 1)
        extra = rng.randbytes(rng.choice([1, 7, 8, 16]))
        out[pos:pos] = extra
        return f"{kind} {extra.hex()} at {pos}", bytes(out)
    if kind == "delete":
        pos, size = rng.randrange(len(out)), rng.choice([1, 4, 8, 16])
        del out[pos:pos + size]
        return f"delete {size} at {pos}", bytes(out)
    if kind == "garbage":
        keep = rng.choice([0, 4, _PRELUDE_SIZE, header_end])
        tail = rng.randbytes(rng.randrange(200))
        return f"keep {keep} then {tail.hex()}", bytes(out[:keep]) + tail
    if kind == "swap":
        a, b = rng.randrange(0, len(out) - 8), rng.randrange(0, len(out) - 8)
        out[a:a + 8], out[b:b + 8] = data[b:b + 8], data[a:a + 8]
        return f"swap 8 bytes at {a} and {b}", bytes(out)
    name, offset, width = rng.choice(spans)
    old = int.from_bytes(out[offset:offset + width], "little")
    value = _interesting(old, width, rng)
    out[offset:offset + width] = value.to_bytes(width, "little")
    return f"field {name}@{offset} {old} -> {value}", bytes(out)


def _reshaped(data: bytes, rng: random.Random) -> tuple[str, bytes] | None:
    """Edit one entry field and re-pack the header with a consistent body length."""
    header, offset = Header.unpack(memoryview(data))
    if not header.entries:
        return None
    at = rng.randrange(len(header.entries))
    entry = header.entries[at]
    field = rng.choice(["count", "index_width", "index_escapes", "value_width",
                        "value_escapes", "index_encoding", "value_encoding", "shape", "dtype"])
    if field in ("index_encoding", "value_encoding"):
        enum = IndexEncoding if field == "index_encoding" else ValueEncoding
        value = rng.choice(list(enum))
    elif field == "shape":
        value = tuple(max(0, d + rng.choice([-1, 1, 7])) for d in entry.shape) or (2,)
    elif field == "dtype":
        value = rng.choice(list(DTYPE_CODES))
    else:
        old = getattr(entry, field)
        value = max(0, rng.choice([old + 1, old - 1, 0, 1, 2 * old, old + 8,
                                   rng.randrange(0, 64)]))
        value = min(value, 255) if field.endswith("width") else value
    changed = attrs.evolve(entry, **{field: value})
    entries = header.entries[:at] + (changed,) + header.entries[at + 1:]
    forged = attrs.evolve(header, entries=entries)
    try:
        body_size = forged.body_size()
    except (ValueError, OverflowError):
        return None
    if body_size > MAX_BODY:
        return None
    body = bytearray(data[offset:offset + body_size]).ljust(body_size, b"\0")
    if rng.random() < 0.3:
        body = rng.randbytes(body_size)
    return f"entry {entry.name!r} {field} -> {value!r}", redigest(forged.pack() + body)


def _cases(setup: Sample, mode: str, count: int, seed: int) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    spans = {id(p): _field_spans(p) for p in (setup.full, setup.delta)}
    produced = 0
    while produced < count:
        source, label = rng.choice([(setup.delta, "delta"), (setup.delta, "delta"),
                                    (setup.full, "full")])
        if mode == "reshaped":
            case = _reshaped(source, rng)
            if case is None:
                continue
            what, mutated = case
        else:
            what, mutated = _mutate(source, spans[id(source)], rng)
            mutated = redigest(mutated) if mode == "redigested" else mutated
        if mutated == source:
            continue
        produced += 1
        yield f"{label}: {what}", mutated


def _check_accepted(receiver: Receiver, before: dict[str, torch.Tensor], data: bytes,
                    what: str) -> None:
    """An accepted payload is valid on its own: a delta only touched the listed elements."""
    payload = decode(data)
    header = payload.header
    assert header.payload_version == receiver.version, what
    if header.kind == Kind.FULL:
        return
    assert 1 == header.base_version, what
    touched = collections.defaultdict(list)
    for entry, where in zip(header.entries, payload.indices):
        touched[entry.name].append(where)
    for name, tensor in receiver.weights.items():
        old, new = before[name].reshape(-1), tensor.reshape(-1)
        same = old.view(torch.uint8).view(-1, old.element_size()) == \
            new.view(torch.uint8).view(-1, new.element_size())
        unchanged = same.all(1)
        for where in touched.get(name, []):
            if isinstance(where, Box):
                unchanged.view(tensor.shape)[where.slices()] = True
            else:
                unchanged[where] = True
        assert bool(unchanged.all()), f"{what}: {name} changed outside the payload's indices"


def _fuzz(setup: Sample, mode: str, count: int, seed: int) -> collections.Counter:
    receiver = fresh_receiver(setup)
    before = snapshot(receiver)
    expected = digests(before)
    outcomes: collections.Counter = collections.Counter()
    for what, mutated in _cases(setup, mode, count, seed):
        try:
            decode(mutated)
            decoded = "decoded"
        except CodecError as exc:
            decoded = type(exc).__name__
            assert str(exc), what
        except Exception as exc:  # the failure this test exists to find
            raise AssertionError(f"{mode} {what}: decode raised {exc!r}") from exc
        try:
            ack = receiver.receive(mutated)
        except Exception as exc:
            raise AssertionError(f"{mode} {what}: receive raised {exc!r}") from exc
        outcomes[decoded] += 1
        if ack.accepted:
            assert "decoded" == decoded, what
            outcomes["accepted"] += 1
            _check_accepted(receiver, before, mutated, what)
            receiver = fresh_receiver(setup)
            continue
        outcomes[ack.rejection.name] += 1
        assert ack.rejection != Rejection.APPLY_FAILED, what
        assert (1, STREAM) == (receiver.version, receiver.stream_id), what
        assert 1 == ack.version, what
        if digests(receiver.weights) != expected:
            raise AssertionError(f"{mode} {what}: {first_difference(before, receiver.weights)}")
    return outcomes


def _count() -> int:
    return CASES_PER_EXAMPLE * settings.default.max_examples


def test_valid_payloads_apply(setup):
    """The unmutated full and delta payloads are accepted: the fuzz starts from valid bytes."""
    receiver = fresh_receiver(setup)
    new, _ = step(setup.weights)
    ack = receiver.receive(setup.delta)
    assert ack.accepted and 2 == ack.version
    assert first_difference(new, receiver.weights) is None


def test_delta_covers_every_encoding(setup):
    """The fuzzed delta holds dense and sparse entries of every index encoding but the raw
    ones (which only win for sparse tensors of >= 2**17 elements; the ``reshaped`` family
    forges them) and boxes (sent by multi-rank plans), and of every value encoding."""
    header, _ = Header.unpack(memoryview(setup.delta))
    indices = {e.index_encoding for e in header.entries}
    values = {e.value_encoding for e in header.entries if e.index_encoding != IndexEncoding.DENSE}
    escapes = sum(e.value_escapes for e in header.entries)
    assert set(IndexEncoding) - {IndexEncoding.INT32, IndexEncoding.INT64,
                                 IndexEncoding.BOX} == indices
    assert set(ValueEncoding) == values
    assert 0 < escapes


def test_raw_mutations_are_rejected(setup):
    """Raw mutations never decode: the size checks or the digest reject every one, and the
    receiver keeps its bytes, version and stream."""
    outcomes = _fuzz(setup, "raw", _count(), seed=1)
    assert 0 == outcomes["decoded"]
    assert 0 == outcomes["accepted"]
    assert _count() == outcomes["BAD_PAYLOAD"]
    assert outcomes["DigestError"] > 0 and outcomes["HeaderError"] > 0


def test_redigested_mutations_raise_only_codec_errors(setup):
    """With the digest recomputed, structural validation rejects malformed payloads with
    typed errors, and a rejected payload leaves the receiver as it was."""
    outcomes = _fuzz(setup, "redigested", _count(), seed=2)
    assert 0 == outcomes["DigestError"]
    assert outcomes["HeaderError"] > 0 and outcomes["MISMATCH"] > 0
    assert outcomes["BAD_PAYLOAD"] > outcomes["accepted"]


def test_reshaped_entries_raise_only_codec_errors(setup):
    """Entry fields edited with consistent section sizes reach the section decoders, which
    reject inconsistent sections with ``EntryError``; nothing else escapes."""
    outcomes = _fuzz(setup, "reshaped", _count(), seed=3)
    assert 0 == outcomes["DigestError"]
    assert outcomes["EntryError"] > 0 and outcomes["HeaderError"] > 0


def test_forged_int64_indices_are_rejected(setup):
    """Regression: INT64 indices whose int64 differences wrap around ([0, 2**63-1,
    -2**63+10, 5]) looked increasing and in range by their first and last elements, and
    ``Receiver.receive`` crashed with ``IndexError``; now decode raises ``EntryError``."""
    header, offset = Header.unpack(memoryview(setup.delta))
    at = next(i for i, e in enumerate(header.entries) if e.name == "bias")
    entry = attrs.evolve(header.entries[at], count=4, index_encoding=IndexEncoding.INT64,
                         value_encoding=ValueEncoding.RAW, index_width=0, value_width=0,
                         value_escapes=0, index_escapes=0)
    forged = attrs.evolve(header, entries=(entry,))
    indices = torch.tensor([0, 2**63 - 1, -2**63 + 10, 5], dtype=torch.int64)
    body = indices.view(torch.uint8).numpy().tobytes() + bytes(align(4 * 4))
    data = redigest(forged.pack() + body)
    with pytest.raises(EntryError) as info:
        decode(data)
    assert ("tensor 'bias': indices: expected inside [0, 7), got "
            "[-9223372036854775798, 9223372036854775807]") == str(info.value)
    receiver = fresh_receiver(setup)
    ack = receiver.receive(data)
    assert (False, Rejection.BAD_PAYLOAD) == (ack.accepted, ack.rejection)


def test_garbage_of_every_short_length(setup):
    """Every prefix of a valid header, raw or redigested, fails with ``HeaderError`` or
    ``DigestError``, never an unrelated exception."""
    header_end = _field_spans(setup.delta)[-1]
    for size in range(header_end[1] + header_end[2] + 1):
        for data in (setup.delta[:size], redigest(setup.delta[:size])):
            with pytest.raises((HeaderError, DigestError)):
                decode(data)
