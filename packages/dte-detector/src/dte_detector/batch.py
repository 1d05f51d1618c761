"""Many tensors through one detection kernel: groups, device tables, pipelined sizing.

A detection call over a whole model splits its tensors into groups: consecutive tensors
with one kernel configuration (``key``: payload dtype, hyper-parameters), one index
dtype and one alignment, up to ``GROUP_ELEMENTS`` elements (a larger tensor is a group
of its own). The kernels walk a group as one space of tiles, each member starting on a
tile of its own, through device tables of the members' first tiles, sizes and element
offsets from the group's first tensor of each kind (``staging.locate``).

A plan depends only on the members' addresses and sizes and on which of them share a
key, which stay the same from one sync to the next (the optimizer state and the model
copy are not reallocated): the detectors keep it while those stay (``layout.py``), so a
repeated call builds no tables and copies nothing to the device. A plan holds no tensor
of the caller's.

Each group costs one host synchronisation, to size its outputs, and the next group's
pass is queued before the host waits, so the device does not idle while the host reads
the sizes (the sizes travel behind an event through pinned memory allocated once per
device, not per group). The scratch slabs (about one byte per element) then stay bounded
by two groups' worth.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import attrs
import torch

from .changes import index_dtype

GROUP_ELEMENTS = 1 << 28
"""Elements of one group: bounds the scratch of a detection call to ~2 x 256 MiB."""
VECTOR_BYTES = 16
"""The widest load; a group whose tensors all start on such a boundary loads vectors."""
_PAST = 1 << 62
"""Table padding after the last member: no tile lies there."""
_TABLE_ALIGN = VECTOR_BYTES // 8
"""Each table starts on a 16-byte boundary: Triton specialises a kernel on whether its
pointer arguments are, so a table at another offset would compile the kernel again."""

T = TypeVar("T")


@attrs.frozen(eq=False)
class Group:
    """Members of one kernel launch and the device tables that locate them."""

    members: tuple[int, ...]
    """Positions of the members in the caller's list (all with one key: the group's key
    is its first member's)."""
    tiles: int
    starts: torch.Tensor
    """int64: each member's first tile, then ``tiles``, padded to ``2**steps``."""
    numels: torch.Tensor
    """int64: each member's size, then 0 for the empty member past the last."""
    offsets: torch.Tensor
    """int64 ``[kinds, members + 1]``: element offsets from the first member's tensor."""
    lasts: torch.Tensor
    """int64: each member's last tile."""
    steps: int
    aligned: bool
    index_dtype: torch.dtype
    numel: int
    """The largest member's size."""


def plan(tensors: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable], *,
         tile_elements: int) -> list[Group]:
    """Group flat contiguous tensors of one device (``tensors[i]``: member ``i``'s
    tensors, one per kind; the first sets the member's size) for kernels over tiles of
    ``tile_elements``; members share a group only with equal keys (``key_ids`` give the
    same groups as the keys themselves); a group addresses its members from
    ``tensors[group.members[0]]`` and has ``keys[group.members[0]]`` as its key."""
    first = tensors[0]
    sizes = tuple(t.element_size() for t in first)
    layout = [([t.data_ptr() for t in member], member[0].numel()) for member in tensors]
    buckets: dict[Hashable, list[int]] = {}
    for i, ((addresses, numel), key) in enumerate(zip(layout, keys)):
        aligned = all(p % VECTOR_BYTES == 0 for p in addresses)
        buckets.setdefault((key, aligned, index_dtype(numel)), []).append(i)
    runs: list[tuple[Hashable, list[int]]] = []
    for full_key, members in buckets.items():
        run: list[int] = []
        size = 0
        for i in members:
            if run and size + layout[i][1] > GROUP_ELEMENTS:
                runs.append((full_key, run))
                run, size = [], 0
            run.append(i)
            size += layout[i][1]
        runs.append((full_key, run))
    return _tables(runs, layout, first[0].device, sizes, tile_elements)


def key_ids(keys: Sequence[Hashable]) -> tuple[int, ...]:
    """Each key's number among the distinct keys, in order of first appearance: which
    members may share a group (what ``plan`` depends on, not the keys themselves). A key
    that is the previous one's object is not hashed again (neighbours mostly share one)."""
    ids: dict[Hashable, int] = {}
    numbered: list[int] = []
    last, at = ids, -1  # ids: an object no key is
    for key in keys:
        if key is not last:
            last, at = key, ids.setdefault(key, len(ids))
        numbered.append(at)
    return tuple(numbered)


