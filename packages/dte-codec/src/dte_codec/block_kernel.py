"""The block -> segment table of the flat kernels (``fields.block_segments``) as one
Triton launch, where ``torch.repeat_interleave`` takes five device ops (an arange, a
two-kernel prefix sum, the index computation and a gather), each a launch gap on the
GPU's timeline.

One program per segment adds up the blocks of the segments before it (a few loads for
the few hundred segments of a model, tiles of ``TILE`` for more) and writes its own id
over its run of blocks. The segment count is the grid's size and the blocks' address is
not specialized on its alignment (they are a row of a larger table), so no tensor count
compiles a new variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import on_device

TILE = 1024


@triton.jit(do_not_specialize_on_alignment=["blocks"])
def _owners(blocks, owners, TILE: tl.constexpr):
    seg = tl.program_id(0)
    lanes = tl.arange(0, TILE)
    start = seg.to(tl.int64) * 0  # a scalar that the loop adds to
    for at in range(0, seg, TILE):
        start += tl.sum(tl.load(blocks + at + lanes, mask=at + lanes < seg, other=0)
                        .to(tl.int64))
    count = tl.load(blocks + seg).to(tl.int64)
    for at in range(0, count, TILE):
        tl.store(owners + start + at + lanes, seg, mask=at + lanes < count)


def block_owners(blocks: torch.Tensor, total: int, *, tile: int = TILE) -> torch.Tensor:
    """``fields.block_segments`` in one launch (int32, no host synchronization);
    ``tile``: segments summed and blocks written per step."""
    owners = torch.empty(total, dtype=torch.int32, device=blocks.device)
    segments = blocks.numel()
    if total and segments:
        with on_device(blocks.device):
            _owners[(segments,)](blocks.contiguous(), owners, TILE=tile)
    return owners
