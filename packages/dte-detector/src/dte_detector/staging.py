"""Tiles and staged compaction shared by the Triton detection kernels.

A detection kernel walks the tensors of one ``batch.Group`` as one space of ``[ROWS, 8]``
tiles (one byte of packed bits per row; every member starts on a tile of its own), a few
programs per multiprocessor, each reading its next tile while it works on the current one
(so that loads stay in flight during the arithmetic). It stages the selected elements of
a tile (their offset in the tile and one or two 16-bit values, packed into one int32 or
int64 word) in the tile's slab of ``SLAB`` slots, in index order, and writes the tile's
count (int64). A tile with more than ``SLAB`` selected elements stages nothing (or,
through ``stage_counted``, its first ``SLAB``, which ``gather`` skips) and adds one to
the group's dense-tile count: a second pass (the kernel's ``dense`` pass, launched only
when that count is not zero) recomputes it and writes its elements straight into the
outputs. A cumulative sum of the counts gives each tile's end in the outputs (its first
slot is the end less its count), and ``gather`` moves the slabs there: per member, sorted
flat indices and their values, as ``torch.nonzero`` and a gather would give them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from .changes import index_dtype

GATHER_SLOTS = 256
"""Slab slots one ``_gather`` program holds at once (``TILES`` tiles of ``CHUNK``), in
``GATHER_WARPS`` warps: many small programs hide the latency of each one's loads (one
H200, ``tools/gpu/tune_kernels.py`` over 4e9 elements at 6.9 % changed, inversion and cast
device time: 4,096 slots in 4 warps 22.73 / 12.25 ms, 1,024 in 4 22.19 / 11.70, 256 in 1
21.93 / 11.55, 8,192 in 4 46.5 / 13.0; docs/benchmarks.md)."""
GATHER_CHUNK = 64
"""Slots per tile and step of a ``_gather`` program: its steps go up to the fullest of its
tiles, so that a sparse sync (a few dozen pairs in a tile of 256 slots) walks a quarter of
the slab instead of all of it."""
GATHER_WARPS = 1


@triton.jit
def locate(starts_ptr, tile, steps):
    """The member whose tiles hold ``tile`` (a scalar or a tensor of tiles).

    ``starts`` holds each member's first tile, then the group's tile count, padded to
    ``2**steps`` entries with larger values: a tile past the group lands on the empty
    member after the last one. ``steps`` is a runtime value (a kernel argument left
    unspecialised), so a group of another size compiles nothing.
    """
    at = (tile * 0).to(tl.int64)
    for level in range(steps):
        probe = at + (tl.full((), 1, tl.int64) << (steps - 1 - level).to(tl.int64))
        at = tl.where(tl.load(starts_ptr + probe) <= tile, probe, at)
    return at


@triton.jit
def advance(starts_ptr, member, tile):
    """``locate`` for a program whose tiles only grow: search forward from ``member``
    (one load per tile in the common case instead of ``steps``). ``starts`` holds at
    least one padding entry past the tile count."""
    while tl.load(starts_ptr + member + 1) <= tile:
        member += 1
    return member


@triton.jit
def member_offset(offsets_ptr, at, ALIGN: tl.constexpr):
    """A member's element offset from its group's base tensor; ``ALIGN`` (in elements)
    tells the compiler that it keeps 16-byte vectors aligned (1: no such promise)."""
    offset = tl.load(offsets_ptr + at)
    if ALIGN > 1:
        offset = tl.multiple_of(offset, ALIGN)
    return offset


@triton.jit
def read_limit(numel, ALIGN: tl.constexpr):
    """Loads may run up to the end of the 16-byte vector that holds the last element (its
    values are masked out later): a 16-byte-aligned vector never crosses a page, and a
    limit that is a multiple of ``ALIGN`` keeps the loads vectorised."""
    return (numel + ALIGN - 1) // ALIGN * ALIGN


@triton.jit
def tile_offsets(tile, ROWS: tl.constexpr, NARROW: tl.constexpr = False):
    """Flat offsets of a ``[ROWS, 8]`` tile, its column numbers, and offsets within it;
    int64 offsets unless ``NARROW`` (the caller knows they stay below 2**31: int32
    compares and adds are one instruction, int64 ones two)."""
    local = tl.arange(0, ROWS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    if NARROW:
        offsets = tl.cast(tile, tl.int32) * (ROWS * 8) + local
    else:
        offsets = tl.cast(tile, tl.int64) * (ROWS * 8) + local
    return offsets, tl.arange(0, 8)[None, :], local


@triton.jit
def slots(flags):
    """Each flagged element's rank among the tile's flagged elements, in index order."""
    per_row = tl.sum(flags, axis=1)
    return (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(flags, axis=1) - flags


@triton.jit
def stage(slab_ptr, tile, flags, local, first, second, SLAB: tl.constexpr):
    """Stage the flagged elements of a tile in its slab, in index order, one word each:
    the offset in the tile in bits 0-15, ``first`` in 16-31, ``second`` in 32-47 (an
    int32 slab keeps the first two)."""
    _put(slab_ptr, tile, flags != 0, slots(flags), local, first, second, SLAB)


@triton.jit
def stage_counted(slab_ptr, counts_ptr, dense_ptr, tile, flags, local, first, second,
                  SLAB: tl.constexpr):
    """``stage`` for a tile of any count, its count stored and, past ``SLAB``, the tile
    counted as dense (as ``store_count`` does): the first ``SLAB`` flagged elements go to
    the slab (``_gather`` skips a denser tile's slab, the dense pass writes it). One
    block-wide scan gives both the slots and the count, where a separate sum and a branch
    on it would cost a second block-wide reduction."""
    per_row = tl.sum(flags, axis=1)
    ends = tl.cumsum(per_row, axis=0)
    rank = (ends - per_row)[:, None] + tl.cumsum(flags, axis=1) - flags
    last = tl.arange(0, per_row.shape[0]) == per_row.shape[0] - 1
    at = tl.zeros_like(ends)
    tl.store(counts_ptr + tile + at, ends.to(tl.int64), mask=last)
    tl.atomic_add(dense_ptr + at, 1, mask=last & (ends > SLAB))
    _put(slab_ptr, tile, (flags != 0) & (rank < SLAB), rank, local, first, second, SLAB)


@triton.jit
def _put(slab_ptr, tile, keep, rank, local, first, second, SLAB: tl.constexpr):
    # the halves in int32, so that the int64 word is only their placement
    low = local | (first.to(tl.int32) & 0xFFFF) << 16
    word = ((second.to(tl.int32) & 0xFFFF).to(tl.int64) << 32
            | low.to(tl.uint32, bitcast=True).to(tl.int64))
    tl.store(slab_ptr + tl.cast(tile, tl.int64) * SLAB + rank,
             word.to(slab_ptr.dtype.element_ty), mask=keep)


@triton.jit
def store_count(counts_ptr, dense_ptr, tile, total, SLAB: tl.constexpr):
    """Store a tile's count of selected elements (int64: the cumulative sum over the
    tiles needs no cast) and, past ``SLAB``, count the tile as dense (``dense_ptr``: the
    group's zeroed dense-tile count, copied to the host with the members' ends)."""
    tl.store(counts_ptr + tile, total.to(tl.int64))
    if total > SLAB:
        tl.atomic_add(dense_ptr, 1)


@triton.jit
def place(index_ptr, values_ptr, total, at, flags, offsets, first, second,
          VALUES: tl.constexpr):
    """Write a dense tile's flagged elements straight into the outputs from slot ``at``."""
    at = at + slots(flags)
    keep = flags != 0
    tl.store(index_ptr + at, offsets.to(index_ptr.dtype.element_ty), mask=keep)
    tl.store(values_ptr + at, first.to(tl.int16), mask=keep)
    if VALUES == 2:
        tl.store(values_ptr + total + at, second.to(tl.int16), mask=keep)


