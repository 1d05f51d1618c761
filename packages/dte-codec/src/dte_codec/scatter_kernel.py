"""Gathers and scatters of every sparse entry of a payload in one Triton launch each.

Entry ``e`` of ``count[e]`` elements takes whole blocks of one block space from block
``first_block[e]`` on, so a program reads its entry from a block -> entry table
(``fields.block_segments``, built once per ``FlatEntries``: one load, no search, no
compile-time entry count); its element ``r`` is element ``indices[e][r]`` of the tensor
``targets[e]``.
``gather`` reads the targets into one byte buffer, entry by entry (an undo log, or the
base values residues resolve against); ``scatter`` writes per entry a tensor of values,
wherever each lives (resolved residues, raw sections of the body, an undo log). One
table of addresses reaches every tensor, so a payload costs one launch per direction,
not one per entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .dispatch import on_device
from .encodings import align
from .fields import block_segments, host_table
from .kernel_bits import column, load_uniform, owned_block, store_uniform

BLOCK = 1024
_INT64 = torch.int64
_FIRST_BLOCK = tl.constexpr(0)
_TARGET_AT = tl.constexpr(1)
_INDEX_AT = tl.constexpr(2)
_SIZE = tl.constexpr(3)
_COUNT = tl.constexpr(4)
_BLOCKS = 5  # host-only
_FLAT_AT = tl.constexpr(6)


@triton.jit(do_not_specialize=["segments"])
def _move(table, block_seg, segments, BLOCK: tl.constexpr, TO_FLAT: tl.constexpr):
    _, seg, rank = owned_block(table, block_seg, segments, _FIRST_BLOCK, BLOCK)
    valid = rank < column(table, _COUNT, segments, seg)
    size = column(table, _SIZE, segments, seg)
    index = tl.load(column(table, _INDEX_AT, segments, seg).to(tl.pointer_type(tl.int64)) + rank,
                    mask=valid, other=0)
    target = column(table, _TARGET_AT, segments, seg)
    at = column(table, _FLAT_AT, segments, seg)
    if TO_FLAT:
        store_uniform(at, rank, load_uniform(target, index, size, valid), size, valid)
    else:
        store_uniform(target, index, load_uniform(at, rank, size, valid), size, valid)


class FlatEntries:
    """The sparse entries ``(target, indices)`` of one device as one flat space; ``indices``
    are validated int64 flat indices into the contiguous ``target``."""

    def __init__(self, targets: Sequence[torch.Tensor], indices: Sequence[torch.Tensor]):
        self.targets, self.indices = list(targets), [i.contiguous() for i in indices]
        self.device = self.targets[0].device
        self.counts = [i.numel() for i in self.indices]
        blocks = [triton.cdiv(count, BLOCK) for count in self.counts]
        first_blocks = list(itertools.accumulate(blocks, initial=0))  # and their total last
        offsets = list(itertools.accumulate(
            (align(count * target.element_size())
             for count, target in zip(self.counts, self.targets)), initial=0))
        self.blocks, self.nbytes, self.offsets = first_blocks.pop(), offsets.pop(), offsets
        self.total = sum(self.counts)
        self._columns = [first_blocks, [t.data_ptr() for t in self.targets],
                         [i.data_ptr() for i in self.indices],
                         [t.element_size() for t in self.targets], self.counts, blocks]
        self._block_seg: torch.Tensor | None = None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per entry, its items of the byte buffer ``flat`` (``gather``'s layout) in its
        tensor's dtype."""
        return [flat[o:o + n * t.element_size()].view(t.dtype)
                for t, o, n in zip(self.targets, self.offsets, self.counts)]

    def gather(self) -> torch.Tensor:
        """The targets' current values at the indices, as one byte buffer, entry by entry
        from 8-byte boundaries."""
        flat = torch.empty(max(self.nbytes, 8), dtype=torch.uint8, device=self.device)
        self._launch([flat.data_ptr() + o for o in self.offsets], to_flat=True)
        return flat

    def scatter(self, values: Sequence[torch.Tensor]) -> None:
        """Write per entry ``values`` (contiguous, its tensor's dtype, on the device) at
        its indices."""
        self._launch([v.data_ptr() for v in values], to_flat=False)
        # written through addresses: tell autograd, as an in-place torch write would
        torch.autograd.graph.increment_version(self.targets)

    def _launch(self, addresses: list[int], *, to_flat: bool) -> None:
        if self.total:
            table = host_table(self._columns + [addresses], self.device)
            if self._block_seg is None:  # the gather and the scatter of a write share it
                self._block_seg = block_segments(table[_BLOCKS], self.blocks)
            with on_device(self.device):
                _move[(self.blocks,)](table, self._block_seg, len(self.counts), BLOCK=BLOCK,
                                      TO_FLAT=to_flat)
