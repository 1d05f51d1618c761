"""The body digest: its value (against an independent reference of FORMAT.md's formula),
its independence of how the body is split into segments, and the detection guarantee
FORMAT.md states, including where that guarantee ends."""

from __future__ import annotations

import importlib.util
import os

import hypothesis.strategies as st
import pytest
import torch
from dte_codec.body_digest import BodyRuns, as_words, body_digest, words_digest_torch
from dte_codec.dispatch import interpreted
from hypothesis import given, settings

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first imported

MASK = (1 << 64) - 1
M31 = (1 << 31) - 1


def _key(position: int) -> int:
    """FORMAT.md's ``k_i``, in plain Python integers."""
    x = (position + 0x4F1BBCDD) & M31
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M31
    x ^= x >> 15
    x = (x * 0x846CA68B) & M31
    x ^= x >> 16
    return 2 * x + 1


def _reference(body: bytes, first_word: int = 0) -> int:
    """FORMAT.md's body digest in plain Python integers."""
    body = body + bytes(-len(body) % 4)
    total = 0
    for i in range(len(body) // 4):
        position = first_word + i
        total = (total + _key(position) * int.from_bytes(body[4 * i:4 * i + 4], "little")) & MASK
    return total


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)


def _word_at(value: int, position: int) -> int:
    words = as_words(_tensor(value.to_bytes(4, "little")))
    return int(words_digest_torch(words, position)) & MASK


