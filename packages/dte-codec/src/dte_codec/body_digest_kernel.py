"""``body_digest.segment_digest`` on a GPU: one Triton pass over a segment's words.

Each program hashes one block of words (keys computed in registers, no key tensor in
memory) and writes its partial sum; torch adds the partials. Integer arithmetic wraps
modulo 2**64 exactly as in the torch reference, so both give the same digest
(``tools/gpu/check_body_digest.py`` compares them on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .body_digest import _GOLDEN, _MIX1, _MIX2, LOW_KEY_BITS, as_words

BLOCK = 8192
"""Words per program: 32 KiB read per program, one int64 partial written."""
WARPS = 8


@triton.jit(do_not_specialize=["n_words", "first_word"])
def _digest(words_ptr, n_words, first_word, partial_ptr, GOLDEN: tl.constexpr,
            MIX1: tl.constexpr, MIX2: tl.constexpr, LOW_BITS: tl.constexpr,
            BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n_words
    words = tl.load(words_ptr + offsets, mask=inside, other=0, eviction_policy="evict_first")
    u = words.to(tl.uint32, bitcast=True).to(tl.uint64)
    position = (offsets + first_word).to(tl.uint64)
    z = position + GOLDEN
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    z = z ^ (z >> 31)
    low = (2 * position + 1) & ((1 << LOW_BITS) - 1)
    key = (z << LOW_BITS) | low
    tl.store(partial_ptr + tl.program_id(0), tl.sum(key * u, axis=0).to(tl.int64, bitcast=True))


def segment_digest_cuda(segment: torch.Tensor, first_word: int) -> torch.Tensor:
    """``body_digest.segment_digest`` of a segment on a GPU (a 0-d int64 tensor)."""
    words = as_words(segment)
    programs = triton.cdiv(words.numel(), BLOCK)
    partial = torch.empty(programs, dtype=torch.int64, device=segment.device)
    _digest[(programs,)](words, words.numel(), first_word, partial, GOLDEN=tl.constexpr(_GOLDEN),
                         MIX1=tl.constexpr(_MIX1), MIX2=tl.constexpr(_MIX2),
                         LOW_BITS=LOW_KEY_BITS, BLOCK=BLOCK, num_warps=WARPS)
    return partial.sum()
