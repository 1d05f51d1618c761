"""``CastDetector.record`` and the master -> model copy fused into one Triton kernel.

One pass reads the fp32 master, the 16-bit model and the packed dirty bits, and writes
the dirty bits OR the flips, the first-seen (index, old value) pairs and, when copying,
``cast(master)`` into the model: the same bits as ``record`` followed by
``model.copy_(master)`` (the cast is the hardware's round-to-nearest-even ``cvt.rn``
that torch's CUDA copy uses too; a flip is a bit difference or NaN over NaN).

First-seen pairs are appended to a workspace through one atomic counter per launch, so
their order across blocks is arbitrary (``CastDetector.changes`` sorts). A block whose
pairs do not fit the workspace's capacity writes nothing, not even the model, so that a
second launch with a larger workspace, over the whole tensor, completes exactly those
blocks: the blocks done already find no fresh flip there (their bits are set), and
re-copy the same values. Blocks that fit form a prefix of the counter's order, so the
pairs written fill ``[0, written)`` without holes, ``written`` being the lowest slot that
a block which did not fit reserved (one atomic per block, another only when one misses).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from .changes import index_dtype

ROWS = 512
"""Bytes of dirty bits per program: a program owns ``ROWS * 8`` elements as a
``[ROWS, 8]`` tile, so that packing bits and counting are reductions along rows."""
WARPS = 8
MIN_CAPACITY = 1 << 16
"""Smallest workspace, in first-seen pairs."""
CAPACITY_FRACTION = 16
"""A new workspace holds numel / 16 pairs; it grows to what a launch needed."""
_NAN_ABOVE = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_PAYLOAD = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_UNSET = 2**63 - 1


@triton.jit(do_not_specialize=["numel", "dirty_bytes", "capacity"])
def _record(master_ptr, model_ptr, dirty_ptr, counter_ptr, index_ptr, old_ptr, numel,
            dirty_bytes, capacity, PAYLOAD: tl.constexpr, NAN_ABOVE: tl.constexpr,
            COPY: tl.constexpr, ROWS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, 8)[None, :]
    offsets = block * (ROWS * 8) + tl.arange(0, ROWS)[:, None] * 8 + columns
    inside = offsets < numel
    master = tl.load(master_ptr + offsets, mask=inside, other=0.0,
                     eviction_policy="evict_first")
    old = tl.load(model_ptr + offsets, mask=inside, other=0).to(tl.int32) & 0xFFFF
    cast = master.to(PAYLOAD).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    both_nan = ((cast & 0x7FFF) > NAN_ABOVE) & ((old & 0x7FFF) > NAN_ABOVE)
    flips = (((cast != old) | both_nan) & inside).to(tl.int32)
    bytes_at = block * ROWS + tl.arange(0, ROWS)
    in_map = bytes_at < dirty_bytes
    before = tl.load(dirty_ptr + bytes_at, mask=in_map, other=0).to(tl.int32)
    fresh = flips & (1 - ((before[:, None] >> columns) & 1))
    per_row = tl.sum(fresh, axis=1)
    count = tl.sum(per_row, axis=0)
    fits = count == 0
    if count > 0:
        start = tl.atomic_add(counter_ptr, count.to(tl.int64))
        fits = start + count <= capacity
        if fits:
            slots = start + ((tl.cumsum(per_row, axis=0) - per_row)[:, None]
                             + tl.cumsum(fresh, axis=1) - fresh)
            tl.store(index_ptr + slots, offsets, mask=fresh != 0)
            tl.store(old_ptr + slots, old.to(tl.int16), mask=fresh != 0)
        else:
            tl.atomic_min(counter_ptr + 1, start)
    if fits:
        tl.store(dirty_ptr + bytes_at, (before | tl.sum(flips << columns, axis=1)).to(tl.uint8),
                 mask=in_map)
        if COPY:
            tl.store(model_ptr + offsets, cast.to(tl.int16), mask=inside)


@attrs.define
class Workspace:
    """Reusable first-seen buffers of one device: int64 indices and 16-bit old values."""

    indices: torch.Tensor
    old: torch.Tensor
    counter: torch.Tensor
    """Pairs reserved by the last launch, and the first slot of a program that did not fit
    (all below it are written; ``_UNSET`` when every program fitted)."""

    @classmethod
    def on(cls, device: torch.device, capacity: int) -> Workspace:
        return cls(torch.empty(capacity, dtype=torch.int64, device=device),
                   torch.empty(capacity, dtype=torch.int16, device=device),
                   torch.zeros(2, dtype=torch.int64, device=device))

    def grow(self, capacity: int, *, written: int) -> None:
        """Hold at least ``capacity`` pairs, keeping the first ``written``."""
        grown = Workspace.on(self.indices.device, capacity)
        grown.indices[:written] = self.indices[:written]
        grown.old[:written] = self.old[:written]
        self.indices, self.old = grown.indices, grown.old

    def __len__(self) -> int:
        return self.indices.numel()


def record_flat(workspace: Workspace | None, dirty: torch.Tensor, master: torch.Tensor,
                model: torch.Tensor, *, copy: bool) -> tuple[Workspace, torch.Tensor,
                                                              torch.Tensor]:
    """Record (and with ``copy``, copy) one flat tensor; ``dirty`` is updated in place.

    Args:
        workspace: the device's workspace from an earlier call, or None for a new one.
        dirty: the packed dirty bits, ``ceil(numel / 8)`` bytes, LSB first.
        master: the flat fp32 master.
        model: the flat, contiguous bf16 or fp16 model tensor.

    Returns:
        The workspace (grown if needed), and the fresh flips' indices and old values.
    """
    numel = model.numel()
    if workspace is None or workspace.indices.device != model.device:
        workspace = Workspace.on(model.device, max(MIN_CAPACITY, numel // CAPACITY_FRACTION))
    workspace.counter[0], workspace.counter[1] = 0, _UNSET
    master = master.contiguous()
    blocks = triton.cdiv(numel, ROWS * 8)
    with torch.cuda.device(model.device.index):
        for _ in range(2):
            _record[(blocks,)](master, model.view(torch.int16), dirty, workspace.counter,
                               workspace.indices, workspace.old, numel, dirty.numel(),
                               len(workspace), PAYLOAD=_PAYLOAD[model.dtype],
                               NAN_ABOVE=_NAN_ABOVE[model.dtype], COPY=copy, ROWS=ROWS,
                               num_warps=WARPS)
            reserved, first_unfit = workspace.counter.tolist()
            written = min(reserved, first_unfit)
            if reserved == written:
                break
            workspace.grow(reserved, written=written)
            workspace.counter[0], workspace.counter[1] = written, _UNSET
        else:
            raise AssertionError("a grown workspace must hold every first-seen pair")
    return (workspace, workspace.indices[:written].to(index_dtype(numel)),
            workspace.old[:written].view(model.dtype).clone())
