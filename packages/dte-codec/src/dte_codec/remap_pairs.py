"""The device steps of ``batched_remap``: every (element, transfer) pair of all items
at once, reordered from group order to item order, checked, sorted where needed and cut
into per (item, target) outputs (steps 1 to 4 of ``batched_remap``).
"""

from __future__ import annotations

import functools

from typing import TYPE_CHECKING

import attrs
import torch

from .encodings import INDEX32_LIMIT
from .fields import exclusive, host_table, starts_of
from .remap import Remapped, check_range, out_of_range_flag, row_major_strides
from .remap_layout import (BLOCK_BASE, BLOCK_IN_ITEM_ORDER, BLOCK_IN_PAIR_ORDER, BLOCK_SEGMENT,
                           BLOCK_SEGMENT_START, ELEMENT_START, ELEMENTS, ITEM_ELEMENT_START,
                           ITEMS, MASK_START, SHAPE, SLOT_BASE, Group, ItemGeometry, RemapLayout,
                           Target)

if TYPE_CHECKING:
    from .batched_remap import RemapItem

_INT64 = torch.int64


@attrs.frozen
class _Pairs:
    """Every (element, slot) pair whose slot's source box holds the element, in the
    (group, slot, element) order ``nonzero`` leaves them in."""

    element: torch.Tensor
    item: torch.Tensor
    block: torch.Tensor
    """In (group, slot, item) order."""
    target_flat: torch.Tensor


def find_pairs(groups: list[Group], flat: torch.Tensor, layout: RemapLayout) -> _Pairs:
    mask = torch.empty(layout.group_mask_start[-1], dtype=torch.bool, device=flat.device)
    start = 0
    for g, group in enumerate(groups):
        view = mask[layout.group_mask_start[g]:layout.group_mask_start[g + 1]]
        _select(group, flat[start:start + group.elements],
                view.view(len(group.geometry.transfers), group.elements))
        start += group.elements
    at = mask.nonzero().view(-1)  # host synchronization 1
    g = torch.searchsorted(layout.groups[MASK_START], at, right=True) - 1

    def per_group(row: int) -> torch.Tensor:
        return layout.groups[row].index_select(0, g)

    rest = at - per_group(MASK_START)
    elements = per_group(ELEMENTS)
    slot = rest // elements
    element = rest - slot * elements + per_group(ELEMENT_START)
    item = torch.searchsorted(layout.items[ITEM_ELEMENT_START], element, right=True) - 1
    block = per_group(BLOCK_BASE) + slot * per_group(ITEMS) + item
    source = flat.index_select(0, element)
    global_slot = per_group(SLOT_BASE) + slot
    target = layout.slots[0].index_select(0, global_slot)
    for d in range(layout.dims):
        coord = (source // per_group(SHAPE + d)) % per_group(SHAPE + layout.dims + d)
        target += coord * layout.slots[1 + d].index_select(0, global_slot)
    return _Pairs(element=element, item=item, block=block, target_flat=target)


def _select(group: Group, indices: torch.Tensor, out: torch.Tensor) -> None:
    """Write into ``out`` (slots x elements) whether each slot's source box holds each of
    the group's elements; only dimensions that some box does not span are compared."""
    if group.elements == 0:
        return
    shape = group.geometry.signature[0]
    transfers = group.geometry.transfers
    mask = None
    for d, (stride, size) in enumerate(zip(row_major_strides(shape), shape)):
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


def reorder(pairs: _Pairs, layout: RemapLayout) -> tuple[_Keyed, torch.Tensor]:
    """Pairs from (group, slot, item) block order to (item, slot) block order, and the
    size of each block in the new order. A block's pairs are consecutive in both orders
    and keep their order, so each pair moves by its block's new start minus its old
    start; ``nonzero`` left the blocks sorted, so the old starts are a search."""
    blocks = layout.blocks
    count = blocks.shape[1]
    old_start = torch.searchsorted(pairs.block, torch.arange(count + 1, device=blocks.device))
    old_sizes = old_start[1:] - old_start[:-1]
    new_sizes = old_sizes.index_select(0, blocks[BLOCK_IN_PAIR_ORDER])
    new_start = starts_of(new_sizes)
    item_block = blocks[BLOCK_IN_ITEM_ORDER].index_select(0, pairs.block)
    n = pairs.element.numel()
    dest = (new_start.index_select(0, item_block) + torch.arange(n, device=blocks.device)
            - old_start.index_select(0, pairs.block))
    position = pairs.element - layout.items[ITEM_ELEMENT_START].index_select(0, pairs.item)
    key = pairs.target_flat + blocks[BLOCK_SEGMENT_START].index_select(0, item_block)
    moved = [torch.empty_like(t).index_copy_(0, dest, t)
             for t in (pairs.target_flat, position, key, pairs.item)]
    return _Keyed(*moved), new_sizes


def out_of_range_any(groups: list[Group], flat: torch.Tensor) -> torch.Tensor:
    """A ``(1,)`` int64 flag, no host synchronization: some index lies outside its
    tensor. The items of a group share their shape, so one range per group."""
    flags, start = [torch.zeros((), dtype=torch.bool, device=flat.device)], 0
    for group in groups:
        flags.append(out_of_range_flag(flat[start:start + group.elements],
                                       group.geometry.signature[0]))
        start += group.elements
    return torch.stack(flags).any().view(1).to(_INT64)


def split_pairs(keyed: _Keyed, block_sizes: torch.Tensor, out_of_range: torch.Tensor,
                layout: RemapLayout, items: list[RemapItem],
                geometries: list[ItemGeometry]) -> list[dict[Target, Remapped]]:
    """Check, sort where needed and cut the pairs into per (item, target) views."""
    device = out_of_range.device
    segment_sizes = torch.zeros(len(layout.segments), dtype=_INT64, device=device)
    segment_sizes.index_add_(0, layout.blocks[BLOCK_SEGMENT], block_sizes)
    # host synchronization 2
    summary = torch.cat([out_of_range, _descents(keyed, layout), segment_sizes]).tolist()
    if summary[0]:
        for item in items:
            check_range(item.indices, item.source_shape, item.tensor)
    n_items = len(items)
    sizes = summary[1 + n_items:]
    starts = exclusive(sizes) + [sum(sizes)]
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


def _descents(keyed: _Keyed, layout: RemapLayout) -> torch.Tensor:
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
    table = host_table([[s - e for s, e in zip(starts, exclusive(sizes))], sizes], device)
    total = sum(sizes)
    run = torch.repeat_interleave(table[0], table[1], output_size=total)
    at = run + torch.arange(total, device=device)
    source = at.index_select(0, torch.argsort(keyed.key.index_select(0, at)))
    for t in (keyed.target_flat, keyed.position, keyed.key):
        t.index_copy_(0, at, t.index_select(0, source))
