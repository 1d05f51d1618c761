"""``body_digest`` on a GPU: one Triton launch over a table of word runs.

Every run (a segment's whole words, or a word put together across segments) is cut into
chunks of ``CHUNK`` words; each program hashes one chunk (keys computed in registers, one
32 x 32 -> 64-bit product per word) and writes its partial sum, and torch adds the
partials. The runs are read through their addresses, so the segments stay where they
are (views of the weights) and a frame of any number of segments costs one launch.
Integer arithmetic wraps modulo 2**64 exactly as in the torch reference, so both give
the same digest (``tools/gpu/check_body_digest.py`` compares them on the device).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .body_digest import KEY_PERIOD_BITS, MIX_MULTIPLIERS, MIX_OFFSET, MIX_SHIFTS, Run
from .fields import block_segments, host_table

TILE = 2048
"""Words per vector step of a program."""
TILES = 8
"""Vector steps per program: a program reads ``TILE * TILES`` words (64 KiB)."""
CHUNK = TILE * TILES
WARPS = 4


@triton.jit(do_not_specialize=["n_runs"])  # a frame's run count is no compile-time fact
def _digest(table_ptr, run_of_ptr, n_runs, partial_ptr, MASK: tl.constexpr, OFFSET: tl.constexpr,
            SHIFT0: tl.constexpr, SHIFT1: tl.constexpr, SHIFT2: tl.constexpr,
            MUL0: tl.constexpr, MUL1: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr):
    program = tl.program_id(0)
    run = tl.load(run_of_ptr + program)
    words_ptr = tl.load(table_ptr + run).to(tl.pointer_type(tl.uint32))
    first_word = tl.load(table_ptr + n_runs + run)
    n_words = tl.load(table_ptr + 2 * n_runs + run)
    start = (program - tl.load(table_ptr + 3 * n_runs + run)).to(tl.int64) * (TILE * TILES)
    acc = tl.zeros([TILE], dtype=tl.uint64)
    for step in tl.static_range(TILES):
        offsets = start + step * TILE + tl.arange(0, TILE)
        inside = offsets < n_words
        u = tl.load(words_ptr + offsets, mask=inside, other=0, eviction_policy="evict_first")
        x = ((first_word + offsets + OFFSET) & MASK).to(tl.uint32)  # 32-bit mixing: cheap on a GPU
        x = x ^ (x >> SHIFT0)
        x = (x * MUL0) & MASK
        x = x ^ (x >> SHIFT1)
        x = (x * MUL1) & MASK
        x = x ^ (x >> SHIFT2)
        key = (2 * x + 1).to(tl.uint32).to(tl.uint64)
        acc += key * u.to(tl.uint64)
    tl.store(partial_ptr + program, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def runs_digest_triton(runs: Sequence[Run]) -> torch.Tensor:
    """``body_digest.runs_digest_torch`` on a GPU (a 0-d int64 tensor), one launch."""
    return RunTable(runs).digest()


class RunTable:
    """The runs as the kernel reads them, on the device: addresses, first words, sizes,
    and per program its run. Built once, it hashes the runs' current bytes with one
    launch and no host-to-device copy (the runs' tensors must stay alive)."""

    def __init__(self, runs: Sequence[Run]):
        self.device = runs[0].words.device
        programs = [-(-r.words.numel() // CHUNK) for r in runs]
        firsts = list(itertools.accumulate(programs, initial=0))
        self.programs = firsts.pop()
        self.runs = len(runs)
        # columns: address, first word, words, first program, programs (one copy)
        self.table = host_table([[r.words.data_ptr() for r in runs], [r.first_word for r in runs],
                                 [r.words.numel() for r in runs], firsts, programs],
                                self.device).reshape(-1)
        self.run_of = block_segments(self.table[4 * len(runs):], self.programs)

    def digest(self) -> torch.Tensor:
        """A 0-d int64 tensor: the digest of the runs' bytes now."""
        partial = torch.empty(self.programs, dtype=torch.int64, device=self.device)
        _digest[(self.programs,)](self.table, self.run_of, self.runs, partial,
                                  MASK=(1 << KEY_PERIOD_BITS) - 1, OFFSET=MIX_OFFSET,
                                  SHIFT0=MIX_SHIFTS[0], SHIFT1=MIX_SHIFTS[1],
                                  SHIFT2=MIX_SHIFTS[2], MUL0=MIX_MULTIPLIERS[0],
                                  MUL1=MIX_MULTIPLIERS[1], TILE=TILE, TILES=TILES,
                                  num_warps=WARPS)
        return partial.sum()
