"""Stage payloads named in the sender's layout into one rank's own layout.

A trainer encodes its weights under their Hugging Face names (or in its own layout, e.g.
Megatron's fused and interleaved tensors); a rollout rank holds them
fused and sharded (SGLang's ``qkv_proj``, ``gate_up_proj``, ``experts.w13_weight``, a
padded vocab, one TP slice of each). ``ShardStage`` is a ``dte_transport.receiver.Stage``
for such a rank. It checks a payload against the sender's tensors with
``dte_codec.fit.check_fit`` on meta tensors (the checks and errors of a receiver that
held them by name), then maps every entry onto the local tensors through the shard's
pieces:

- the flat indices of every sparse entry are routed to the local tensors together: where
  the kernels run by ``dte_codec.routes`` (the plan kept as device tables, built on the
  first payload), otherwise, and for any payload the routes give way on, by one
  ``dte_codec.batched_remap.remap_all`` (``sparse_reference``); residues resolve against
  the local values there, on a GPU all entries at once;
- a dense or box entry is cut into the boxes of the local tensors it overlaps (computed
  once per tensor and box); where the kernels run, every box of a full version is
  written by ``dte_codec.box_copy`` (one launch per item size). A full payload's fit
  and its copy plan depend only on its table and regions and on the local tensors'
  names, shapes and dtypes, so a stream's next full version finds both by one look-up
  and reads no more than its sections' devices and addresses.

Elements that no piece of this shard holds (another rank's slice) are dropped; local
elements that no piece covers (vocab padding) are never written. The result is a
``dte_codec.apply.Prepared``: its writes are all or nothing, with the codec's undo log.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import attrs
import torch
from dte_codec import Kind, Payload
from dte_codec.apply import Prepared, Staged
from dte_codec.box_copy import PLANS, CopyPlan, Cut, StagedCopies
from dte_codec.dispatch import fused
from dte_codec.entry import Entry
from dte_codec.errors import GeometryError
from dte_codec.fields import WORD_BYTES
from dte_codec.fit import check_fit
from dte_codec.geometry import Piece, Shard, Transfer, plan
from dte_codec.region import Box
from dte_codec.routes import Routes, StagedRoutes, stage_routed
from dte_codec.sparse_entries import SparseEntries

from .sparse_reference import stage_sparse


@attrs.frozen
class ShardStage:
    """Stages canonical payloads into the local tensors of one shard.

    Build it with ``ShardStage.of``; call it as ``stage(weights, payload)``.
    """

    canonical: Mapping[str, torch.Tensor]
    """Every sender tensor as a meta tensor (names, shapes and dtypes to check)."""
    transfers: Mapping[str, tuple[Transfer, ...]]
    """Per sender tensor, its boxes in the shard's local tensors (``geometry.plan``)."""
    pieces: Mapping[str, tuple[Piece, ...]]
    """Per sender tensor, the same boxes as pieces (region: the box in the sender's
    tensor; local: where the shard holds it)."""
    _routes: dict[torch.device, Routes] = attrs.field(factory=dict, init=False, eq=False,
                                                      repr=False)
    """Per device where the kernels run, the plan as device tables (built with the stage
    where its local tensors are, else on first use)."""
    _cut_cache: dict[tuple[str, Box], tuple[tuple[str, Box, Box], ...]] = attrs.field(
        factory=dict, init=False, eq=False, repr=False)
    _plans: _Recent = attrs.field(factory=lambda: _Recent(), init=False, eq=False,
                                  repr=False)
    """The copy plans (or None: the reference copies) of the last few sets of box
    entries of full versions, by table, regions, device and alignment. Not
    ``box_copy.copies_by_name``'s cache: these plans cut the sender's boxes across the
    shard's pieces (``_cuts``), and they are dropped with the local layout (``_local``)."""
    _fitted: _Recent = attrs.field(factory=lambda: _Recent(), init=False, eq=False,
                                   repr=False)
    """The tables and regions of the last few full payloads, and the table skeletons of
    the last few deltas, that passed ``check_fit``."""
    _held: list[_Local] = attrs.field(factory=list, init=False, eq=False, repr=False)
    """The local tensors as the last full payload found them (``_local``)."""

    @classmethod
    def of(cls, source: Shard, shard: Shard,
           weights: Mapping[str, torch.Tensor]) -> ShardStage:
        """The stage from the sender's layout ``source`` (``layouts.hf_shard``, or a
        trainer shard such as ``megatron_shard``) into ``shard``, whose local tensors are
        ``weights``.

        Raises:
            GeometryError: ``weights`` are not the shard's tensors (names, shapes,
                dtypes) or not contiguous.
        """
        shard.check_tensors(weights)
        strided = sorted(n for n, t in weights.items() if not t.is_contiguous())
        if strided:
            raise GeometryError("layout", expected="contiguous local tensors",
                                got=f"strided {strided[:5]}")
        transfers = plan(source, [shard])
        # A transfer is a piece of the source tensor seen from the shard: its source box
        # plays the region, so dense and box entries are cut by the same geometry as
        # sparse ones, whatever the source's own layout.
        pieces = {name: tuple(Piece(tensor=t.target_tensor, local=t.target_box, canonical=name,
                                    region=t.source_box) for t in ts)
                  for name, ts in transfers.items()}
        canonical = {name: torch.empty(spec.shape, dtype=spec.dtype, device="meta")
                     for name, spec in source.tensors.items()}
        stage = cls(canonical=canonical, transfers=transfers, pieces=pieces)
        devices = {t.device for t in weights.values()}
        if len(devices) == 1 and fused(device := devices.pop()):  # now, not in the first delta
            stage._routes_on(device, weights)
        return stage

    def __call__(self, weights: Mapping[str, torch.Tensor], payload: Payload) -> Prepared:
        """Check ``payload`` and resolve it into ``weights``, writing nothing.

        Raises:
            MismatchError: the payload does not fit the canonical tensors, or a sparse
                entry reaches a local tensor replaced by a strided one.
            EntryError: a residue does not resolve against this rank's values.
            GeometryError: an index outside its canonical tensor.
        """
        kind = self._fit(payload)
        if kind == Kind.FULL:
            copied = self._copied(weights, payload)
            if copied is not None:
                return Prepared((copied,), True)
        routed = self._routed(weights, payload) if kind == Kind.DELTA else None
        if routed is not None and routed.new_at.size == len(payload.header.entries):
            return Prepared((routed,), False)  # read from the body: no per-entry tensors
        entries = list(zip(payload.header.entries, payload.indices, payload.values))
        sparse = [k for k, (_, where, _) in enumerate(entries) if not isinstance(where, Box)]
        resolved = ({k: [routed] if n == 0 else [] for n, k in enumerate(sparse)}
                    if routed is not None else
                    dict(zip(sparse, stage_sparse(self.transfers, weights,
                                                   [entries[k] for k in sparse]))))
        staged: list[Staged | StagedRoutes] = []
        for k, (entry, where, sections) in enumerate(entries):
            if k in resolved:
                staged.extend(resolved[k])
            else:
                staged.extend(self._boxes(weights, entry, where, sections[0],
                                          keep_undo=kind == Kind.DELTA))
        return Prepared(tuple(staged), kind == Kind.FULL)

    def _fit(self, payload: Payload) -> Kind:
        """``check_fit`` against the canonical tensors. It reads only the table and the
        regions, so a full payload with the table and regions of one that passed passes
        too: a stream's full versions are checked once. A delta's checks read only its
        entries' names, dtypes and shapes where no tensor has two entries (nothing to
        overlap): its deltas are checked once per table skeleton."""
        header = payload.header
        if header.kind == Kind.FULL:
            key = (header.entries, payload.indices)
        else:
            skeleton = header.skeleton()
            if skeleton is None or not skeleton.unique_names:
                return check_fit(self.canonical, [payload])
            key = (skeleton,)
        if self._fitted.get(key) is _MISSING:
            check_fit(self.canonical, [payload])
            self._fitted.put(key, header.kind)
        return header.kind

    def _routed(self, weights: Mapping[str, torch.Tensor], payload: Payload
                ) -> StagedRoutes | None:
        """Every sparse entry of a delta routed at once where the kernels run
        (``dte_codec.routes``); None where they do not, or give way to the reference.
        A payload decoded in one body on the weights' device is read from it
        (``Payload.flat``), with no per-entry tensors."""
        local = self._local(weights)
        device = local.device
        if device is None or not fused(device):
            return None
        # a decode's queued checks are read with the routes' summary: one synchronization
        checks = payload.checks
        flat = payload.unchecked_flat()
        if flat is not None and flat.body.device == device:
            sparse = SparseEntries.of_flat(flat)
        else:
            checks = None  # read here, before the entries' tensors are made
            sparse = SparseEntries.of_tensors(
                [(entry, where, sections) for entry, where, sections in
                 zip(payload.header.entries, payload.indices, payload.values)
                 if not isinstance(where, Box)], device)
        if sparse is None or not sparse.names:
            return None
        routes = self._routes_on(device, weights)
        return stage_routed(routes, weights, sparse, targets=local.targets(routes, weights),
                            checks=checks)

    def _routes_on(self, device: torch.device, weights: Mapping[str, torch.Tensor]) -> Routes:
        """The plan as device tables on ``device`` (``weights``' item sizes), built once."""
        routes = self._routes.get(device)
        if routes is None:
            routes = self._routes[device] = Routes.of(
                self.transfers, {n: tuple(t.shape) for n, t in self.canonical.items()},
                {n: t.dtype for n, t in self.canonical.items()}, weights, device)
        return routes

    def _cuts(self, name: str, box: Box) -> tuple[tuple[str, Box, Box], ...]:
        """Where the box ``box`` of sender tensor ``name`` lands: per local box it
        overlaps, (local tensor, the part inside ``box``, the local box). Computed once
        per (tensor, box): a full version brings the same boxes every time."""
        key = (name, box)
        cuts = self._cut_cache.get(key)
        if cuts is None:
            cuts = []
            for piece in self.pieces[name]:
                common = piece.region.intersect(box)
                if common.numel:
                    cuts.append((piece.tensor,
                                 Box([c - b for c, b in zip(common.start, box.start)],
                                     common.size), piece.to_local(common)))
            cuts = self._cut_cache[key] = tuple(cuts)
        return cuts

    def _boxes(self, weights: Mapping[str, torch.Tensor], entry: Entry, box: Box,
               raw: torch.Tensor, *, keep_undo: bool) -> list[Staged]:
        cuts = self._cuts(entry.name, box)
        if not cuts:
            return []
        values = raw.to(weights[cuts[0][0]].device).view(entry.dtype).view(box.size)
        return [Staged(tensor, weights[tensor], local,
                       values[inside.slices()].reshape(local.size), keep_undo=keep_undo)
                for tensor, inside, local in cuts]

    def _copied(self, weights: Mapping[str, torch.Tensor], payload: Payload
                ) -> StagedCopies | None:
        """The box entries of a full version as one ``StagedCopies`` where the kernels
        run; None where the reference writes them (``_boxes``). Per payload only the
        sections' devices and addresses are read: the plan is kept per table and regions
        (and alignment) while the local tensors keep their layout (``_Local``)."""
        local = self._local(weights)
        device = local.device
        if device is None or not payload.values or not fused(device):
            return None
        raws = tuple(sections[0] for sections in payload.values)
        if {raw.get_device() for raw in raws} != {-1 if device.index is None else device.index}:
            return None
        addresses = tuple(map(torch.Tensor.data_ptr, raws))
        aligned = local.aligned and not any(a % WORD_BYTES for a in addresses)
        entries = payload.header.entries
        if not aligned and any(a % entry.dtype.itemsize for entry, a in zip(entries, addresses)):
            return None
        key = (entries, payload.indices, device, aligned)
        plan = self._plans.get(key)
        if plan is _MISSING:
            # what a plan rests on, checked once per set of entries: the sections' sizes
            # follow from the entries' boxes and dtypes, which check_fit has fixed
            plan = self._copy_plan(weights, entries, payload.indices, raws, device, aligned)
            self._plans.put(key, plan)
        return None if plan is None else StagedCopies(plan, raws, weights)

    def _local(self, weights: Mapping[str, torch.Tensor]) -> _Local:
        """The local tensors as this payload finds them; the copy plans and routes are
        dropped when their names, shapes, dtypes or strides change (a tensor replaced,
        resized or retyped), the device table of their addresses when an address changes
        (a tensor replaced or re-allocated). The kernels write row-major tensors: with a
        strided one among them there is no device, and the reference writes."""
        tensors = tuple(weights.values())
        # per tensor one C call per property, no Python frame: 290 tensors per delta
        layout = (tuple(weights), tuple(map(_SHAPE, tensors)),
                  tuple(map(torch.Tensor.stride, tensors)), tuple(map(_DTYPE, tensors)))
        addresses = tuple(map(torch.Tensor.data_ptr, tensors))
        held = self._held[0] if self._held else None
        if held is None or held.layout != layout or held.addresses != addresses:
            if held is not None and held.layout != layout:
                self._plans.clear()
                self._routes.clear()
            devices = {t.device for t in tensors}
            row_major = all(map(torch.Tensor.is_contiguous, tensors))
            held = _Local(layout, addresses,
                          devices.pop() if len(devices) == 1 and row_major else None,
                          not any(a % WORD_BYTES for a in addresses))
            self._held[:] = [held]
        return held

    def _copy_plan(self, weights: Mapping[str, torch.Tensor], entries: tuple[Entry, ...],
                   boxes: tuple[torch.Tensor | Box, ...], raws: tuple[torch.Tensor, ...],
                   device: torch.device, aligned: bool) -> CopyPlan | None:
        """The copy plan of ``entries`` covering ``boxes``; None where the reference must
        copy (a section of another size, a local tensor of another dtype, a cut the
        kernel cannot take). Every entry of a full version is a box: a full header holds
        only dense and box entries (``Entry.validate``), whose elements ``check_fit``
        has counted."""
        if any(raw.numel() != box.numel * entry.dtype.itemsize
               or any(weights[t].dtype != entry.dtype for t, _, _ in self._cuts(entry.name, box))
               for entry, box, raw in zip(entries, boxes, raws)):
            return None
        cuts = [Cut(k, tensor, inside, box.size, local, tuple(weights[tensor].shape))
                for k, (entry, box) in enumerate(zip(entries, boxes))
                for tensor, inside, local in self._cuts(entry.name, box)]
        return CopyPlan.of(cuts, {n: t.element_size() for n, t in weights.items()}, device,
                           aligned=aligned)