@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_matches_the_reference_however_split(body, cuts):
    """Any split into segments (cut inside words too, empty segments) gives the digest
    of the whole body, which is FORMAT.md's formula."""
    bounds = sorted({0, len(body), *(min(c, len(body)) for c in cuts)})
    segments = [_tensor(body[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert _reference(body) == body_digest(segments) == body_digest([_tensor(body)])


def test_pinned_value():
    """The digest of a known body is pinned (the delta of ``test_golden_delta_bytes``:
    one nonzero word, 2, at position 0)."""
    assert 0x1066443EA == body_digest([_tensor(b"\x02" + bytes(15))])


def test_far_positions_match_the_reference():
    """Word positions past 2**31 (bodies over 8 GiB) hash as the formula says."""
    for position in (2**31 - 1, 2**31 + 1, 2**32 + 5, 2**40 + 3):
        assert _reference(b"\x01\x02\x03\xff", position) == _word_at(0xFF030201, position)


@given(st.binary(min_size=1, max_size=64), st.data())
def test_every_single_word_change_is_detected(body, data):
    """Changing any bytes of one aligned 4-byte word, to anything, changes the digest."""
    body = bytearray(body + bytes(-len(body) % 4))
    word = data.draw(st.integers(0, len(body) // 4 - 1))
    new = data.draw(st.binary(min_size=4, max_size=4).filter(
        lambda b: b != bytes(body[4 * word:4 * word + 4])))
    changed = bytearray(body)
    changed[4 * word:4 * word + 4] = new
    assert body_digest([_tensor(bytes(body))]) != body_digest([_tensor(bytes(changed))])


def test_every_single_bit_flip_is_detected():
    """Each of the 512 one-bit flips of a 64-byte body changes the digest."""
    body = bytes(range(64))
    digest = body_digest([_tensor(body)])
    for bit in range(8 * len(body)):
        flipped = bytearray(body)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert digest != body_digest([_tensor(bytes(flipped))]), bit


@given(st.binary(min_size=8, max_size=64), st.data())
def test_every_exchange_of_two_words_is_detected(body, data):
    """Swapping two different words (or two different segments of one word each)
    changes the digest."""
    body = body + bytes(-len(body) % 4)
    words = [body[4 * i:4 * i + 4] for i in range(len(body) // 4)]
    i, j = data.draw(st.lists(st.integers(0, len(words) - 1), min_size=2, max_size=2,
                              unique=True))
    if words[i] == words[j]:
        return
    swapped = list(words)
    swapped[i], swapped[j] = words[j], words[i]
    assert body_digest([_tensor(w) for w in words]) != body_digest(
        [_tensor(w) for w in swapped])


def _unmix(key: int) -> int:
    """The position in ``[0, 2**31)`` whose key is ``key`` (``_key`` inverted step by step)."""
    x = (key - 1) // 2
    for shift, multiplier in ((16, 0x846CA68B), (15, 0x7FEB352D)):
        y = x
        for _ in range(31 // shift + 1):  # undo x ^= x >> shift
            x = y ^ (x >> shift)
        x = (x * pow(multiplier, -1, 1 << 31)) & M31
    y = x
    for _ in range(2):
        x = y ^ (x >> 16)
    return (x - 0x4F1BBCDD) & M31


def test_exchange_guarantee_holds_under_2_31_words_apart_and_ends_there():
    """The hardest exchange: words 0x80000000 and 0 (a difference with 31 trailing zeros)
    at two positions whose keys differ by an odd multiple of 2**31 (found by inverting
    the key) is still caught, as at distances 1 and 2**31 - 1; at distance 2**31, the
    limit FORMAT.md states, keys repeat and the same exchange goes unseen."""
    high, zero = 0x80000000, 0
    partner = _unmix((_key(7) + 2**31) & 0xFFFFFFFF)
    assert (_key(7) - _key(partner)) % 2**32 == 2**31 and _key(partner) % 2 == 1
    for distance, caught in ((1, True), (partner - 7, True), (2**31 - 1, True),
                             (2**31, False)):
        before = _word_at(high, 7) + _word_at(zero, 7 + distance)
        after = _word_at(zero, 7) + _word_at(high, 7 + distance)
        assert caught == ((before - after) & MASK != 0), distance


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@settings(max_examples=30 if CUDA else 8, deadline=None)
@given(st.binary(min_size=1, max_size=40000), st.lists(st.integers(0, 40000), max_size=4),
       st.data())
def test_kernel_matches_the_reference_and_sees_one_changed_byte(body, cuts, data):
    """The Triton kernel (one launch over all segments; Triton's interpreter on a CPU)
    gives the reference's digest for any split, and a different one when one byte of the
    body differs."""
    bounds = sorted({0, len(body), *(min(c, len(body)) for c in cuts)})
    device = "cuda" if CUDA else "cpu"
    position = data.draw(st.integers(0, len(body) - 1))
    changed = bytearray(body)
    changed[position] ^= data.draw(st.integers(1, 255))
    digests = []
    for payload in (body, bytes(changed)):
        whole = _tensor(payload).to(device)
        segments = [whole[a:b] for a, b in zip(bounds, bounds[1:])]
        with interpreted():
            digests.append(body_digest(segments))
        assert _reference(payload) == digests[-1]
    assert digests[0] != digests[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernel_over_runs_of_several_programs():
    """Runs longer than one program's chunk (a body of ~2.3 chunks, whole as one run or
    cut off one word boundary) hash as the reference says, and a byte changed in the last
    chunk is seen."""
    from dte_codec.body_digest_kernel import CHUNK
    size = int(2.3 * CHUNK * 4) + 3
    body = bytes(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(1),
                               dtype=torch.uint8).tolist())
    changed = bytearray(body)
    changed[-5] ^= 0x40
    device = "cuda" if CUDA else "cpu"
    words = size // 4 * 4  # whole words: one run, every program its
    for cut in (None, CHUNK * 4 + 1):
        digests = []
        for payload in (body, bytes(changed)):
            payload = payload[:words] if cut is None else payload
            whole = _tensor(payload).to(device)
            with interpreted():
                digests.append(body_digest([whole] if cut is None else [whole[:cut],
                                                                        whole[cut:]]))
            assert _reference(payload) == digests[-1]
        assert digests[0] != digests[1]


def test_kept_runs_of_a_body_of_views_hash_its_bytes_at_each_digest():
    """A body of several whole-word views is laid out once and kept for the next body at
    the same places; the kept runs read the bytes as they are at each digest (an in-place
    change is seen), and a body cut elsewhere is laid out anew."""
    data = torch.arange(96, dtype=torch.uint8)
    segments = (data[:20], data[20:48], data[48:])
    assert BodyRuns.of(segments) is BodyRuns.of((data[:20], data[20:48], data[48:]))
    before = body_digest(segments)
    data[30] ^= 1
    assert before != body_digest(segments) == body_digest((data.clone(),))
    other = (data[:48], data[48:])
    assert BodyRuns.of(other) is not BodyRuns.of(segments)
    assert body_digest(other) == body_digest((data.clone(),))
