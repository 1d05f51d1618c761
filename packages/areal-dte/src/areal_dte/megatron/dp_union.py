"""The change sets of a param whose fp32 master is sharded over the data-parallel ranks.

Megatron's ``DistributedOptimizer`` gives each DP rank a disjoint range of every param's
elements, so each rank's detector knows only the changes inside its range. After the
optimizer step every rank holds the whole new param (the param all-gather), and the
sender needs the whole change set. This gathers indices and old-value bounds, never the
weights: one all-gather of the per-param counts, then the indices and bounds packed as
int64 in windows of at most ``window_bytes`` over all ranks (``DTE_INVERSION_ALLREDUCE_WINDOW_MB``),
so the in-flight buffer stays bounded whatever the change rate. Every rank must call it
with the same param names in the same order (the model's), as with any collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from dte_detector import ChangeSet
from dte_detector.changes import int_bits

WINDOW_BYTES = 512 * 2**20
"""Default in-flight window, the seed's ``DTE_INVERSION_ALLREDUCE_WINDOW_MB=512``."""
_FIELDS = 3
"""Per changed element: its index and the bit patterns of its two bounds, as int64."""


def union_over_dp(changes: Mapping[str, ChangeSet], group: dist.ProcessGroup | None, *,
                  window_bytes: int = WINDOW_BYTES) -> dict[str, ChangeSet]:
    """Every rank's ``changes`` of each param merged into one sorted change set.

    Args:
        changes: this rank's change sets, flat indices into the whole param, by name.
        group: the data-parallel group (ranks holding disjoint ranges of the params).
        window_bytes: upper bound on the bytes gathered at once (all ranks together); a
            param larger than that goes alone.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return dict(changes)
    names = list(changes)
    device = next((c.indices.device for c in changes.values()), torch.device("cpu"))
    counts = torch.tensor([len(changes[n]) for n in names], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts, group=group)
    table = torch.stack(gathered).tolist()  # [rank][param]: the one host synchronisation
    merged: dict[str, ChangeSet] = {}
    for window in _windows(names, table, window_bytes):
        merged.update(_gather_window(changes, window, table, group, device))
    return merged


def _windows(names: Sequence[str], table: list[list[int]], limit: int) -> list[list[int]]:
    windows, current, size = [], [], 0
    for i in range(len(names)):
        need = sum(row[i] for row in table) * _FIELDS * 8
        if current and size + need > limit:
            windows.append(current)
            current, size = [], 0
        current.append(i)
        size += need
    return windows + ([current] if current else [])


def _pack(change: ChangeSet) -> torch.Tensor:
    return torch.stack([change.indices.to(torch.int64), int_bits(change.base_low).to(torch.int64),
                        int_bits(change.base_high).to(torch.int64)]).reshape(-1)


def _gather_window(changes: Mapping[str, ChangeSet], window: list[int],
                   table: list[list[int]], group, device) -> dict[str, ChangeSet]:
    names = list(changes)
    local = [changes[names[i]] for i in window]
    lengths = [sum(row[i] for i in window) * _FIELDS for row in table]
    buffer = torch.zeros(max(lengths), dtype=torch.int64, device=device)
    packed = [_pack(c) for c in local]
    if packed:
        flat = torch.cat(packed)
        buffer[:flat.numel()] = flat
    received = [torch.empty_like(buffer) for _ in table]
    dist.all_gather(received, buffer, group=group)
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in window}
    for row, data in zip(table, received):
        offset = 0
        for i in window:
            width = row[i] * _FIELDS
            parts[i].append(data[offset:offset + width].view(_FIELDS, row[i]))
            offset += width
    out = {}
    for i in window:
        name, like = names[i], changes[names[i]]
        joined = torch.cat(parts[i], dim=1)
        order = torch.argsort(joined[0])
        index, low, high = joined[:, order]
        bits = int_bits(like.base_low).dtype
        out[name] = ChangeSet(index.to(like.indices.dtype), low.to(bits).view(like.base_low.dtype),
                              high.to(bits).view(like.base_high.dtype))
    return out