@attrs.define(eq=False)
class _Local:
    """The local tensors as one payload found them: what a copy plan rests on (names,
    shapes, strides, dtypes, the device), their addresses, and whether they all start on
    a word."""

    layout: tuple[tuple[str, ...], tuple[torch.Size, ...], tuple[tuple[int, ...], ...],
                  tuple[torch.dtype, ...]]
    addresses: tuple[int, ...]
    device: torch.device | None
    """Where every local tensor lives; None when there are none or several devices."""
    aligned: bool
    _targets: torch.Tensor | None = None

    def targets(self, routes: Routes, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``routes.target_addresses(weights)``, made once: a ``_Local`` lives while the
        addresses stay, and the routes of its device while the layout does."""
        if self._targets is None:
            self._targets = routes.target_addresses(weights)
        return self._targets


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_MISSING = object()


@attrs.define
class _Recent:
    """The values of the last ``PLANS`` keys (tuples), the oldest leaving first. The
    last key found is also matched by the identity of its parts, hashing nothing: a
    stream's full versions decode to the same table and regions objects every time."""

    _items: dict[tuple, object] = attrs.field(factory=dict)
    _last: tuple[tuple, object] | None = None

    def get(self, key: tuple) -> object:
        """The value under ``key``, or ``_MISSING``."""
        if self._last is not None and len(key) == len(self._last[0]) and all(
                map(operator.is_, key, self._last[0])):
            return self._last[1]
        value = self._items.get(key, _MISSING)
        if value is not _MISSING:
            self._last = (key, value)
        return value

    def put(self, key: tuple, value: object) -> None:
        self._items[key] = value
        if len(self._items) > PLANS:
            self._items.pop(next(iter(self._items)))
        self._last = (key, value)

    def clear(self) -> None:
        self._items.clear()
        self._last = None
