"""Many tensors through one detection kernel: groups, device tables, pipelined sizing.

A detection call over a whole model splits its tensors into groups: consecutive tensors
with one kernel configuration (``key``: payload dtype, hyper-parameters), one index
dtype and one alignment, up to ``GROUP_ELEMENTS`` elements (a larger tensor is a group
of its own). The kernels walk a group as one space of tiles, each member starting on a
tile of its own, through device tables of the members' first tiles, sizes and element
offsets from the group's first tensor of each kind (``staging.locate``).

Each group costs one host synchronisation, to size its outputs, and the next group's
pass is queued before the host waits, so the device does not idle while the host reads
the sizes (the sizes travel through pinned memory, behind an event). The scratch slabs
(about one byte per element) then stay bounded by two groups' worth.
"""

from __future__ import annotations

import math
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

T = TypeVar("T")


@attrs.frozen(eq=False)
class Group:
    """Members of one kernel launch and the device tables that locate them."""

    members: tuple[int, ...]
    """Positions of the members in the caller's list."""
    tensors: tuple[tuple[torch.Tensor, ...], ...]
    """Per member its flat tensors, one per kind (e.g. master, moment, moment)."""
    key: Hashable
    tiles: int
    starts: torch.Tensor
    """int64: each member's first tile, then ``tiles``, padded to ``2**steps``."""
    numels: torch.Tensor
    """int64: each member's size, then 0 for the empty member past the last."""
    offsets: torch.Tensor
    """int64 ``[kinds, members + 1]``: element offsets from the first member's tensor."""
    steps: int
    aligned: bool
    index_dtype: torch.dtype

    @property
    def base(self) -> tuple[torch.Tensor, ...]:
        """The first member's tensors: the kernels address every member from them."""
        return self.tensors[0]

    @property
    def numel(self) -> int:
        """The largest member's size."""
        return max(t[0].numel() for t in self.tensors)


def plan(tensors: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable], *,
         tile_elements: int) -> list[Group]:
    """Group flat CUDA tensors (``tensors[i]``: member ``i``'s tensors, one per kind; the
    first sets the member's size) for kernels over tiles of ``tile_elements``."""
    buckets: dict[Hashable, list[int]] = {}
    for i, (kinds, key) in enumerate(zip(tensors, keys)):
        aligned = all(t.data_ptr() % VECTOR_BYTES == 0 for t in kinds)
        buckets.setdefault((key, aligned, index_dtype(kinds[0].numel())), []).append(i)
    runs: list[tuple[Hashable, list[int]]] = []
    for full_key, members in buckets.items():
        run: list[int] = []
        size = 0
        for i in members:
            if run and size + tensors[i][0].numel() > GROUP_ELEMENTS:
                runs.append((full_key, run))
                run, size = [], 0
            run.append(i)
            size += tensors[i][0].numel()
        runs.append((full_key, run))
    return _tables(runs, tensors, tile_elements)


def _tables(runs, tensors, tile_elements: int) -> list[Group]:
    """Build every group's tables on the host and copy them to the device at once."""
    host: list[int] = []
    layout = []
    for (key, aligned, dtype), members in runs:
        first = tensors[members[0]]
        numels = [tensors[i][0].numel() for i in members]
        tiles = [-(-n // tile_elements) for n in numels]
        steps = max(1, math.ceil(math.log2(len(members) + 1)))
        starts = [0]
        for count in tiles:
            starts.append(starts[-1] + count)
        starts += [_PAST] * (max(2**steps, len(members) + 2) - len(starts))  # see advance
        offsets = [(tensors[i][k].data_ptr() - first[k].data_ptr()) // first[k].element_size()
                   for k in range(len(first)) for i in [*members, members[0]]]
        at = len(host)
        host += starts + numels + [0] + offsets
        layout.append((key, aligned, dtype, members, starts[len(members)], steps, at,
                       len(starts), len(members) + 1, len(first)))
    device = tensors[runs[0][1][0]][0].device
    table = torch.tensor(host, dtype=torch.int64)
    if device.type == "cuda":  # pinned, so that the copy does not wait for the device
        table = table.pin_memory().to(device, non_blocking=True)
    groups = []
    for key, aligned, dtype, members, tiles, steps, at, n_starts, width, kinds in layout:
        starts = table[at:at + n_starts]
        numels = table[at + n_starts:at + n_starts + width]
        offsets = table[at + n_starts + width:at + n_starts + width * (kinds + 1)]
        groups.append(Group(tuple(members), tuple(tuple(tensors[i]) for i in members), key,
                            tiles, starts, numels, offsets.view(kinds, width), steps,
                            aligned, dtype))
    return groups


def member_ends(group: Group, ends: torch.Tensor) -> torch.Tensor:
    """Each member's end in the group's outputs, from the per-tile cumulative counts."""
    return ends[group.starts[1:len(group.members) + 1] - 1]


def pipelined(groups: Sequence[Group], launch: Callable[[Group], T],
              sizes: Callable[[T], torch.Tensor],
              finish: Callable[[Group, T, list[int]], None]) -> None:
    """Run ``launch`` over each group, and ``finish`` with the host copy of ``sizes`` (a
    small int64 device tensor), launching group ``k + 1`` before waiting for group ``k``."""
    pending = None
    for group in [*groups, None]:
        launched = None
        if group is not None:
            launched = launch(group)
            small = sizes(launched)
            host = torch.empty(small.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(small, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        if pending is not None:
            done_group, done, done_host, done_ready = pending
            done_ready.synchronize()
            finish(done_group, done, done_host.tolist())
        pending = None if group is None else (group, launched, host, ready)
