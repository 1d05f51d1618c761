"""``CastDetector.record`` and the master -> model copy fused into one Triton kernel.

One pass reads the fp32 master, the 16-bit model and the packed dirty bits, tile by tile
(``staging.py``), and writes the dirty bits OR the flips, the first-seen (index, old
value) pairs and, when copying, ``cast(master)`` into the model: the same bits as
``record`` followed by ``model.copy_(master)`` (the cast is the hardware's
round-to-nearest-even ``cvt.rn`` that torch's CUDA copy uses too; a flip is a bit
difference or NaN over NaN).

A tile stages its first-seen pairs in its slab of ``1 / SLAB_FRACTION`` of its elements
and ``staging.gather`` moves them into sorted outputs. A tile with more first-seen pairs
than that writes nothing, not even the model, and the caller then runs the torch
reference over the whole tensor: the tiles done already find no fresh flip there (their
bits are set) and are copied to the same values again, so only the dense tiles add
pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .staging import gather, programs, stage, tile_offsets

ROWS = 128
"""Bytes of dirty bits per tile of ``ROWS * 8`` elements."""
WARPS = 4
WAVES = 16
"""Programs per multiprocessor (``staging.programs``)."""
SLAB_FRACTION = 4
"""A tile stages at most a quarter of its elements as first seen (1 byte of scratch per
element, reused across tensors); a denser tile sends the tensor to the torch reference."""
_NAN_ABOVE = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_PAYLOAD = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _load(master_ptr, model_ptr, tile, numel, ROWS: tl.constexpr):
    offsets, _, _ = tile_offsets(tile, ROWS)
    inside = offsets < numel
    return (tl.load(master_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first"),
            tl.load(model_ptr + offsets, mask=inside, other=0))


@triton.jit(do_not_specialize=["tiles"])
def _record(master_ptr, model_ptr, dirty_ptr, counts_ptr, slab_ptr, numel, dirty_bytes, tiles,
            PAYLOAD: tl.constexpr, NAN_ABOVE: tl.constexpr, COPY: tl.constexpr,
            ROWS: tl.constexpr, SLAB: tl.constexpr):
    first, step = tl.program_id(0), tl.num_programs(0)
    master, old = _load(master_ptr, model_ptr, first, numel, ROWS)
    for tile in range(first, tiles, step):
        master_next, old_next = _load(master_ptr, model_ptr, tile + step, numel, ROWS)
        offsets, columns, local = tile_offsets(tile, ROWS)
        inside = offsets < numel
        old = old.to(tl.int32) & 0xFFFF
        cast = master.to(PAYLOAD).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        both_nan = ((cast & 0x7FFF) > NAN_ABOVE) & ((old & 0x7FFF) > NAN_ABOVE)
        flips = (((cast != old) | both_nan) & inside).to(tl.int32)
        bytes_at = tl.cast(tile, tl.int64) * ROWS + tl.arange(0, ROWS)
        in_map = bytes_at < dirty_bytes
        before = tl.load(dirty_ptr + bytes_at, mask=in_map, other=0).to(tl.int32)
        fresh = flips & (1 - ((before[:, None] >> columns) & 1))
        count = tl.sum(tl.sum(fresh, axis=1), axis=0)
        tl.store(counts_ptr + tile, count)
        if count <= SLAB:
            stage(slab_ptr, tile, fresh, local, old, old, SLAB)
            tl.store(dirty_ptr + bytes_at,
                     (before | tl.sum(flips << columns, axis=1)).to(tl.uint8), mask=in_map)
            if COPY:
                tl.store(model_ptr + offsets, cast.to(tl.int16), mask=inside)
        master, old = master_next, old_next


class Scratch:
    """The slabs of one device, kept between calls and grown to the largest tensor."""

    def __init__(self) -> None:
        self.slab = torch.empty(0, dtype=torch.int32)

    def take(self, size: int, device: torch.device) -> torch.Tensor:
        if self.slab.device != device or self.slab.numel() < size:
            self.slab = torch.empty(size, dtype=torch.int32, device=device)
        return self.slab


def record_flat(scratch: Scratch, dirty: torch.Tensor, master: torch.Tensor,
                model: torch.Tensor, *, copy: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Record (and with ``copy``, copy) one flat tensor; ``dirty`` is updated in place.

    Args:
        scratch: the detector's slabs.
        dirty: the packed dirty bits, ``ceil(numel / 8)`` bytes, LSB first.
        master: the flat fp32 master.
        model: the flat, contiguous bf16 or fp16 model tensor.

    Returns:
        The first-seen flips' sorted indices and old values, and whether every tile was
        done (if not, the caller runs the torch reference over the tensor).
    """
    assert ROWS * 8 <= 1 << 15, "tile offsets are staged as int16"
    numel, device = model.numel(), model.device
    tiles = triton.cdiv(numel, ROWS * 8)
    capacity = ROWS * 8 // SLAB_FRACTION
    slab = scratch.take(tiles * capacity, device)
    counts = torch.empty(tiles, dtype=torch.int32, device=device)
    with torch.cuda.device(device.index):
        _record[(programs(tiles, device, waves=WAVES),)](
            master.contiguous(), model.view(torch.int16), dirty, counts, slab, numel,
            dirty.numel(), tiles, PAYLOAD=_PAYLOAD[model.dtype],
            NAN_ABOVE=_NAN_ABOVE[model.dtype], COPY=copy, ROWS=ROWS, SLAB=capacity,
            num_warps=WARPS)
        done = counts <= capacity
        counts = torch.where(done, counts, 0)
        ends = torch.cumsum(counts, 0)
        total, undone = torch.stack([ends[-1], (~done).sum()]).tolist()
        indices, old = gather(counts, ends, total, slab, numel, values=1, rows=ROWS,
                              capacity=capacity)
    return indices, old[0].view(model.dtype), not undone
