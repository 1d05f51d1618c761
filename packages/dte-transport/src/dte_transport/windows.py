"""A full version cut into bounded windows, so that no side ever holds the whole model.

A trainer's transfers to one rollout rank are cut along their first dimension of more
than one element into boxes of at most ``limit`` bytes (a box never smaller than one
such row), and the boxes are grouped in plan order into windows of at most ``limit``
bytes. Window ``k`` of every (trainer, rollout) pair travels in round ``k`` as its own
full frame with its own digests; a rollout rank checks and writes each window as it
comes (``dte_codec.apply.prepare_window``) and checks coverage after the last
(``check_covered``). A window's boxes are built only in its round, so the sender copies
at most one window of non-contiguous boxes at a time, and the full frames' other
segments are views of the weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import attrs
import torch
from dte_codec.geometry import Transfer
from dte_codec.region import Box

DEFAULT_WINDOW_BYTES = 256 * 2**20
"""Bytes of one window of a full version per (trainer, rollout) pair."""


def windows(plan: Mapping[str, Sequence[Transfer]], weights: Mapping[str, torch.Tensor],
            rank: int, limit: int) -> list[list[tuple[str, Transfer]]]:
    """The windows of the transfers to rollout ``rank``: per window, (source tensor name,
    transfer of at most ``limit`` bytes or one row) pairs, in plan order; at least one
    window, empty when nothing goes to that rank."""
    out: list[list[tuple[str, Transfer]]] = []
    size = 0
    for name, tensor in weights.items():
        for transfer in plan.get(name, ()):
            if transfer.target_rank != rank:
                continue
            for piece in _cut(transfer, tensor.element_size(), limit):
                nbytes = piece.target_box.numel * tensor.element_size()
                if not out or size + nbytes > limit:
                    out.append([])
                    size = 0
                out[-1].append((name, piece))
                size += nbytes
    return out or [[]]  # an empty window still tells the rank the version


def _cut(transfer: Transfer, itemsize: int, limit: int) -> Iterator[Transfer]:
    """``transfer`` in row blocks of at most ``limit`` bytes along the first dimension of
    more than one element (source and target boxes hold the same elements in the same
    order, so their first such dimensions correspond)."""
    source, target = transfer.source_box, transfer.target_box
    if target.numel * itemsize <= limit or not target.squeezed:
        yield transfer
        return
    s_axis = next(d for d, n in enumerate(source.size) if n > 1)
    t_axis = next(d for d, n in enumerate(target.size) if n > 1)
    rows = target.size[t_axis]
    per_row = target.numel // rows * itemsize
    step = max(1, limit // per_row)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        yield attrs.evolve(transfer, source_box=_rows(source, s_axis, first, count),
                           target_box=_rows(target, t_axis, first, count))


def _rows(box: Box, axis: int, first: int, count: int) -> Box:
    start, size = list(box.start), list(box.size)
    start[axis] += first
    size[axis] = count
    return Box(tuple(start), tuple(size))
