"""The body digest: a keyed multilinear hash computed where the body lives.

The body is read as little-endian u32 words ``u_i`` (``i`` counts 4-byte words from the
body's start) and hashed as ``sum(k_i * u_i) mod 2**64`` with one odd key per position::

    k_i = (splitmix64(i) << 34) | ((2 * i + 1) mod 2**34)

Each word is read once and the sum is order-free, so the digest of a body held in
several segments is the sum of each segment's digest at its own word offset: a frame is
hashed segment by segment, on its device, without concatenating. What the hash detects
for certain is stated (and proved) in ``FORMAT.md``. On a GPU one Triton kernel
(``body_digest_kernel``) hashes each segment in one pass; this module's torch version is
the reference it matches and the CPU path.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

WORD_BYTES = 4
"""The hash reads the body as u32 words."""
LOW_KEY_BITS = 34
"""The low bits of a key are ``2 * i + 1``: keys of positions under 2**32 apart differ
there, which is what makes every exchange of two words visible (``FORMAT.md``)."""
CHUNK_WORDS = 1 << 22
"""Words hashed per torch step: bounds the int64 temporaries to 32 MiB each."""
U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_INT64 = torch.int64


def signed(value: int) -> int:
    """The int64 with the bits of the u64 ``value`` (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def body_digest(segments: Iterable[torch.Tensor]) -> int:
    """The u64 digest of the body made of ``segments`` (1-D uint8, one device), in order.

    One device pass per segment and one host synchronization in all. A word that
    straddles two segments is put together from their bytes (a few bytes, on the device).
    """
    terms: list[torch.Tensor] = []
    partial: list[torch.Tensor] = []
    """Bytes of the word under way when a segment ended inside it."""
    offset = 0
    for segment in segments:
        missing = -offset % WORD_BYTES
        if missing and segment.numel():
            partial.append(segment[:missing])
            segment, offset = segment[missing:], offset + min(missing, segment.numel())
            if offset % WORD_BYTES == 0:
                terms.append(segment_digest(torch.cat(partial), offset // WORD_BYTES - 1))
                partial = []
        whole = segment.numel() // WORD_BYTES * WORD_BYTES
        if whole:
            terms.append(segment_digest(segment[:whole], offset // WORD_BYTES))
        if segment.numel() > whole:
            partial.append(segment[whole:])
        offset += segment.numel()
    if partial:
        terms.append(segment_digest(torch.cat(partial), offset // WORD_BYTES))
    return int(torch.stack(terms).sum()) & U64 if terms else 0


def segment_digest(segment: torch.Tensor, first_word: int) -> torch.Tensor:
    """A 0-d int64 tensor: the hash terms of ``segment`` placed at word ``first_word``.

    A segment starts on a word boundary; its last word, if partial, is read with zero
    bytes after it (the body pads every section with zeros).
    """
    if segment.is_cuda:
        from .body_digest_kernel import segment_digest_cuda  # Triton only where it runs
        return segment_digest_cuda(segment, first_word)
    return segment_digest_torch(segment, first_word)


def segment_digest_torch(segment: torch.Tensor, first_word: int) -> torch.Tensor:
    """``segment_digest`` in torch ops (wrapping int64 arithmetic), chunk by chunk."""
    words = as_words(segment)
    total = torch.zeros((), dtype=_INT64, device=segment.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start:start + CHUNK_WORDS].to(_INT64) & 0xFFFFFFFF
        position = torch.arange(first_word + start, first_word + start + chunk.numel(),
                                dtype=_INT64, device=segment.device)
        total += (chunk * keys(position)).sum()
    return total


def as_words(segment: torch.Tensor) -> torch.Tensor:
    """``segment`` as int32 words, the last one zero-filled if partial (a view when the
    segment is whole words at a 4-byte aligned address, else one copy)."""
    whole = segment.numel() % WORD_BYTES == 0 and segment.data_ptr() % WORD_BYTES == 0
    if not whole:
        padded = torch.zeros(-(-segment.numel() // WORD_BYTES) * WORD_BYTES,
                             dtype=torch.uint8, device=segment.device)
        padded[:segment.numel()] = segment
        segment = padded
    return segment.view(torch.int32)


def keys(position: torch.Tensor) -> torch.Tensor:
    """The odd key of each int64 word position."""
    low = (2 * position + 1) & ((1 << LOW_KEY_BITS) - 1)
    return (splitmix64(position) << LOW_KEY_BITS) | low


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """Steele, Lea and Flood's SplitMix64 finalizer of ``x + golden``, on int64 bits."""
    z = x + signed(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * signed(_MIX2)
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)
