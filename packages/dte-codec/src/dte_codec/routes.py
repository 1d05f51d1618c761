"""The sparse entries of a payload staged into one shard's local tensors through routes
computed on the device, with no per-tensor work on the host.

``Routes`` holds what is static about a (sender layout, shard) pair: every transfer of
``geometry.plan`` in one device table, and per source tensor its run of transfers and its
shape. Per payload, ``stage_routed`` then costs a fixed number of launches whatever the
number of entries (``route_kernel``): one routes every changed element to its target
tensor and flat index (a lookup by coordinate where the transfers split the tensor along
one dimension), one gathers the base values there (+0.0 where this shard holds no
piece), residues resolve against them (``flat_values``), and the write is one scatter
whose undo log is that gather. It reads back one small summary (one host
synchronization) and gives way to the reference (``batched_remap.remap_all`` per
target) for anything unusual, so the reference raises its errors: an index outside its
tensor, an element that two local pieces hold, a residue that does not resolve.

The writes equal the reference's bit for bit: each held element gets the same target
and the same new value; only the order of the (unique) writes differs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import attrs
import torch

from .dispatch import on_device
from .fields import block_segments, host_table
from .flat_values import resolve_residues
from .geometry import Transfer
from .header import Entry, ValueEncoding
from .remap import _affine, _check_boxes, _strides

_WORD = 8
_NARROW = 2**31
"""Source tensors below this many elements take 32-bit coordinates."""
_FLAGS = 2
"""``route_kernel``'s flags: indices out of range, elements routed twice."""


@attrs.frozen
class _Source:
    """One source tensor's run of transfers in the table, its right-aligned shape, and
    where its lookup starts (-1: none) and in which dimension."""

    first: int
    count: int
    numel: int
    strides: tuple[int, ...]
    sizes: tuple[int, ...]
    lookup_at: int = -1
    lookup_dim: int = 0


@attrs.frozen
class Routes:
    """Every transfer of a plan into one shard's local tensors, as one device table.

    A source tensor whose transfers split it along one dimension only, without overlap
    (a fused QKV cut into its query groups, a row- or column-parallel shard) also gets a
    lookup from that coordinate to its transfer, so an element finds its transfer with
    one read instead of comparing every box."""

    dims: int
    narrow: bool
    """Every source tensor has fewer than 2**31 elements (32-bit coordinates)."""
    tensors: tuple[str, ...]
    """The local tensors, in the order the table names them."""
    sources: Mapping[str, _Source]
    table: torch.Tensor
    lookup: torch.Tensor

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
        lookup: list[int] = []
        sources = {}
        for name, ts in transfers.items():
            shape = tuple(shapes[name])
            _check_boxes(ts, shape, name)
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
                at = len(lookup)
                lookup += _lookup(sizes[split], [b[0][split] for b in boxes],
                                  [b[1][split] for b in boxes], len(rows[0]))
            sources[name] = _Source(len(rows[0]), len(ts), math.prod(shape),
                                    (1,) * pad + tuple(_strides(shape)), sizes,
                                    at, split or 0)
            for t, (start, size) in zip(ts, boxes):
                shift, weights = _affine(t)
                rows[0].append(ids[t.target_tensor])
                rows[1].append(shift)
                for d, w in enumerate((0,) * pad + weights):
                    rows[2 + 3 * d].append(w)
                    rows[3 + 3 * d].append(start[d])
                    rows[4 + 3 * d].append(start[d] + size[d])
        table = host_table(rows if rows[0] else [[0]] * len(rows), device)
        return cls(dims=dims, narrow=all(s.numel < _NARROW for s in sources.values()),
                   tensors=tensors, sources=sources, table=table,
                   lookup=host_table([lookup or [-1]], device)[0].to(torch.int32))

    def covers(self, names: Sequence[str]) -> bool:
        """Whether every tensor of ``names`` has routes."""
        return all(name in self.sources for name in names)


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


def _lookup(length: int, starts: list[int], sizes: list[int], first: int) -> list[int]:
    """Per coordinate of the split dimension, the table row of the transfer that holds
    it (-1: none)."""
    out = [-1] * length
    for k, (start, size) in enumerate(zip(starts, sizes)):
        out[start:start + size] = [first + k] * size
    return out


Sparse = tuple[Entry, torch.Tensor, tuple[torch.Tensor, ...]]
"""A sparse entry of a payload: its entry, flat indices and value sections."""


def stage_routed(routes: Routes, weights: Mapping[str, torch.Tensor],
                 entries: Sequence[Sparse]) -> StagedRoutes | None:
    """The sparse ``entries`` (indices and sections on the routes' device) staged into
    ``weights``; None when the reference must stage them (see the module docstring)."""
    from . import route_kernel as kernel
    device = routes.table.device
    if not entries or not routes.covers([e.name for e, _, _ in entries]) or any(
            i.dim() != 1 or i.dtype not in (torch.int32, torch.int64) or i.device != device
            or e.value_encoding not in (ValueEncoding.RAW, ValueEncoding.RESIDUE)
            for e, i, _ in entries):
        return None
    moves = _Moves.of(routes, weights, [(e, i.contiguous()) for e, i, _ in entries])
    flags = torch.zeros(_FLAGS, dtype=torch.int64, device=device)
    if moves.total:
        with on_device(device):
            kernel.route(moves.entries, moves.block_seg, len(entries), routes.table,
                         routes.lookup, moves.tensor_of, moves.flat_of, flags,
                         narrow=routes.narrow)
    gathered = moves.gather()
    bases = moves.views(gathered)
    new = [s[0].view(e.dtype) if e.value_encoding == ValueEncoding.RAW else None
           for e, _, s in entries]
    residue = [k for k, n in enumerate(new) if n is None]
    failures = torch.zeros(1, dtype=torch.int64, device=device)
    if residue:
        values, failed = resolve_residues([entries[k][0] for k in residue],
                                          [entries[k][2] for k in residue],
                                          [bases[k] for k in residue])
        failures = failed.view(1).to(torch.int64)
        for k, value in zip(residue, values):
            new[k] = value
    if any(torch.cat([flags, failures]).tolist()):  # the one host synchronization
        return None
    return StagedRoutes(moves, tuple(v.contiguous() for v in new), gathered)