def _tables(runs, layout, device: torch.device, sizes: tuple[int, ...],
            tile_elements: int) -> list[Group]:
    """Build every group's tables on the host and copy them to the device at once."""
    host: list[int] = []
    placed = []
    for (_, aligned, dtype), members in runs:
        first = layout[members[0]][0]
        numels = [layout[i][1] for i in members]
        tiles = [-(-n // tile_elements) for n in numels]
        steps = max(1, math.ceil(math.log2(len(members) + 1)))
        starts = [0]
        for count in tiles:
            starts.append(starts[-1] + count)
        starts += [_PAST] * (max(2**steps, len(members) + 2) - len(starts))  # see advance
        offsets = [(layout[i][0][k] - first[k]) // sizes[k]
                   for k in range(len(first)) for i in [*members, members[0]]]
        lasts = [s - 1 for s in starts[1:len(members) + 1]]
        at = []
        for segment in (starts, numels + [0], offsets, lasts):
            host += [0] * (-len(host) % _TABLE_ALIGN)
            at.append((len(host), len(host) + len(segment)))
            host += segment
        placed.append((aligned, dtype, members, starts[len(members)], steps, at,
                       len(first), max(numels)))
    table = torch.tensor(host, dtype=torch.int64)
    if device.type == "cuda":  # pinned, so that the copy does not wait for the device
        table = table.pin_memory().to(device, non_blocking=True)
    groups = []
    for aligned, dtype, members, tiles, steps, at, kinds, numel in placed:
        starts, numels, offsets, lasts = (table[begin:end] for begin, end in at)
        groups.append(Group(tuple(members), tiles, starts, numels,
                            offsets.view(kinds, -1), lasts, steps, aligned, dtype, numel))
    return groups


def scratch(group: Group, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's int64 tile counts (its pass writes them) and its sizes for the host: the
    count of dense tiles (zeroed: its pass adds each such tile), then each member's end
    in the outputs (``tile_ends``)."""
    return (torch.empty(group.tiles, dtype=torch.int64, device=device),
            torch.zeros(len(group.members) + 1, dtype=torch.int64, device=device))


def tile_ends(group: Group, counts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Each tile's end in the group's outputs (the inclusive cumulative counts); writes
    each member's end into ``sizes`` after the dense-tile count (``scratch``)."""
    ends = torch.cumsum(counts, 0)
    # not ends[lasts]: torch's indexing costs more; out=: no concatenation with the count
    torch.index_select(ends, 0, group.lasts, out=sizes[1:])
    return ends


def member_counts(ends: Sequence[int]) -> list[int]:
    """Each member's output count from the host copy of its end (``tile_ends``)."""
    return [end - begin for begin, end in zip([0, *ends], ends)]


def pipelined(groups: Sequence[Group], launch: Callable[[Group], T],
              sizes: Callable[[T], torch.Tensor],
              finish: Callable[[Group, T, list[int]], None]) -> None:
    """Run ``launch`` over each group, and ``finish`` with the host copy of ``sizes`` (a
    small int64 device tensor), launching group ``k + 1`` before waiting for group ``k``."""
    pending = None
    landing = None
    try:
        for group in [*groups, None]:
            launched = None
            if group is not None:
                launched = launch(group)
                small = sizes(launched)
                if small.is_cuda:
                    if landing is None:
                        landing = _landing(small.device)
                    host, ready = landing.copy(small)
                else:  # the interpreter's CPU tensors: nothing to wait for
                    host, ready = small.to(torch.int64, copy=True), None
            if pending is not None:
                done_group, done, done_host, done_ready = pending
                if done_ready is not None:
                    done_ready.synchronize()
                finish(done_group, done, done_host.tolist())
            pending = None if group is None else (group, launched, host, ready)
    finally:
        if landing is not None:
            landing.release()


LANDING_WORDS = 1 << 15
"""int64 words of a device's pinned buffer for group sizes (256 KiB)."""


class _Landing:
    """Pinned host memory that ``pipelined`` copies each group's sizes into, allocated
    once per device and thread rather than once per group. A call writes it from its
    start, and frees it only once every copy into it has completed, so no copy is ever
    pending into memory that a later call writes to or reads."""

    def __init__(self, words: int):
        self._host = torch.empty(words, dtype=torch.int64, pin_memory=words > 0)
        self._used = 0
        self._copies: list[torch.cuda.Event] = []
        self.busy = False

    def copy(self, small: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """``small`` copied to pinned host memory behind an event."""
        size = small.numel()
        if self._used + size <= self._host.numel():
            host = self._host[self._used:self._used + size].view(small.shape)
            self._used += size
        else:  # more sizes than the buffer holds
            host = torch.empty(small.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(small, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._copies.append(ready)
        return host, ready

    def release(self) -> None:
        """Free the buffer for the next call once every copy into it has completed (at
        once after a call that waited for each; after one that raised, maybe not)."""
        for ready in self._copies:
            ready.synchronize()
        self._copies.clear()
        self._used = 0
        self.busy = False


_landings = threading.local()


def _landing(device: torch.device) -> _Landing:
    """The calling thread's landing buffer of ``device``, held until ``release``; while
    a call holds it (a ``pipelined`` inside another's ``finish``), one that pins per
    group."""
    found = _landings.__dict__.get(device)
    if found is None:
        found = _landings.__dict__[device] = _Landing(LANDING_WORDS)
    elif found.busy:
        return _Landing(0)
    found.busy = True
    return found
