"""``remap`` for many source tensors at once, in a fixed number of torch ops.

``remap_flat`` gives, item by item, exactly what ``remap.remap`` gives (the same sorted
target indices, the same positions), but treats the indices of every item as one flat
space, so a sync costs the same handful of kernel launches and two host
synchronizations whether it touches one tensor or four hundred; ``remap_all`` takes
that path on a GPU and keeps ``remap`` (the reference) on the CPU:

1. Items whose plans have one geometry (source shape, boxes, affine maps: the same
   tensor of every layer) form a group. Per group, one ``(transfers, elements)`` mask
   says which transfer's source box holds each element; the masks of all groups are
   laid back to back and compacted by one ``nonzero`` (synchronization 1: its size).
2. Every (element, transfer) pair then gets its target flat index from per-group and
   per-transfer tables gathered by group and transfer, never a loop over tensors.
3. ``nonzero`` orders pairs by group, transfer, element; a segmented transpose (counts
   per block, two exclusive sums) reorders them by item, transfer, element without a
   sort. That is target order unless two transfers of one item interleave in the
   target's flat order; an item where that happens (or whose indices were not sorted) is
   found on the device and only its pairs are sorted.
4. One read back (synchronization 2) gets the range check, the items to sort and every
   (item, target) boundary; each output is a view of the flat outputs.

The group count is the number of distinct tensor geometries of a model (a few per
layer type), not the number of tensors, and the host work per item is table building.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Sequence

import attrs
import torch

from .fields import batched, host_table
from .geometry import Transfer
from .encodings import INDEX32_LIMIT
from .remap import (Remapped, _affine, _check_boxes, _check_index_type, _check_range,
                    _out_of_range, _strides, remap)

_INT64 = torch.int64
Target = tuple[int, str]


@attrs.frozen
class RemapItem:
    """One source tensor's changed ``indices`` (flat, unique) with its plan
    (``transfers``) and local shape, named ``tensor`` in errors."""

    transfers: tuple[Transfer, ...] = attrs.field(converter=tuple)
    source_shape: tuple[int, ...] = attrs.field(converter=tuple)
    indices: torch.Tensor
    tensor: str = ""


def remap_all(items: Sequence[RemapItem]) -> list[dict[Target, Remapped]]:
    """``remap.remap`` of every item: per item, per target of its plan (empty ones too),
    the sorted target indices and their positions in the item's ``indices``.

    Items on a GPU go through ``remap_flat`` together (per device); CPU items through
    ``remap`` one by one, which touches fewer and narrower temporaries and has no
    launches or synchronizations to save (the same rule as ``fields.batched``).

    Raises:
        GeometryError: as ``remap`` would for an item it rejects.
    """
    out: list[dict[Target, Remapped]] = [{} for _ in items]
    flat = [k for k, item in enumerate(items) if batched(item.indices.device)]
    for k, routed in zip(flat, remap_flat([items[k] for k in flat])):
        out[k] = routed
    for k, item in enumerate(items):
        if not batched(item.indices.device):
            out[k] = remap(item.transfers, item.source_shape, item.indices, tensor=item.tensor)
    return out


def remap_flat(items: Sequence[RemapItem]) -> list[dict[Target, Remapped]]:
    """What ``remap_all`` gives, every item through the flat path on any device (items
    on different devices: one pass per device).

    Raises:
        GeometryError: as ``remap`` would for an item it rejects.
    """
    for item in items:
        _check_index_type(item.indices, item.tensor)
        _check_boxes(item.transfers, item.source_shape, item.tensor)
    out: list[dict[Target, Remapped]] = [{} for _ in items]
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for k, item in enumerate(items):
        if item.transfers:
            by_device[item.indices.device].append(k)
        else:
            _check_range(item.indices, item.source_shape, item.tensor)
    for device, ks in by_device.items():
        for k, routed in zip(ks, _remap_on(device, [items[k] for k in ks])):
            out[k] = routed
    return out


@attrs.frozen
class _Geometry:
    """An item's plan with names stripped: transfers ordered as ``remap`` orders them
    (by target), each with the index of its target among the item's ``targets``."""

    signature: tuple
    transfers: tuple[Transfer, ...]
    targets: tuple[Target, ...]
    slot_target: tuple[int, ...]


