"""The body digest: its value (against an independent reference of FORMAT.md's formula),
its independence of how the body is split into segments, and the detection guarantee
FORMAT.md states, including where that guarantee ends."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from dte_codec.body_digest import body_digest, segment_digest_torch
from hypothesis import given

MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _reference(body: bytes, first_word: int = 0) -> int:
    """FORMAT.md's body digest in plain Python integers."""
    body = body + bytes(-len(body) % 4)
    total = 0
    for i in range(len(body) // 4):
        position = first_word + i
        key = ((_splitmix64(position) << 34) | ((2 * position + 1) & ((1 << 34) - 1))) & MASK
        total = (total + key * int.from_bytes(body[4 * i:4 * i + 4], "little")) & MASK
    return total


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)


def _word_at(value: int, position: int) -> int:
    return int(segment_digest_torch(_tensor(value.to_bytes(4, "little")), position)) & MASK


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
    assert 0xD8EE6D7800000002 == body_digest([_tensor(b"\x02" + bytes(15))])


def test_far_positions_match_the_reference():
    """Word positions past 2**32 (bodies over 16 GiB) hash as the formula says."""
    for position in (2**31 - 1, 2**32 + 5, 2**40 + 3):
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


def test_exchange_guarantee_holds_to_2_32_words_apart_and_ends_there():
    """The hardest exchange: words 0 and 2**31 (differences with the most trailing zeros)
    at distance 2**31 is still caught; at distance 2**32, the limit FORMAT.md states,
    the same exchange goes unseen."""
    high, zero = 0x80000000, 0
    for distance, caught in ((1, True), (2**31, True), (2**32, False)):
        before = _word_at(high, 7) + _word_at(zero, 7 + distance)
        after = _word_at(zero, 7) + _word_at(high, 7 + distance)
        assert caught == ((before - after) & MASK != 0), distance