@attrs.frozen
class _Moves:
    """One payload's routes: the per-entry table, and per element its target tensor and
    flat index (each entry on whole kernel blocks); values travel in byte buffers laid entry
    by entry from word bounds."""

    entries: torch.Tensor
    block_seg: torch.Tensor
    tensors: torch.Tensor
    targets: tuple[torch.Tensor, ...]
    tensor_of: torch.Tensor
    flat_of: torch.Tensor
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    total: int
    nbytes: int

    @classmethod
    def of(cls, routes: Routes, weights: Mapping[str, torch.Tensor],
           entries: Sequence[tuple[Entry, torch.Tensor]]) -> _Moves:
        device = routes.table.device
        from .route_kernel import BLOCK, BLOCKS
        counts = [i.numel() for _, i in entries]
        blocks = [-(-count // BLOCK) for count in counts]
        first_blocks = list(itertools.accumulate(blocks, initial=0))  # and their total last
        offsets = list(itertools.accumulate(
            (-(-count * entry.dtype.itemsize // _WORD) * _WORD
             for (entry, _), count in zip(entries, counts)), initial=0))
        total_blocks, nbytes = first_blocks.pop(), offsets.pop()
        sources = [routes.sources[e.name] for e, _ in entries]
        columns = [first_blocks, [i.data_ptr() for _, i in entries],
                   [i.element_size() for _, i in entries], [s.numel for s in sources],
                   [s.first for s in sources], [s.count for s in sources],
                   [e.dtype.itemsize for e, _ in entries], [s.lookup_at for s in sources],
                   [s.lookup_dim for s in sources]]
        columns += [[s.strides[d] for s in sources] for d in range(routes.dims)]
        columns += [[s.sizes[d] for s in sources] for d in range(routes.dims)]
        table = host_table(columns + [counts, blocks], device)  # ELEMENTS, BLOCKS
        targets = tuple(weights[name] for name in routes.tensors)
        return cls(entries=table, block_seg=block_segments(table[BLOCKS], total_blocks),
                   tensors=host_table([[t.data_ptr() for t in targets]], device)[0],
                   targets=targets,
                   tensor_of=torch.empty(total_blocks * BLOCK, dtype=torch.int32, device=device),
                   flat_of=torch.empty(total_blocks * BLOCK, dtype=torch.int64, device=device),
                   counts=tuple(counts), offsets=tuple(offsets),
                   dtypes=tuple(e.dtype for e, _ in entries), total=sum(counts), nbytes=nbytes)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per entry, its values in the byte buffer ``flat`` (``gather``'s layout)."""
        return [flat[o:o + n * d.itemsize].view(d)
                for o, n, d in zip(self.offsets, self.counts, self.dtypes)]

    def gather(self) -> torch.Tensor:
        """The targets' values at the routes (+0.0 where unrouted), as one byte buffer."""
        flat = torch.empty(max(self.nbytes, _WORD), dtype=torch.uint8,
                           device=self.tensor_of.device)
        self._launch([flat.data_ptr() + o for o in self.offsets], to_values=True)
        return flat

    def scatter(self, values: Sequence[torch.Tensor]) -> None:
        """Write per entry ``values`` (contiguous, on the device) at its routed elements."""
        self._launch([v.data_ptr() for v in values], to_values=False)
        # written through addresses: tell autograd, as an in-place torch write would
        torch.autograd.graph.increment_version(list(self.targets))

    def _launch(self, addresses: list[int], *, to_values: bool) -> None:
        if not self.total:
            return
        from . import route_kernel as kernel
        device = self.tensor_of.device
        with on_device(device):
            kernel.move(self.entries, self.block_seg, len(self.counts),
                        host_table([addresses], device)[0], self.tensor_of, self.flat_of,
                        self.tensors, to_values=to_values)


@attrs.frozen
class StagedRoutes:
    """Every sparse entry of a payload, routed into one shard's local tensors: the write
    is one scatter launch (``apply.Staged``'s protocol). Its undo log is the values
    gathered when staging: the residues resolved against them, so nothing may write the
    tensors between staging and writing in any case."""

    moves: _Moves
    new: tuple[torch.Tensor, ...]
    old: torch.Tensor

    @property
    def name(self) -> str:
        return f"{len(self.new)} routed sparse entries"

    def saved(self) -> torch.Tensor:
        return self.old

    def write(self) -> None:
        self.moves.scatter(self.new)

    def undo(self, old: torch.Tensor) -> None:
        self.moves.scatter(self.moves.views(old))
