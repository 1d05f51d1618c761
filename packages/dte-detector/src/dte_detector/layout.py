"""What a detection over many tensors decides from their layout alone, kept from one call
to the next (``inverter.Inverter`` for the inversion, ``cast.CastDetector`` for the cast).

Which tensors go through the kernels (``dispatch``), and their groups and device tables
(``batch.plan``), depend only on the tensors' addresses, sizes, dtypes, contiguity and
devices, on which of them share a kernel configuration and on the kernels' tile size.
The caller reads the first ones again on every call, in a few C-level passes over the
tensors (``signature``: the Python in front of the first kernel launch is time the device
waits for), and what was decided is kept while they stay the same: a tensor replaced,
resized, re-typed or made non-contiguous, in place or not, changes them. A layout holds
no tensor of the caller's, so nothing of the caller's is kept alive between calls.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import attrs
import torch

from . import batch, dispatch

T = TypeVar("T")
DTYPE = operator.attrgetter("dtype")
REFERENCE = "reference"
"""``Layout.routes``: the tensors the torch reference takes."""


def signature(tensors: Sequence[torch.Tensor], *more: object) -> tuple:
    """What a layout of ``tensors`` (every tensor of a call, its kinds interleaved) depends
    on, in this order: their addresses, contiguity and sizes, whether the torch reference
    is forced and ``more`` (what else the caller's routes read). The devices
    follow from the addresses (CUDA's unified addressing gives each device and the host
    address ranges of their own); a caller whose routes read dtypes passes them."""
    return (list(map(torch.Tensor.data_ptr, tensors)),
            list(map(torch.Tensor.is_contiguous, tensors)),
            list(map(torch.Tensor.numel, tensors)), dispatch.forced(), *more)


@attrs.define(eq=False)
class Fused:
    """The tensors of one device that go through the kernels, and their last plan."""

    positions: list[int]
    """Their positions among the call's tensors, ascending."""
    whole: bool
    """Whether they are all of the call's tensors (then positions are their own keys)."""
    contiguous: bool
    """Whether all their tensors are contiguous (else each call copies, and plans anew)."""
    _plan: tuple[tuple[int, ...], int, list[batch.Group]] | None = None
    """The key ids, tile size and groups of the last call."""

    def pick(self, rows: Sequence[T]) -> Sequence[T]:
        """The members' entries of ``rows`` (one per tensor of the call), in order."""
        return rows if self.whole else [rows[at] for at in self.positions]

    def groups(self, members: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable], *,
               tile_elements: int) -> list[batch.Group]:
        """``batch.plan`` of ``members`` (``pick``'s, contiguous) by the partition of their
        ``keys``, kept while that partition and ``tile_elements`` stay the same."""
        ids = batch.key_ids(keys)
        plan = self._plan
        if (plan is None or plan[0] != ids or plan[1] != tile_elements
                or not self.contiguous):
            plan = self._plan = (ids, tile_elements,
                                 batch.plan(members, ids, tile_elements=tile_elements))
        return plan[2]


@attrs.frozen(eq=False)
class Layout:
    """What a detector decided for the tensors of one ``signature``."""

    signature: tuple
    routes: dict[str, list[int]]
    """Positions of the tensors the kernels do not take, by the caller's route name."""
    fused: list[Fused]
    """Per device, the tensors the kernels take."""


def keep(kept: Layout | None, found: tuple,
         routes: Callable[[], Iterable[torch.device | str]], *, kinds: int) -> Layout:
    """``kept`` if its signature is ``found``, else the layout of ``routes()``: per tensor
    of the call, the device whose kernels take it, or the name of the route that does
    (``kinds``: tensors per tensor of the call in ``signature``'s order)."""
    if kept is not None and kept.signature == found:
        return kept
    other: dict[str, list[int]] = {}
    fused: dict[torch.device, list[int]] = {}
    count = 0
    for at, route in enumerate(routes()):
        (fused if isinstance(route, torch.device) else other).setdefault(route, []).append(at)
        count += 1
    _, contiguous, *_ = found
    return Layout(found, other, [
        Fused(positions, len(positions) == count,
              all(contiguous[kinds * at + k] for at in positions for k in range(kinds)))
        for positions in fused.values()])