@functools.lru_cache(maxsize=4096)
def _geometry(transfers: tuple[Transfer, ...], shape: tuple[int, ...]) -> _Geometry:
    ordered = tuple(sorted(transfers, key=lambda t: t.target))
    targets = tuple(sorted({t.target for t in ordered}))
    slot_target = tuple(targets.index(t.target) for t in ordered)
    signature = (shape, slot_target,
                 tuple((t.source_box, t.target_box, t.target_shape) for t in ordered))
    return _Geometry(signature, ordered, targets, slot_target)


@attrs.frozen
class _Group:
    """Items of one geometry, consecutive in the flat element space."""

    geometry: _Geometry
    items: list[int]
    elements: int


def _remap_on(device: torch.device, items: list[RemapItem]) -> list[dict[Target, Remapped]]:
    by_signature: dict[tuple, list[int]] = defaultdict(list)
    for k, item in enumerate(items):
        by_signature[_geometry(item.transfers, item.source_shape).signature].append(k)
    # Items are laid out group by group, so a group's elements are one slice.
    order = [k for ks in by_signature.values() for k in ks]
    ordered = [items[k] for k in order]
    geometries = [_geometry(item.transfers, item.source_shape) for item in ordered]
    groups, first = [], 0
    for ks in by_signature.values():
        groups.append(_Group(geometries[first], list(range(first, first + len(ks))),
                             sum(items[k].indices.numel() for k in ks)))
        first += len(ks)
    flat = torch.cat([item.indices.to(_INT64) for item in ordered])
    layout = _Layout.of(groups, geometries, [item.indices.numel() for item in ordered],
                        device)
    keyed, block_sizes = _reorder(_pairs(groups, flat, layout), layout)
    routed = _split(keyed, block_sizes, _out_of_range_any(groups, flat), layout, ordered,
                    geometries)
    out: list[dict[Target, Remapped]] = [{} for _ in items]
    for k, result in zip(order, routed):
        out[k] = result
    return out


# Rows of the per-group device table (then the strides, then the sizes of each
# right-aligned source dimension).
# _BLOCK_BASE: the group's first block in pair order, less its first item.
_MASK_START, _ELEMENTS, _ELEMENT_START, _ITEMS, _SLOT_BASE, _BLOCK_BASE, _SHAPE = range(7)
# The per-item table (one row); the per-block table (a block: one item and one transfer
# slot), indexed by block in (item, slot) order, except the last row, indexed by block
# in (group, slot, item) order, the order ``nonzero`` leaves pairs in.
_ITEM_ELEMENT_START = 0
_BLOCK_IN_PAIR_ORDER, _BLOCK_SEGMENT, _BLOCK_SEGMENT_START, _BLOCK_IN_ITEM_ORDER = range(4)


@attrs.frozen
class _Layout:
    """Host numbers of one call, items in flat order: where each group's mask lies, the
    (item, target) segments of the key space, and the device tables pairs gather from."""

    dims: int
    group_mask_start: list[int]
    segments: list[tuple[int, int]]
    """Per segment, (item, index of the target among the item's targets)."""
    segment_numel: list[int]
    item_first_segment: list[int]
    """Per item, its first segment (then the segment count)."""
    groups: torch.Tensor
    slots: torch.Tensor
    items: torch.Tensor
    blocks: torch.Tensor

    @classmethod
    def of(cls, groups: list[_Group], geometries: list[_Geometry], counts: list[int],
           device: torch.device) -> _Layout:
        dims = max(len(g.geometry.signature[0]) for g in groups)
        slots = [len(g.geometry.transfers) for g in groups]
        items = [len(g.items) for g in groups]
        elements = [g.elements for g in groups]
        mask = _exclusive([s * e for s, e in zip(slots, elements)])
        block_base = _exclusive([s * i for s, i in zip(slots, items)])
        group_rows = [mask, elements, _exclusive(elements), items, _exclusive(slots),
                      [b - g.items[0] for b, g in zip(block_base, groups)]]
        segments = _Segments.of(geometries)
        item_rows = [_exclusive(counts)]
        return cls(dims=dims, group_mask_start=mask + [mask[-1] + slots[-1] * elements[-1]],
                   segments=segments.ids, segment_numel=segments.numel,
                   item_first_segment=segments.first,
                   groups=host_table(group_rows + _shape_rows(groups, dims), device),
                   slots=host_table(_slot_rows(groups, dims), device),
                   items=host_table(item_rows, device),
                   blocks=host_table(_block_rows(groups, segments), device))


