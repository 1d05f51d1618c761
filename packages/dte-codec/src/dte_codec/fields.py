"""Bit fields of a payload body held as int64 words, over a flat space of segments.

The batched encoder and decoder treat every changed element of every entry as one flat
index space: element ``e`` belongs to segment ``seg[e]`` (one entry) and has ``rank[e]``
inside it. Per-segment numbers (section offsets, widths, encodings) travel to the device
as one table and are gathered per element, so every step is one torch op over all
elements, whatever the number of tensors, and nothing here reads a value back to the host.

A field is ``width`` (0..64) bits at bit position ``pos`` of the body's LSB-first bit
stream (bit ``p`` is bit ``p % 8`` of byte ``p // 8``, see ``bits.py``). On the
little-endian int64 view of the body that is bit ``p % 64`` of word ``p // 64``, so a
field lies in one word or straddles two. Writing adds each field's bits into its words:
fields never overlap, so every sum is a bitwise OR and never carries.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Sequence
from typing import TypeVar

import attrs
import numpy as np
import torch

from .bits import width_mask
from .dispatch import fused

WORD_BITS = 64
WORD_BYTES = 8
_INT64 = torch.int64
_Sizes = TypeVar("_Sizes", np.ndarray, torch.Tensor)

assert sys.byteorder == "little", "the int64 word view of a body assumes a little-endian host"


class Body:
    """A zeroed body of ``size`` bytes as int64 words on ``device``, written field by field
    for a flat space of ``elements`` elements (one spare word each)."""

    def __init__(self, size: int, elements: int, device: torch.device):
        self.words = size // WORD_BYTES
        self._buffer = torch.zeros(self.words + elements, dtype=_INT64, device=device)
        self._index = torch.arange(elements, device=device)

    def bytes(self) -> torch.Tensor:
        """The body as uint8 (a view)."""
        return self._buffer[:self.words].view(torch.uint8)

    def write(self, pos: torch.Tensor, value: torch.Tensor, width: torch.Tensor) -> None:
        """Add the low ``width`` bits of each element's ``value`` at its bit ``pos``.

        A field of width 0 adds nothing (it still needs a valid ``pos``). A 64-bit field
        must start on a word boundary.
        """
        shift = pos & (WORD_BITS - 1)
        word = pos >> 6
        field = value & width_mask(width)
        spare = self._index + self.words
        if self._buffer.is_cuda:
            self._add_runs(word, field << shift, spare)
        else:  # index_add_ on the CPU has no atomics to contend for
            self._buffer.index_add_(0, word, field << shift)
        straddles = shift + width > WORD_BITS
        high = torch.where(straddles, field >> (WORD_BITS - shift).clamp(max=WORD_BITS - 1), 0)
        self._buffer.index_add_(0, torch.where(straddles, word + 1, spare), high)

    def _add_runs(self, word: torch.Tensor, bits: torch.Tensor, spare: torch.Tensor) -> None:
        """``index_add_`` of ``bits`` at ``word``, with one atomic add per run of equal
        words (up to 64 narrow fields share a word). A run's sum is the prefix sum at its
        end minus the one before its start (wrapping int64 stays exact), and since the
        bits are disjoint it is their OR. Other elements add zero to their spare word."""
        starts = torch.ones_like(word, dtype=torch.bool)
        starts[1:] = word[1:] != word[:-1]
        ends = torch.roll(starts, -1)
        total = torch.cumsum(bits, 0)
        run = torch.cumsum(starts, 0) - 1
        # per run, the prefix sum before it, written by its first element (the others
        # write to a spare slot past the runs)
        before = torch.zeros(word.numel() + 1, dtype=_INT64, device=word.device)
        before.scatter_(0, torch.where(starts, run, word.numel()), total - bits)
        self._buffer.index_add_(0, torch.where(ends, word, spare),
                                torch.where(ends, total - before.index_select(0, run), 0))


def read_fields(words: torch.Tensor, pos: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The ``width``-bit unsigned fields at bit ``pos`` of ``words`` (64-bit fields as int64).

    Positions outside the body read clamped words instead of failing on the device:
    callers validate what they read, and untrusted bytes must never trip a device assert.
    """
    last = max(words.numel() - 1, 0)
    shift = pos & (WORD_BITS - 1)
    word = (pos >> 6).clamp(0, last)
    low = (words.index_select(0, word) >> shift) & width_mask(WORD_BITS - shift)
    upper = (words.index_select(0, (word + 1).clamp(max=last))
             << (WORD_BITS - shift).clamp(max=WORD_BITS - 1))
    return (low | torch.where(shift > 0, upper, 0)) & width_mask(width)


