"""The body digest: a keyed multilinear hash computed where the body lives.

The body is read as little-endian u32 words ``u_i`` (``i`` counts 4-byte words from the
body's start) and hashed as ``sum(k_i * u_i) mod 2**64`` with one odd 32-bit key per
position, so that each term is a single 32 x 32 -> 64-bit product::

    k_i = 2 * mix31((i + 0x4F1BBCDD) mod 2**31) + 1

where ``mix31`` is a bijection of 31-bit integers (xor-shifts and odd multipliers).

Each word is read once and the sum is order-free, so the digest of a body held in
several segments is the sum of each segment's words at their body positions: a frame is
hashed on its device without concatenating. ``body_digest`` lays the segments out as a
table of word runs (``Run``; a word cut between segments is put together from their
bytes), kept for later digests of the same segments (``BodyRuns``); on a GPU one Triton
launch hashes every run (``body_digest_kernel``), elsewhere
(and under ``dispatch.reference()``) this module's torch version does, the reference the
kernel matches bit for bit. What the
hash detects for certain is stated (and proved) in ``FORMAT.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

from .dispatch import fused, on_device

WORD_BYTES = 4
"""The hash reads the body as u32 words."""
KEY_PERIOD_BITS = 31
"""Keys repeat every 2**31 words: ``2 * mix31 + 1`` takes each odd 32-bit value once per
period, which is what makes every exchange of two words under 2**31 apart visible."""
CHUNK_WORDS = 1 << 22
"""Words hashed per torch step: bounds the int64 temporaries to 32 MiB each."""
U64 = (1 << 64) - 1
MIX_OFFSET = 0x4F1BBCDD
"""Added to the position before mixing, so that no key is pinned to 1 at word 0."""
MIX_SHIFTS = (16, 15, 16)
MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
"""``mix31``: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16
(mod 2**31 throughout; odd multipliers and right xor-shifts are bijective)."""
_PERIOD_MASK = (1 << KEY_PERIOD_BITS) - 1
_INT64 = torch.int64


@attrs.frozen
class Run:
    """Whole words of the body held contiguously in one tensor: ``words`` 4-byte aligned
    u32 words (an int32 view) at body word position ``first_word``."""

    words: torch.Tensor
    first_word: int
    copied: bool = False
    """``words`` is a copy of the body's bytes (put together across segments, zero-filled
    or realigned), not a view: it holds the bytes as they were when the run was made."""


def body_digest(segments: Iterable[torch.Tensor]) -> int:
    """The u64 digest of the body made of ``segments`` (1-D uint8, one device), in order.

    One device pass over all segments (a single kernel launch on a GPU) and one host
    synchronization. A word that straddles two segments is put together from their
    bytes; a segment at an address that is not 4-byte aligned is copied once.
    """
    return int(queued_digest(segments)) & U64


def queued_digest(segments: Iterable[torch.Tensor]) -> torch.Tensor:
    """``body_digest`` as a 0-d int64 tensor where the body lives (its two's complement),
    queued and not read: no host synchronization, so work that does not depend on it can
    be queued behind it (a CPU zero for an empty body)."""
    return BodyRuns.of(tuple(segments)).queued()


class BodyRuns:
    """A body's word runs, ready to be hashed, again and again when they are views: a
    frame whose segments stay the same tensors (a full payload's views of the weights)
    is hashed on every sync from the same table, on a GPU already on the device."""

    _last: tuple[tuple, BodyRuns] | None = None
    """The runs of the last body of several segments, all views, with its segments' places:
    a receiver handed the same full frame's segments every sync lays them out once."""

    def __init__(self, segments: Iterable[torch.Tensor]):
        self.runs = word_runs(segments)
        self.views = not any(run.copied for run in self.runs)
        """Every run reads the segments themselves: a later digest sees their bytes then."""
        self._table = None
        """The kernel's run table (``body_digest_kernel.RunTable``), made on first use."""

    @classmethod
    def of(cls, segments: tuple[torch.Tensor, ...]) -> BodyRuns:
        """The runs of ``segments``, the kept ones when the last body of several segments
        sat at the same places (its views hold their memory, so the same places are the
        same memory). One body is kept: a batched delta's single segment is never kept
        (it is new every sync); a per-tensor delta's sections are, until the next body."""
        if len(segments) < 2:
            return cls(segments)
        places = tuple((s.data_ptr(), s.numel(), s.device) for s in segments)
        last = cls._last
        if last is not None and last[0] == places:
            return last[1]
        runs = cls(segments)
        if runs.views:
            cls._last = (places, runs)
        return runs

    def digest(self) -> int:
        """The digest of the runs' bytes now (one host synchronization)."""
        return int(self.queued()) & U64

    def queued(self) -> torch.Tensor:
        """The digest of the runs' bytes as a 0-d int64 tensor, queued, not read."""
        if not self.runs:
            return torch.zeros((), dtype=_INT64)
        device = self.runs[0].words.device
        if not fused(device):
            return runs_digest_torch(self.runs)
        if self._table is None:
            from .body_digest_kernel import RunTable  # Triton only where it runs
            self._table = RunTable(self.runs)
        with on_device(device):
            return self._table.digest()


def word_runs(segments: Iterable[torch.Tensor]) -> list[Run]:
    """The body's words as runs, in body order; a final partial word is zero-filled."""
    runs: list[Run] = []
    partial: list[torch.Tensor] = []
    """Bytes of the word under way when a segment ended inside it."""
    offset = 0
    for segment in segments:
        size = segment.numel()
        missing = -offset % WORD_BYTES
        if missing and size:
            partial.append(segment[:missing])
            taken = min(missing, size)
            segment, offset, size = segment[taken:], offset + taken, size - taken
            if offset % WORD_BYTES == 0:
                runs.append(Run(as_words(torch.cat(partial)), offset // WORD_BYTES - 1, True))
                partial = []
        whole = size // WORD_BYTES * WORD_BYTES
        if whole:
            words = segment if whole == size else segment[:whole]
            runs.append(Run(as_words(words), offset // WORD_BYTES, not _whole_words(words)))
        if size > whole:
            partial.append(segment[whole:])
        offset += size
    if partial:
        runs.append(Run(as_words(torch.cat(partial)), offset // WORD_BYTES, True))
    return runs


def runs_digest_torch(runs: Sequence[Run]) -> torch.Tensor:
    """A 0-d int64 tensor: the digest of ``runs`` in torch ops (wrapping int64 arithmetic)."""
    return torch.stack([words_digest_torch(r.words, r.first_word) for r in runs]).sum()


def words_digest_torch(words: torch.Tensor, first_word: int) -> torch.Tensor:
    """A 0-d int64 tensor: the hash terms of the int32 ``words`` placed at body word
    ``first_word``, chunk by chunk."""
    total = torch.zeros((), dtype=_INT64, device=words.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start:start + CHUNK_WORDS].to(_INT64) & 0xFFFFFFFF
        position = torch.arange(first_word + start, first_word + start + chunk.numel(),
                                dtype=_INT64, device=words.device)
        total += (chunk * keys(position)).sum()
    return total


def as_words(segment: torch.Tensor) -> torch.Tensor:
    """``segment`` (uint8) as int32 words, the last one zero-filled if partial (a view
    when the segment is whole words at a 4-byte aligned address, else one copy)."""
    if not _whole_words(segment):
        padded = torch.zeros(-(-segment.numel() // WORD_BYTES) * WORD_BYTES,
                             dtype=torch.uint8, device=segment.device)
        padded[:segment.numel()] = segment
        segment = padded
    return segment.view(torch.int32)


def _whole_words(segment: torch.Tensor) -> bool:
    return segment.numel() % WORD_BYTES == 0 and segment.data_ptr() % WORD_BYTES == 0


def keys(position: torch.Tensor) -> torch.Tensor:
    """The odd 32-bit key of each int64 word position (as int64)."""
    return 2 * mix31((position + MIX_OFFSET) & _PERIOD_MASK) + 1


def mix31(x: torch.Tensor) -> torch.Tensor:
    """The bijection ``mix31`` of int64 values in ``[0, 2**31)`` (products stay < 2**63)."""
    first, second, third = MIX_SHIFTS
    x = x ^ (x >> first)
    x = (x * MIX_MULTIPLIERS[0]) & _PERIOD_MASK
    x = x ^ (x >> second)
    x = (x * MIX_MULTIPLIERS[1]) & _PERIOD_MASK
    return x ^ (x >> third)