@triton.jit(do_not_specialize=["tiles", "total", "steps"])
def _gather(counts_ptr, ends_ptr, slab_ptr, starts_ptr, index_ptr, values_ptr, tiles, total,
            steps, VALUES: tl.constexpr, ROWS: tl.constexpr, SLAB: tl.constexpr,
            TILES: tl.constexpr, CHUNK: tl.constexpr):
    """Move the slabs of ``TILES`` tiles to their sorted place in the outputs (a tile's
    first slot: its inclusive end less its count), ``CHUNK`` slots of each tile per step,
    as many steps as the fullest tile needs."""
    tile = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES)[:, None]
    count = tl.load(counts_ptr + tile, mask=tile < tiles, other=0)
    first = tl.load(ends_ptr + tile, mask=tile < tiles, other=0) - count
    # the dense pass writes those tiles; int32, as the slots are (an int64 count makes
    # every slot's compare an int64 one)
    count = tl.where(count <= SLAB, count, 0).to(tl.int32)
    own = (tile - tl.load(starts_ptr + locate(starts_ptr, tile, steps))) * (ROWS * 8)
    for step in range(0, tl.max(count), CHUNK):
        slot = step + tl.arange(0, CHUNK)[None, :]
        staged = slot < count
        at = first + slot
        word = tl.load(slab_ptr + tile * SLAB + slot, mask=staged, other=0).to(tl.int64)
        tl.store(index_ptr + at, (own + (word & 0xFFFF)).to(index_ptr.dtype.element_ty),
                 mask=staged)
        for row in tl.static_range(VALUES):
            tl.store(values_ptr + row * total + at, (word >> (16 * (row + 1))).to(tl.int16),
                     mask=staged)


