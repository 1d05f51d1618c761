"""Gathers and scatters of every sparse entry of a payload in one Triton launch each.

Entry ``e`` of ``count[e]`` elements owns the flat positions ``start[e] ..`` of one flat
space; its element ``r`` is element ``indices[e][r]`` of the tensor ``targets[e]``.
``gather`` reads the targets into one byte buffer, entry by entry (an undo log, or the
base values residues resolve against); ``scatter`` writes per entry a tensor of values,
wherever each lives (resolved residues, raw sections of the body, an undo log). One
table of addresses reaches every tensor, so a payload costs one launch per direction,
not one per entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .dispatch import on_device
from .fields import host_table
from .kernel_bits import block_positions, column, load_int, segment_of, store_int

BLOCK = 1024
_INT64 = torch.int64
_START = tl.constexpr(0)
_TARGET_AT = tl.constexpr(1)
_INDEX_AT = tl.constexpr(2)
_SIZE = tl.constexpr(3)
_FLAT_AT = tl.constexpr(4)


@triton.jit(do_not_specialize=["segments", "total"])
def _move(table, segments, total, LOG: tl.constexpr, BLOCK: tl.constexpr,
          TO_FLAT: tl.constexpr):
    _, k, valid = block_positions(total, BLOCK)
    seg = segment_of(table, segments, k, LOG)
    rank = k - column(table, _START, segments, seg)
    size = column(table, _SIZE, segments, seg)
    index = tl.load(column(table, _INDEX_AT, segments, seg).to(tl.pointer_type(tl.int64)) + rank,
                    mask=valid, other=0)
    target = column(table, _TARGET_AT, segments, seg)
    at = column(table, _FLAT_AT, segments, seg)
    if TO_FLAT:
        store_int(at, rank, load_int(target, index, size, valid), size, valid)
    else:
        store_int(target, index, load_int(at, rank, size, valid), size, valid)


class FlatEntries:
    """The sparse entries ``(target, indices)`` of one device as one flat space; ``indices``
    are validated int64 flat indices into the contiguous ``target``."""

    def __init__(self, targets: Sequence[torch.Tensor], indices: Sequence[torch.Tensor]):
        self.targets, self.indices = list(targets), [i.contiguous() for i in indices]
        self.device = self.targets[0].device
        self.counts = [i.numel() for i in self.indices]
        starts, offsets, at, nbytes = [], [], 0, 0
        for count, target in zip(self.counts, self.targets):
            starts.append(at)
            offsets.append(nbytes)
            at += count
            nbytes += -(-count * target.element_size() // 8) * 8
        self.offsets, self.total, self.nbytes = offsets, at, nbytes
        self.log = max(len(self.counts) - 1, 0).bit_length()
        self._columns = [starts, [t.data_ptr() for t in self.targets],
                         [i.data_ptr() for i in self.indices],
                         [t.element_size() for t in self.targets]]

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
            with on_device(self.device):
                _move[(triton.cdiv(self.total, BLOCK),)](
                    table, len(self.counts), self.total, LOG=self.log, BLOCK=BLOCK,
                    TO_FLAT=to_flat)
