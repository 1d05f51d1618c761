"""The host side of ``batched_remap``: items' geometries, their groups, and the tables
(per group, per transfer slot, per item, per block) the device steps gather from.

Built once per call from the items' plans, in Python per item and per transfer (never per
element); ``remap_pairs`` reads them on the device.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from .fields import exclusive, host_table
from .geometry import Transfer
from .remap import affine_map, row_major_strides

Target = tuple[int, str]


@attrs.frozen
class ItemGeometry:
    """An item's plan with names stripped: transfers ordered as ``remap`` orders them
    (by target), each with the index of its target among the item's ``targets``."""

    signature: tuple
    transfers: tuple[Transfer, ...]
    targets: tuple[Target, ...]
    slot_target: tuple[int, ...]


@functools.lru_cache(maxsize=4096)
def item_geometry(transfers: tuple[Transfer, ...], shape: tuple[int, ...]) -> ItemGeometry:
    ordered = tuple(sorted(transfers, key=lambda t: t.target))
    targets = tuple(sorted({t.target for t in ordered}))
    slot_target = tuple(targets.index(t.target) for t in ordered)
    signature = (shape, slot_target,
                 tuple((t.source_box, t.target_box, t.target_shape) for t in ordered))
    return ItemGeometry(signature, ordered, targets, slot_target)


@attrs.frozen
class Group:
    """Items of one geometry, consecutive in the flat element space."""

    geometry: ItemGeometry
    items: list[int]
    elements: int


# Rows of the per-group device table (then the strides, then the sizes of each
# right-aligned source dimension).
# BLOCK_BASE: the group's first block in pair order, less its first item.
MASK_START, ELEMENTS, ELEMENT_START, ITEMS, SLOT_BASE, BLOCK_BASE, SHAPE = range(7)
# The per-item table (one row); the per-block table (a block: one item and one transfer
# slot), indexed by block in (item, slot) order, except the last row, indexed by block
# in (group, slot, item) order, the order ``nonzero`` leaves pairs in.
ITEM_ELEMENT_START = 0
BLOCK_IN_PAIR_ORDER, BLOCK_SEGMENT, BLOCK_SEGMENT_START, BLOCK_IN_ITEM_ORDER = range(4)


@attrs.frozen
class RemapLayout:
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
    def of(cls, groups: list[Group], geometries: list[ItemGeometry], counts: list[int],
           device: torch.device) -> RemapLayout:
        dims = max(len(g.geometry.signature[0]) for g in groups)
        slots = [len(g.geometry.transfers) for g in groups]
        items = [len(g.items) for g in groups]
        elements = [g.elements for g in groups]
        mask = exclusive([s * e for s, e in zip(slots, elements)])
        block_base = exclusive([s * i for s, i in zip(slots, items)])
        group_rows = [mask, elements, exclusive(elements), items, exclusive(slots),
                      [b - g.items[0] for b, g in zip(block_base, groups)]]
        segments = _Segments.of(geometries)
        item_rows = [exclusive(counts)]
        return cls(dims=dims, group_mask_start=mask + [mask[-1] + slots[-1] * elements[-1]],
                   segments=segments.ids, segment_numel=segments.numel,
                   item_first_segment=segments.first,
                   groups=host_table(group_rows + _shape_rows(groups, dims), device),
                   slots=host_table(_slot_rows(groups, dims), device),
                   items=host_table(item_rows, device),
                   blocks=host_table(_block_rows(groups, segments), device))


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
    def of(cls, geometries: list[ItemGeometry]) -> _Segments:
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


def _block_rows(groups: list[Group], segments: _Segments) -> list[list[int]]:
    """The per-block table (see ``BLOCK_IN_PAIR_ORDER``)."""
    in_pair_order = [0] * len(segments.block_segment)
    in_item_order = []
    for group in groups:
        for t in range(len(group.geometry.transfers)):
            for k in group.items:
                in_pair_order[segments.item_slot_base[k] + t] = len(in_item_order)
                in_item_order.append(segments.item_slot_base[k] + t)
    segment_start = exclusive(segments.numel)
    return [in_pair_order, segments.block_segment,
            [segment_start[s] for s in segments.block_segment], in_item_order]



def _shape_rows(groups: list[Group], dims: int) -> list[list[int]]:
    """Per group, the strides then the sizes of its source shape, right-aligned to
    ``dims`` (a missing leading dimension has size 1, so its coordinate is 0)."""
    strides, sizes = [[] for _ in range(dims)], [[] for _ in range(dims)]
    for group in groups:
        shape = group.geometry.signature[0]
        pad = dims - len(shape)
        for d, (stride, size) in enumerate(zip([1] * pad + row_major_strides(shape),
                                               [1] * pad + list(shape))):
            strides[d].append(stride)
            sizes[d].append(size)
    return strides + sizes


def _slot_rows(groups: list[Group], dims: int) -> list[list[int]]:
    """Per transfer slot of every group: its shift, then its weight per right-aligned
    dimension (target flat index = shift + sum_d coord_d * weight_d, ``remap.affine_map``)."""
    shift, weights = [], [[] for _ in range(dims)]
    for group in groups:
        pad = dims - len(group.geometry.signature[0])
        for transfer in group.geometry.transfers:
            s, w = affine_map(transfer)
            shift.append(s)
            for d, value in enumerate([0] * pad + list(w)):
                weights[d].append(value)
    return [shift] + weights