def tile_elements(rows: int) -> int:
    """Elements of a tile of ``rows`` rows of 8 (a slab word holds an offset in the tile
    in 16 bits, so a tile holds at most 2**15 elements)."""
    elements = rows * 8
    assert elements <= 1 << 15, "tile offsets are staged as int16"
    return elements


def narrow(numel: int, rows: int) -> bool:
    """Whether a group whose largest member has ``numel`` elements addresses its tiles of
    ``[rows, 8]`` with int32 offsets (``tile_offsets``' ``NARROW``): the last tile's
    offsets reach ``numel + rows * 8 - 1``."""
    return numel + tile_elements(rows) - 1 < 2**31


def programs(tiles: int, device: torch.device, *, waves: int) -> int:
    """How many programs walk ``tiles`` tiles on ``device``: ``waves`` per multiprocessor,
    each taking tiles ``program, program + programs, ...`` (Triton's interpreter, on the
    CPU, counts as one multiprocessor)."""
    if device.type != "cuda":
        return max(1, min(tiles, waves))
    index = torch.cuda.current_device() if device.index is None else device.index
    return max(1, min(tiles, _multiprocessors(index) * waves))


@functools.cache
def _multiprocessors(index: int) -> int:
    # a device's properties do not change; asking torch costs a few Python calls per launch
    return torch.cuda.get_device_properties(index).multi_processor_count


def gather(counts: torch.Tensor, ends: torch.Tensor, total: int, slab: torch.Tensor,
           starts: torch.Tensor, *, steps: int, numel: int, values: int, rows: int,
           capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat outputs of a group: member-local indices and a ``[values, total]`` int16 tensor
    (``slab``: int32 words for one value, int64 for two), sorted within each member.

    ``counts`` holds each tile's count, ``ends`` their inclusive cumulative sum (each
    tile's end in the outputs), ``total`` their sum; ``starts`` and ``steps`` are the
    group's (``locate``), ``numel`` its largest member's size (which sets the index
    dtype). Tiles with more than ``capacity`` elements are left to the dense pass.
    """
    indices = torch.empty(total, dtype=index_dtype(numel), device=counts.device)
    staged = torch.empty((values, total), dtype=torch.int16, device=counts.device)
    if total and capacity:  # no slab slots: every tile with a change is dense
        tiles = counts.numel()
        chunk = min(GATHER_CHUNK, capacity)
        per_program = max(1, GATHER_SLOTS // chunk)
        _gather[(triton.cdiv(tiles, per_program),)](
            counts, ends, slab, starts, indices, staged, tiles, total, steps, VALUES=values,
            ROWS=rows, SLAB=capacity, TILES=per_program, CHUNK=chunk, num_warps=GATHER_WARPS)
    return indices, staged


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launches on ``device``: its CUDA context, or none for CPU tensors (the tests run
    the kernels there under Triton's interpreter)."""
    return torch.cuda.device(device.index) if device.type == "cuda" else contextlib.nullcontext()