def _exclusive(sizes: list[int]) -> list[int]:
    """Where each of consecutive runs of ``sizes`` starts."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


@attrs.frozen
class _Segments:
    """The (item, target) segments of the key space, items in flat order, and per
    (item, slot) block its segment."""

    ids: list[tuple[int, int]]
    numel: list[int]
    first: list[int]
    block_segment: list[int]
    item_slot_base: list[int]

    @classmethod
    def of(cls, geometries: list[_Geometry]) -> _Segments:
        ids, numel, first, blocks, slot_base = [], [], [], [], []
        for k, geometry in enumerate(geometries):
            first.append(len(ids))
            slot_base.append(len(blocks))
            shapes = {t.target: t.target_shape for t in geometry.transfers}
            blocks += [len(ids) + s for s in geometry.slot_target]
            for t, target in enumerate(geometry.targets):
                ids.append((k, t))
                numel.append(math.prod(shapes[target]))
        first.append(len(ids))
        return cls(ids, numel, first, blocks, slot_base)


def _block_rows(groups: list[_Group], segments: _Segments) -> list[list[int]]:
    """The per-block table (see ``_BLOCK_IN_PAIR_ORDER``)."""
    in_pair_order = [0] * len(segments.block_segment)
    in_item_order = []
    for group in groups:
        for t in range(len(group.geometry.transfers)):
            for k in group.items:
                in_pair_order[segments.item_slot_base[k] + t] = len(in_item_order)
                in_item_order.append(segments.item_slot_base[k] + t)
    segment_start = _exclusive(segments.numel)
    return [in_pair_order, segments.block_segment,
            [segment_start[s] for s in segments.block_segment], in_item_order]



def _shape_rows(groups: list[_Group], dims: int) -> list[list[int]]:
    """Per group, the strides then the sizes of its source shape, right-aligned to
    ``dims`` (a missing leading dimension has size 1, so its coordinate is 0)."""
    strides, sizes = [[] for _ in range(dims)], [[] for _ in range(dims)]
    for group in groups:
        shape = group.geometry.signature[0]
        pad = dims - len(shape)
        for d, (stride, size) in enumerate(zip([1] * pad + _strides(shape),
                                               [1] * pad + list(shape))):
            strides[d].append(stride)
            sizes[d].append(size)
    return strides + sizes


def _slot_rows(groups: list[_Group], dims: int) -> list[list[int]]:
    """Per transfer slot of every group: its shift, then its weight per right-aligned
    dimension (target flat index = shift + sum_d coord_d * weight_d, ``remap._affine``)."""
    shift, weights = [], [[] for _ in range(dims)]
    for group in groups:
        pad = dims - len(group.geometry.signature[0])
        for transfer in group.geometry.transfers:
            s, w = _affine(transfer)
            shift.append(s)
            for d, value in enumerate([0] * pad + list(w)):
                weights[d].append(value)
    return [shift] + weights


@attrs.frozen
class _Pairs:
    """Every (element, slot) pair whose slot's source box holds the element, in the
    (group, slot, element) order ``nonzero`` leaves them in."""

    element: torch.Tensor
    item: torch.Tensor
    block: torch.Tensor
    """In (group, slot, item) order."""
    target_flat: torch.Tensor


def _pairs(groups: list[_Group], flat: torch.Tensor, layout: _Layout) -> _Pairs:
    mask = torch.empty(layout.group_mask_start[-1], dtype=torch.bool, device=flat.device)
    start = 0
    for g, group in enumerate(groups):
        view = mask[layout.group_mask_start[g]:layout.group_mask_start[g + 1]]
        _select(group, flat[start:start + group.elements],
                view.view(len(group.geometry.transfers), group.elements))
        start += group.elements
    at = mask.nonzero().view(-1)  # host synchronization 1
    g = torch.searchsorted(layout.groups[_MASK_START], at, right=True) - 1

    def per_group(row: int) -> torch.Tensor:
        return layout.groups[row].index_select(0, g)

    rest = at - per_group(_MASK_START)
    elements = per_group(_ELEMENTS)
    slot = rest // elements
    element = rest - slot * elements + per_group(_ELEMENT_START)
    item = torch.searchsorted(layout.items[_ITEM_ELEMENT_START], element, right=True) - 1
    block = per_group(_BLOCK_BASE) + slot * per_group(_ITEMS) + item
    source = flat.index_select(0, element)
    global_slot = per_group(_SLOT_BASE) + slot
    target = layout.slots[0].index_select(0, global_slot)
    for d in range(layout.dims):
        coord = (source // per_group(_SHAPE + d)) % per_group(_SHAPE + layout.dims + d)
        target += coord * layout.slots[1 + d].index_select(0, global_slot)
    return _Pairs(element=element, item=item, block=block, target_flat=target)


def _select(group: _Group, indices: torch.Tensor, out: torch.Tensor) -> None:
    """Write into ``out`` (slots x elements) whether each slot's source box holds each of
    the group's elements; only dimensions that some box does not span are compared."""
    if group.elements == 0:
        return
    shape = group.geometry.signature[0]
    transfers = group.geometry.transfers
    mask = None
    for d, (stride, size) in enumerate(zip(_strides(shape), shape)):
        low = [t.source_box.start[d] for t in transfers]
        high = [t.source_box.stop[d] for t in transfers]
        if max(low) == 0 and min(high) == size:
            continue
        coord = (indices // stride) % size
        bounds = _bounds(tuple(low), tuple(high), indices.device)
        inside = (coord >= bounds[0]) & (coord < bounds[1])
        mask = inside if mask is None else mask & inside
    if mask is None:
        out.fill_(True)
    else:
        out.copy_(mask)


@functools.lru_cache(maxsize=4096)
def _bounds(low: tuple[int, ...], high: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Per slot, its box's low and high in one dimension: a ``(2, slots, 1)`` tensor to
    compare against every element at once (built once per geometry and device)."""
    return host_table([list(low), list(high)], device)[:, :, None]


@attrs.frozen
class _Keyed:
    """Pairs in (item, slot, element) order: target flat index, position in the item's
    indices, sort key (the target flat index plus its segment's first key), item."""

    target_flat: torch.Tensor
    position: torch.Tensor
    key: torch.Tensor
    item: torch.Tensor


def _reorder(pairs: _Pairs, layout: _Layout) -> tuple[_Keyed, torch.Tensor]:
    """Pairs from (group, slot, item) block order to (item, slot) block order, and the
    size of each block in the new order. A block's pairs are consecutive in both orders
    and keep their order, so each pair moves by its block's new start minus its old
    start; ``nonzero`` left the blocks sorted, so the old starts are a search."""
    blocks = layout.blocks
    count = blocks.shape[1]
    old_start = torch.searchsorted(pairs.block, torch.arange(count + 1, device=blocks.device))
    old_sizes = old_start[1:] - old_start[:-1]
    new_sizes = old_sizes.index_select(0, blocks[_BLOCK_IN_PAIR_ORDER])
    new_start = torch.cumsum(new_sizes, 0) - new_sizes
    item_block = blocks[_BLOCK_IN_ITEM_ORDER].index_select(0, pairs.block)
    n = pairs.element.numel()
    dest = (new_start.index_select(0, item_block) + torch.arange(n, device=blocks.device)
            - old_start.index_select(0, pairs.block))
    position = pairs.element - layout.items[_ITEM_ELEMENT_START].index_select(0, pairs.item)
    key = pairs.target_flat + blocks[_BLOCK_SEGMENT_START].index_select(0, item_block)
    moved = [torch.empty_like(t).index_copy_(0, dest, t)
             for t in (pairs.target_flat, position, key, pairs.item)]
    return _Keyed(*moved), new_sizes


def _out_of_range_any(groups: list[_Group], flat: torch.Tensor) -> torch.Tensor:
    """A ``(1,)`` int64 flag, no host synchronization: some index lies outside its
    tensor. The items of a group share their shape, so one range per group."""
    flags, start = [torch.zeros((), dtype=torch.bool, device=flat.device)], 0
    for group in groups:
        flags.append(_out_of_range(flat[start:start + group.elements],
                                   group.geometry.signature[0]))
        start += group.elements
    return torch.stack(flags).any().view(1).to(_INT64)


def _split(keyed: _Keyed, block_sizes: torch.Tensor, out_of_range: torch.Tensor,
           layout: _Layout, items: list[RemapItem],
           geometries: list[_Geometry]) -> list[dict[Target, Remapped]]:
    """Check, sort where needed and cut the pairs into per (item, target) views."""
    device = out_of_range.device
    segment_sizes = torch.zeros(len(layout.segments), dtype=_INT64, device=device)
    segment_sizes.index_add_(0, layout.blocks[_BLOCK_SEGMENT], block_sizes)
    # host synchronization 2
    summary = torch.cat([out_of_range, _descents(keyed, layout), segment_sizes]).tolist()
    if summary[0]:
        for item in items:
            _check_range(item.indices, item.source_shape, item.tensor)
    n_items = len(items)
    sizes = summary[1 + n_items:]
    starts = _exclusive(sizes) + [sum(sizes)]
    item_starts = [starts[s] for s in layout.item_first_segment]
    unsorted = [k for k in range(n_items) if summary[1 + k]]
    if unsorted:
        _sort_items(keyed, [item_starts[k] for k in unsorted],
                    [item_starts[k + 1] - item_starts[k] for k in unsorted])
    small = keyed.target_flat.to(torch.int32)
    out: list[dict[Target, Remapped]] = [{} for _ in items]
    for s, (k, t) in enumerate(layout.segments):
        target = geometries[k].targets[t]
        part = slice(starts[s], starts[s + 1])
        indices = (small if layout.segment_numel[s] < INDEX32_LIMIT else keyed.target_flat)
        out[k][target] = Remapped(indices[part], keyed.position[part])
    return out


def _descents(keyed: _Keyed, layout: _Layout) -> torch.Tensor:
    """Per item, how many of its pairs have a key not above the one before (0: the
    item's outputs are sorted and unique). Pairs are grouped by item, so this is a
    difference of one prefix sum at each item's first and last pair."""
    items = layout.items.shape[1]
    descent = torch.zeros(keyed.key.numel() + 1, dtype=_INT64, device=keyed.key.device)
    if keyed.key.numel() > 1:
        descent[2:] = torch.cumsum(keyed.key[1:] <= keyed.key[:-1], 0)
    bounds = torch.searchsorted(keyed.item, torch.arange(items + 1, device=keyed.key.device))
    first, end = bounds[:-1], bounds[1:]
    # pair p > first of the item counts when it descends from p - 1: prefix[end] - prefix[first + 1]
    inner = descent.index_select(0, end) - descent.index_select(0, torch.minimum(first + 1, end))
    return inner


def _sort_items(keyed: _Keyed, starts: list[int], sizes: list[int]) -> None:
    """Sort, in place, the pairs of the items whose pairs run from ``starts`` (``sizes``
    long) by key. Keys of different items lie in disjoint, increasing ranges, so one
    sort of them all leaves every item inside its own run."""
    device = keyed.key.device
    table = host_table([[s - e for s, e in zip(starts, _exclusive(sizes))], sizes], device)
    total = sum(sizes)
    run = torch.repeat_interleave(table[0], table[1], output_size=total)
    at = run + torch.arange(total, device=device)
    source = at.index_select(0, torch.argsort(keyed.key.index_select(0, at)))
    for t in (keyed.target_flat, keyed.position, keyed.key):
        t.index_copy_(0, at, t.index_select(0, source))