@attrs.frozen
class Segments:
    """A flat space of ``sum(counts)`` elements cut into consecutive segments."""

    counts: tuple[int, ...]
    starts: tuple[int, ...]
    seg: torch.Tensor
    """Per element, its segment."""
    rank: torch.Tensor
    """Per element, its position inside its segment."""
    start: torch.Tensor
    """Per element, the flat position of its segment's first element."""
    bounds: torch.Tensor
    """Per segment, its first and its past-the-end flat positions (two rows)."""

    @property
    def total(self) -> int:
        return sum(self.counts)

    @classmethod
    def of(cls, counts: list[int], device: torch.device) -> Segments:
        starts = exclusive(counts)
        total = sum(counts)
        # Segment ids by a prefix sum of start marks (several at one position when
        # segments are empty): cheaper than repeat_interleave on the CPU, and sync-free.
        inner = [start for start in starts[1:] if start < total]
        marks = torch.zeros(total, dtype=_INT64, device=device)
        if inner:
            at = host_table([inner], device)[0]
            marks.index_add_(0, at, torch.ones_like(at))
        seg = torch.cumsum(marks, 0)
        bounds = host_table([starts, [a + n for a, n in zip(starts, counts)]], device)
        start = bounds[0].index_select(0, seg)
        rank = torch.arange(total, device=device) - start
        return cls(tuple(counts), tuple(starts), seg, rank, start, bounds)

    def spread(self, per_segment: torch.Tensor) -> torch.Tensor:
        """Per element, its segment's value of ``per_segment``."""
        return per_segment.index_select(0, self.seg)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per segment, the sum of ``values`` (int64) over its elements.

        A difference of prefix sums: an ``index_add_`` per element would have every
        element of a segment contend for one atomic add on a GPU.
        """
        total = torch.cumsum(values, 0, dtype=_INT64)
        last, before = self.bounds[1] - 1, self.bounds[0] - 1  # -1: nothing before
        at_last = total.index_select(0, last.clamp(min=0)) * (last >= 0)
        return at_last - total.index_select(0, before.clamp(min=0)) * (before >= 0)

    def histogram(self, values: torch.Tensor, bins: int) -> torch.Tensor:
        """Per segment (rows) the count of each value in ``0..bins-1`` (columns); other
        values are not counted."""
        if values.is_cuda:  # one prefix sum per bin rather than contended atomic adds
            return torch.stack([self.sums(values == b) for b in range(bins)], 1)
        column = torch.where((values >= 0) & (values < bins), values, bins)  # others: dropped
        out = torch.zeros(len(self.counts) * (bins + 1), dtype=_INT64, device=values.device)
        out.index_add_(0, self.seg * (bins + 1) + column, torch.ones_like(column))
        return out.view(-1, bins + 1)[:, :bins]

    def exclusive_ranks(self, mask: torch.Tensor) -> torch.Tensor:
        """Per element, how many elements before it in its segment have ``mask`` set."""
        inclusive = torch.cumsum(mask, 0, dtype=_INT64)
        before = inclusive - mask.to(_INT64)
        return before - before.index_select(0, self.start)

    def previous(self, values: torch.Tensor, first: int | torch.Tensor) -> torch.Tensor:
        """Per element, ``values`` of the element before it in its segment (``first`` for
        a segment's first element)."""
        shifted = torch.roll(values, 1)
        return torch.where(self.rank == 0, first, shifted)


def batched(device: torch.device) -> bool:
    """Whether work on ``device`` goes through the flat (batched) paths.

    They pay where each torch op costs a kernel launch and each value read a host
    synchronization: on a GPU. On the CPU an op is a plain loop, and the per-tensor paths,
    which touch fewer and narrower temporaries, measured faster (1 thread, 6.4e5 changed
    elements: encode 274 vs 357 ms, decode 29 vs 150 ms), so CPU tensors keep them. Both
    give the same bytes and values (``tests/test_flat.py``).
    """
    return device.type != "cpu"


def host_table(columns: list[list[int]] | np.ndarray, device: torch.device) -> torch.Tensor:
    """Per-segment int64 columns (lists, or rows of an array) as one
    ``(len(columns), segments)`` tensor on ``device``.

    One host-to-device copy; on CUDA from the calling thread's pinned buffer
    (``PinnedStage``), so it neither waits for the GPU nor pins memory per table.
    """
    return host_tables([columns], device)[0]


def host_tables(tables: Sequence[list[list[int]] | np.ndarray], device: torch.device
                ) -> tuple[torch.Tensor, ...]:
    """``host_table`` of each of ``tables`` from one host-to-device copy: each a
    row-major view starting on a 16-byte boundary, where Triton specializes the pointers
    it is given."""
    arrays = [np.ascontiguousarray(t, dtype=np.int64) for t in tables]
    padded = [a.size + a.size % 2 for a in arrays]  # int64 pairs: 16 bytes
    starts = exclusive(padded)
    if device.type == "cuda":
        flat = _stage(device).copy(arrays, starts, sum(padded))
    else:
        host = _gathered(np.zeros(sum(padded), dtype=np.int64), arrays, starts)
        flat = torch.from_numpy(host).to(device)
    return tuple(flat[at:at + a.size].view(a.shape) for a, at in zip(arrays, starts))


def _gathered(host: np.ndarray, arrays: list[np.ndarray], starts: list[int]) -> np.ndarray:
    """``arrays`` written into ``host`` at ``starts`` (words)."""
    for a, at in zip(arrays, starts):
        host[at:at + a.size] = a.ravel()
    return host


def starts_of(sizes: _Sizes) -> _Sizes:
    """Where each of consecutive runs of ``sizes`` (1-d) starts: the exclusive prefix sums,
    of the same kind as ``sizes`` (a numpy array on the host, a tensor on its device,
    with no host synchronization)."""
    return sizes.cumsum(0) - sizes


def exclusive(sizes: list[int]) -> list[int]:
    """Where each of consecutive runs of ``sizes`` starts: ``starts_of`` for a list of
    Python ints."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


def block_segments(blocks: torch.Tensor, total: int) -> torch.Tensor:
    """Per kernel block, the segment that owns it, when segment ``s`` takes ``blocks[s]``
    whole blocks in order (``total`` of them): a program reads its segment with one load
    instead of searching, and no kernel needs the segment count as a compile-time
    constant. One kernel launch where the flat kernels run (``block_kernel``), else
    ``repeat_interleave`` (the reference); no host synchronization either way. One
    segment (a delta's body digest, a one-tensor delta) owns every block: a fill."""
    if blocks.numel() == 1:
        return torch.zeros(total, dtype=torch.int32, device=blocks.device)
    if fused(blocks.device):
        from .block_kernel import block_owners
        return block_owners(blocks, total)
    owners = torch.arange(blocks.numel(), dtype=torch.int32, device=blocks.device)
    return torch.repeat_interleave(owners, blocks, output_size=total)


STAGE_WORDS = 1 << 17
"""int64 words of a device's reusable pinned buffer for small tables (1 MiB)."""


class PinnedStage:
    """Small int64 tables copied to one CUDA device through one pinned host buffer
    allocated once, rather than memory pinned per copy.

    Copies take the buffer's words back to back as a ring, each from a 16-byte boundary.
    Each copy is followed by an event on its stream; before words of the buffer are
    written again, the copies of the last lap that read them must have completed, and
    only those are waited for (the oldest ones, a lap ago: long done, whatever the GPU
    has queued since). Tables larger than the buffer are pinned on their own.
    """

    def __init__(self, device: torch.device, words: int = STAGE_WORDS):
        self.device = device
        self._host = torch.empty(words, dtype=_INT64, pin_memory=True)
        self._array = self._host.numpy()
        self._at = 0
        self._reads: collections.deque[tuple[int, int, torch.cuda.Event]] = collections.deque()
        """Copies that may still be reading the buffer, oldest first: their first word,
        their lap and an event after them."""
        self._lap = 0
        self._spare: list[torch.cuda.Event] = []
        """Events of copies waited for, to record again."""

    def copy(self, arrays: list[np.ndarray], starts: list[int], words: int) -> torch.Tensor:
        """``arrays`` at word offsets ``starts`` of a ``words``-word tensor on the device
        (one copy; the words between them unspecified)."""
        if words > len(self._array):  # gathered straight into memory pinned for it
            host = torch.empty(words, dtype=_INT64, pin_memory=True)
            _gathered(host.numpy(), arrays, starts)
            return host.to(self.device, non_blocking=True)
        reads = self._reads
        if self._at + words > len(self._array):
            while reads and reads[0][1] < self._lap:  # the tail of the lap before: a lap old
                self._wait()
            self._at, self._lap = 0, self._lap + 1
        at, self._at = self._at, self._at + words  # words is even: the next stays aligned
        # the last lap's copies left lie from here on in order: wait for those this one
        # overwrites
        while reads and reads[0][1] < self._lap and reads[0][0] < self._at:
            self._wait()
        _gathered(self._array[at:self._at], arrays, starts)
        stream = torch.cuda.current_stream(self.device)
        flat = self._host[at:self._at].to(self.device, non_blocking=True)
        read = self._spare.pop() if self._spare else torch.cuda.Event()
        read.record(stream)
        reads.append((at, self._lap, read))
        return flat

    def _wait(self) -> None:
        """Wait for the oldest copy that may still read the buffer."""
        read = self._reads.popleft()[2]
        read.synchronize()
        self._spare.append(read)


_stages = threading.local()


def _stage(device: torch.device) -> PinnedStage:
    """The calling thread's stage for CUDA ``device``."""
    stages = _stages.__dict__
    key = device.index if device.index is not None else torch.cuda.current_device()
    stage = stages.get(key)
    if stage is None:
        stage = stages[key] = PinnedStage(torch.device("cuda", key))
    return stage
