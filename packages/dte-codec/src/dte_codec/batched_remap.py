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
The tables are built in ``remap_layout``; steps 1 to 4 run in ``remap_pairs``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import attrs
import torch

from .fields import batched
from .geometry import Transfer
from .remap import Remapped, check_boxes, check_index_type, check_range, remap
from .remap_layout import Group, RemapLayout, Target, item_geometry
from .remap_pairs import find_pairs, out_of_range_any, reorder, split_pairs


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
        check_index_type(item.indices, item.tensor)
        check_boxes(item.transfers, item.source_shape, item.tensor)
    out: list[dict[Target, Remapped]] = [{} for _ in items]
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for k, item in enumerate(items):
        if item.transfers:
            by_device[item.indices.device].append(k)
        else:
            check_range(item.indices, item.source_shape, item.tensor)
    for device, ks in by_device.items():
        for k, routed in zip(ks, _remap_on(device, [items[k] for k in ks])):
            out[k] = routed
    return out


def _remap_on(device: torch.device, items: list[RemapItem]) -> list[dict[Target, Remapped]]:
    by_signature: dict[tuple, list[int]] = defaultdict(list)
    for k, item in enumerate(items):
        by_signature[item_geometry(item.transfers, item.source_shape).signature].append(k)
    # Items are laid out group by group, so a group's elements are one slice.
    order = [k for ks in by_signature.values() for k in ks]
    ordered = [items[k] for k in order]
    geometries = [item_geometry(item.transfers, item.source_shape) for item in ordered]
    groups, first = [], 0
    for ks in by_signature.values():
        groups.append(Group(geometries[first], list(range(first, first + len(ks))),
                            sum(items[k].indices.numel() for k in ks)))
        first += len(ks)
    flat = torch.cat([item.indices.to(torch.int64) for item in ordered])
    layout = RemapLayout.of(groups, geometries, [item.indices.numel() for item in ordered],
                            device)
    keyed, block_sizes = reorder(find_pairs(groups, flat, layout), layout)
    routed = split_pairs(keyed, block_sizes, out_of_range_any(groups, flat), layout, ordered,
                         geometries)
    out: list[dict[Target, Remapped]] = [{} for _ in items]
    for k, result in zip(order, routed):
        out[k] = result
    return out
