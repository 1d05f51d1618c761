"""The sparse entries of a payload staged into one shard's local tensors through routes
computed on the device, with no per-tensor work on the host.

``Routes`` holds what is static about a (sender layout, shard) pair: every transfer of
``geometry.plan`` in one device table, and per source tensor its run of transfers and its
shape. Per payload, ``stage_routed`` then costs a fixed number of launches whatever the
number of entries (``route_kernel``): one routes every changed element to its target
element's address (a lookup by coordinate where the transfers split the tensor along one
dimension) and gathers the base values there (+0.0 where this shard holds no piece),
residues resolve against them (``flat_values``), and the write is one scatter whose undo
log is that gather. It reads back one small summary (one host
synchronization) and gives way to the reference (``batched_remap.remap_all`` per
target) for anything unusual, so the reference raises its errors: an index outside its
tensor, an element that two local pieces hold, a residue that does not resolve.

The writes equal the reference's bit for bit: each held element gets the same target
and the same new value; only the order of the (unique) writes differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from .dispatch import on_device
from .encodings import ValueEncoding, align
from .fields import WORD_BYTES, block_segments, host_table, host_tables, starts_of
from .flat_values import Residues
from .geometry import Transfer
from .remap import affine_map, check_boxes
from .sparse_entries import SparseEntries

if TYPE_CHECKING:
    from .decode import QueuedChecks

_NARROW = 2**31
"""Source tensors below this many elements take 32-bit coordinates."""
_FLAGS = 2
"""``route_kernel``'s flags: indices out of range, elements routed twice."""
SOURCE_COLUMNS = ("numel", "first", "count", "lookup_at", "lookup_dim", "middle", "inner")
"""``Routes.source_columns``' rows, in ``route_kernel``'s entry table order: the source
tensor's element count, its run of transfers, its lookup and its two inner sizes (the
outer coordinate follows from them)."""


@attrs.frozen
class _Source:
    """One source tensor's run of transfers in the table, its right-aligned shape, and
    where its lookup starts (-1: none) and in which dimension."""

    first: int
    count: int
    numel: int
    sizes: tuple[int, ...]
    lookup_at: int = -1
    lookup_dim: int = 0

    @property
    def middle(self) -> int:
        """The middle one of ``sizes``."""
        return self.sizes[1]

    @property
    def inner(self) -> int:
        """The coordinates follow from the inner two sizes (the outer one only places a
        lookup)."""
        return self.sizes[2]


@attrs.frozen
class Routes:
    """Every transfer of a plan into one shard's local tensors, as one device table.

    A source tensor whose transfers split it along one dimension only, without overlap
    (a fused QKV cut into its query groups, a row- or column-parallel shard) also gets a
    lookup from that coordinate to its transfer, so an element finds its transfer with
    one read instead of comparing every box."""

    narrow: bool
    """Every source tensor has fewer than 2**31 elements (32-bit coordinates)."""
    tensors: tuple[str, ...]
    """The local tensors, in the order the table names them."""
    sources: Mapping[str, _Source]
    table: torch.Tensor
    lookup: torch.Tensor
    _rows: dict[str, np.ndarray] = attrs.field(factory=dict, init=False, eq=False, repr=False)
    """Per source tensor, its columns of ``route_kernel``'s entry table (from NUMEL to
    INNER), made on first use."""
    _columns: dict[tuple[str, ...], np.ndarray] = attrs.field(
        factory=dict, init=False, eq=False, repr=False)
    """The columns of the names last given to ``source_columns``."""

    @classmethod
    def of(cls, transfers: Mapping[str, Sequence[Transfer]],
           shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype],
           local: Mapping[str, torch.Tensor], device: torch.device) -> Routes:
        """The routes of ``transfers`` (per source tensor of ``shapes`` and ``dtypes``)
        into the ``local`` tensors, on ``device``. A source tensor whose targets have
        another item size than its own, or with more dimensions than the kernel reads,
        gets no routes (the reference stages it).

        Raises:
            GeometryError: a transfer's box lies outside its source or target tensor.
        """
        from .route_kernel import DIMS
        dims = DIMS.value
        tensors = tuple(sorted(local))
        ids = {name: k for k, name in enumerate(tensors)}
        rows: list[list[int]] = [[] for _ in range(2 + 3 * dims)]
        lookup: list[np.ndarray] = []
        looked_up = 0
        sources = {}
        for name, ts in transfers.items():
            shape = tuple(shapes[name])
            check_boxes(ts, shape, name)
            if len(shape) > dims or any(local[t.target_tensor].element_size()
                                        != dtypes[name].itemsize for t in ts):
                continue
            pad = dims - len(shape)
            sizes = (1,) * pad + tuple(max(n, 1) for n in shape)
            boxes = [((0,) * pad + t.source_box.start, (1,) * pad + t.source_box.size)
                     for t in ts]
            split = _split_dim(sizes, boxes)
            at = -1
            if split is not None:
                at, looked_up = looked_up, looked_up + sizes[split]
                lookup.append(_lookup(sizes[split], [b[0][split] for b in boxes],
                                      [b[1][split] for b in boxes], len(rows[0])))
            sources[name] = _Source(len(rows[0]), len(ts), math.prod(shape), sizes, at,
                                    split or 0)
            for t, (start, size) in zip(ts, boxes):
                shift, weights = affine_map(t)
                rows[0].append(ids[t.target_tensor])
                rows[1].append(shift)
                for d, w in enumerate((0,) * pad + weights):
                    rows[2 + 3 * d].append(w)
                    rows[3 + 3 * d].append(start[d])
                    rows[4 + 3 * d].append(start[d] + size[d])
        table = host_table(rows if rows[0] else [[0]] * len(rows), device)
        return cls(narrow=all(s.numel < _NARROW for s in sources.values()),
                   tensors=tensors, sources=sources, table=table,
                   lookup=torch.from_numpy(np.concatenate(lookup or [np.full(1, -1, np.int32)])
                                           ).to(device))

    def covers(self, names: Sequence[str]) -> bool:
        """Whether every tensor of ``names`` has routes."""
        return all(name in self.sources for name in names)

    def source_columns(self, names: tuple[str, ...]) -> np.ndarray:
        """``SOURCE_COLUMNS`` of each source tensor of ``names`` (columns x names;
        read-only: a stream's deltas, which name the same tensors, get the same array)."""
        columns = self._columns.get(names)
        if columns is not None:
            return columns
        rows = self._rows
        missing = [name for name in names if name not in rows]
        for name in missing:
            s = self.sources[name]
            rows[name] = np.array([getattr(s, c) for c in SOURCE_COLUMNS], dtype=np.int64)
        columns = np.stack([rows[name] for name in names], axis=1)
        columns.flags.writeable = False
        self._columns.clear()
        self._columns[names] = columns
        return columns

    def target_addresses(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The local tensors' addresses, in ``tensors`` order, as a device table: what
        ``stage_routed`` takes (a caller that holds the tensors across payloads keeps it
        while their addresses stay)."""
        return host_table([list(map(torch.Tensor.data_ptr,
                                    map(weights.__getitem__, self.tensors)))],
                          self.table.device)[0]


def _split_dim(sizes: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
               ) -> int | None:
    """The one dimension along which several disjoint ``boxes`` cut a tensor of
    ``sizes`` (every other dimension whole in each box); None if there is none."""
    if len(boxes) < 2:
        return None
    cut = [d for d in range(len(sizes))
           if any(start[d] != 0 or size[d] != sizes[d] for start, size in boxes)]
    if len(cut) != 1:
        return None
    spans = sorted((start[cut[0]], start[cut[0]] + size[cut[0]]) for start, size in boxes)
    if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
        return None
    return cut[0]


def _lookup(length: int, starts: list[int], sizes: list[int], first: int) -> np.ndarray:
    """Per coordinate of the split dimension, the table row of the transfer that holds
    it (-1: none), as int32 (a Qwen3-4B shard has ~1e6 coordinates: Python lists of
    them cost ~50 ms)."""
    out = np.full(length, -1, np.int32)
    for k, (start, size) in enumerate(zip(starts, sizes)):
        out[start:start + size] = first + k
    return out


def stage_routed(routes: Routes, weights: Mapping[str, torch.Tensor],
                 sparse: SparseEntries, *, targets: torch.Tensor,
                 checks: QueuedChecks | None = None) -> StagedRoutes | None:
    """The ``sparse`` entries (on the routes' device) staged into ``weights``, whose
    addresses are ``targets`` (``Routes.target_addresses``); None when the reference
    must stage them (see the module docstring). ``checks``: the queued
    checks of the payload ``sparse`` was read from (``decode.decode_queued``), read with
    the routes' summary and settled before anything staged is used; the launches before
    write only scratch and stay inside the header's bounds, whatever the body holds.

    Raises:
        DigestError, EntryError: ``checks`` failed (``QueuedChecks.settle``).
    """
    from . import route_kernel as kernel
    device = routes.table.device
    encodings = sparse.columns["value_encoding"]
    if (not sparse.names or sparse.device != device or not routes.covers(sparse.names)
            or not ((encodings == ValueEncoding.RAW)
                    | (encodings == ValueEncoding.RESIDUE)).all()):
        return None
    moves = _Moves.of(routes, weights, sparse, targets)
    summary = [moves.flags]
    if moves.total:
        with on_device(device):
            kernel.route(moves.entries, moves.block_seg, len(sparse.names), routes.table,
                         routes.lookup, moves.tensors, moves.gathered_at, moves.address_of,
                         moves.flags, narrow=routes.narrow)
    gathered = moves.gathered
    new_at = sparse.value_at[0].copy()  # raw values are sent as they are
    keep = sparse.keep
    residue = np.flatnonzero(encodings == ValueEncoding.RESIDUE)
    if residue.size:
        from .values_kernel import resolve_columns
        c = {name: column[residue] for name, column in sparse.columns.items()}
        resolved = resolve_columns(Residues(
            c["count"], c["itemsize"], c["value_width"], c["value_escapes"],
            sparse.value_at[0][residue], sparse.fields_bytes[residue],
            sparse.value_at[1][residue], sparse.value_at[2][residue],
            gathered.data_ptr() + moves.offsets[residue]), device)
        new_at[residue] = resolved.out.data_ptr() + resolved.offsets
        keep += (resolved.out,)
        summary.append(resolved.failures.view(1))
    # copied while the kernels above run: after the synchronization the write only launches
    new_on_device = host_table(new_at[None], device)[0]
    if checks is not None:  # the decode's checks first: its errors come before any fallback
        summary.insert(0, checks.queued)  # on this device: _routed passes them only then
    read = torch.cat(summary).tolist()  # the one host synchronization
    if checks is not None:
        queued = checks.queued.numel()
        if checks.settle(read[:queued]) is not None:
            return None
        read = read[queued:]
    if any(read):
        return None
    return StagedRoutes(moves, new_at, new_on_device, keep, gathered)


@attrs.frozen
class _Moves:
    """One payload's routes: the per-entry table, and per element its target element's
    address (each entry on whole kernel blocks); values travel in byte buffers laid entry
    by entry from word bounds."""

    entries: torch.Tensor
    block_seg: torch.Tensor
    flags: torch.Tensor
    """``route_kernel``'s flag counts, zeroed (copied with the table)."""
    tensors: torch.Tensor
    targets: tuple[torch.Tensor, ...]
    address_of: torch.Tensor
    offsets: np.ndarray
    total: int
    gathered: torch.Tensor
    """The byte buffer the routing fills with the targets' values, entry ``e`` from byte
    ``offsets[e]``."""
    gathered_at: torch.Tensor
    """Per entry, the device address of its values in ``gathered``."""

    @classmethod
    def of(cls, routes: Routes, weights: Mapping[str, torch.Tensor],
           sparse: SparseEntries, targets: torch.Tensor) -> _Moves:
        device = routes.table.device
        from .route_kernel import BLOCK, BLOCKS, ENTRY_COLUMNS
        counts, itemsize = sparse.columns["count"], sparse.columns["itemsize"]
        blocks = -(-counts // BLOCK)
        sizes = align(counts * itemsize)
        offsets = starts_of(sizes)
        gathered = torch.empty(max(int(sizes.sum()), WORD_BYTES), dtype=torch.uint8, device=device)
        own = {"first_block": starts_of(blocks), "index_at": sparse.index_at,
               "index_size": sparse.index_size, "itemsize": itemsize, "elements": counts,
               "blocks": blocks}
        start = ENTRY_COLUMNS.index(SOURCE_COLUMNS[0])
        end = start + len(SOURCE_COLUMNS)
        # the gather's addresses go with the table: one copy to the device
        table, gathered_at, flags = host_tables([np.concatenate([
            np.stack([own[c] for c in ENTRY_COLUMNS[:start]]),
            routes.source_columns(sparse.names),
            np.stack([own[c] for c in ENTRY_COLUMNS[end:]])]),
            (gathered.data_ptr() + offsets)[None], np.zeros(_FLAGS, dtype=np.int64)], device)
        total_blocks = int(blocks.sum())
        return cls(entries=table, block_seg=block_segments(table[BLOCKS], total_blocks),
                   flags=flags,
                   tensors=targets,
                   targets=tuple(weights[name] for name in routes.tensors),
                   address_of=torch.empty(total_blocks * BLOCK, dtype=torch.int64,
                                          device=device),
                   offsets=offsets, total=int(counts.sum()), gathered=gathered,
                   gathered_at=gathered_at[0])

    def scatter(self, addresses: np.ndarray | torch.Tensor) -> None:
        """Write per entry the values at ``addresses`` (on the device; a host array, or
        a device table of them) at its routed elements."""
        if self.total:
            from . import route_kernel as kernel
            if isinstance(addresses, np.ndarray):
                addresses = host_table(addresses[None], self.address_of.device)[0]
            with on_device(self.address_of.device):
                kernel.move(self.entries, self.block_seg, self.offsets.size, addresses,
                            self.address_of)
        # written through addresses: tell autograd, as an in-place torch write would
        torch.autograd.graph.increment_version(list(self.targets))


@attrs.frozen
class StagedRoutes:
    """Every sparse entry of a payload, routed into one shard's local tensors: the write
    is one scatter launch (``apply.Staged``'s protocol). Its undo log is the values
    gathered when staging: the residues resolved against them, so nothing may write the
    tensors between staging and writing in any case."""

    moves: _Moves
    new_at: np.ndarray
    """Per entry, the address of its new values (inside ``keep``)."""
    new_on_device: torch.Tensor
    """``new_at`` as a device table."""
    keep: tuple[torch.Tensor, ...]
    old: torch.Tensor

    @property
    def name(self) -> str:
        return f"{self.new_at.size} routed sparse entries"

    def saved(self) -> torch.Tensor:
        return self.old

    def write(self) -> None:
        self.moves.scatter(self.new_on_device)

    def undo(self, old: torch.Tensor) -> None:
        self.moves.scatter(old.data_ptr() + self.moves.offsets)
