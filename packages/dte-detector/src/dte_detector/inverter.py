"""What an AdamW inversion over many tensors decides from their layout alone, kept from
one call to the next (``Inverter``, which ``steps.AdamWSteps`` holds across syncs).

Which tensors are empty or skipped, which go through the kernels and their groups
(``layout.py``) depend on the tensors' addresses, sizes and contiguity, on the payload
dtypes, on which tensors stepped and on which share a kernel configuration: read again
on every call, and what was decided is kept while they stay the same. The masters' and
moments' dtypes are checked on every call before anything else.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence

import torch

from . import dispatch, inversion, layout
from .changes import ChangeRun, ChangeSet
from .errors import PrecisionError, StateSizeError, StepGapError
from .inversion import GUARD_ULPS, AdamWStep

_EMPTY = "empty"
"""``layout.Layout.routes``: skipped tensors (no step since the reference) and empty ones."""


class Inverter:
    """``inversion.invert_runs`` for a caller that inverts the same tensors call after
    call (``steps.AdamWSteps``, each sync), with what their layout decides kept."""

    def __init__(self) -> None:
        self._kept: layout.Layout | None = None

    def runs(self, names: Sequence[str],
             states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             hypers: Sequence[AdamWStep], previous: Sequence[int],
             dtypes: Sequence[torch.dtype], *, guard_ulps: float = GUARD_ULPS
             ) -> tuple[list[ChangeSet | None], list[ChangeRun]]:
        """``inversion.invert_runs``: the same results, checks and errors."""
        flat = list(itertools.chain.from_iterable(states))
        moved = list(map(operator.sub, [hyper.step for hyper in hypers], previous))
        if (list(map(layout.DTYPE, flat)).count(torch.float32) != len(flat)
                or moved.count(1) + moved.count(0) != len(moved)):
            _raise_first(names, states, hypers, previous)
        # every dtype is fp32 here: only the payload dtypes can change a route
        kept = self._kept = layout.keep(
            self._kept, layout.signature(flat, moved, list(dtypes)),
            lambda: _routes(names, states, moved, dtypes), kinds=3)
        found: list[ChangeSet | None] = [None] * len(states)
        for at in kept.routes.get(_EMPTY, ()):
            found[at] = ChangeSet.empty(states[at][0], dtype=dtypes[at])
        for at in kept.routes.get(layout.REFERENCE, ()):
            p, m, v = states[at]
            # through the module: the reference is one function, wherever it is patched
            found[at] = inversion._invert_reference(
                p.detach().reshape(-1), m.detach().reshape(-1), v.detach().reshape(-1),
                hypers[at], dtypes[at], guard_ulps)
        runs: list[ChangeRun] = []
        for fused in kept.fused:
            runs += _invert_fused(fused, states, hypers, dtypes, guard_ulps)
        return found, runs


_STATE_FIELDS = ("master", "exp_avg", "exp_avg_sq")


def _raise_first(names: Sequence[str],
                 states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 hypers: Sequence[AdamWStep], previous: Sequence[int]) -> None:
    """The first tensor's error, in order (its precision before its step gap)."""
    fp32 = torch.float32
    for name, state, hyper, before in zip(names, states, hypers, previous):
        if state[0].dtype != fp32 or state[1].dtype != fp32 or state[2].dtype != fp32:
            at = next(k for k, t in enumerate(state) if t.dtype != fp32)
            raise PrecisionError(name, field=_STATE_FIELDS[at], got=state[at].dtype)
        if hyper.step != before + 1 and hyper.step != before:
            raise StepGapError(name, previous=before, current=hyper.step)
    raise AssertionError("a tensor that fails no check")


def _routes(names: Sequence[str],
            states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            moved: Sequence[int], dtypes: Sequence[torch.dtype]
            ) -> Iterator[torch.device | str]:
    """Per tensor, the device whose kernels invert it, or its torch route; a moment of
    another size than its master is refused (the reference would broadcast some)."""
    for name, (p, m, v), stepped, dtype in zip(names, states, moved, dtypes):
        for field, moment in zip(_STATE_FIELDS[1:], (m, v)):
            if moment.numel() != p.numel():
                raise StateSizeError(name, field=field, got=moment.numel(),
                                     expected=p.numel())
        if not stepped or not p.numel():
            yield _EMPTY
        elif dispatch.kernels_for(p, m, v, payload=dtype):
            yield p.device
        else:
            yield layout.REFERENCE


def _invert_fused(fused: layout.Fused,
                  states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  hypers: Sequence[AdamWStep], dtypes: Sequence[torch.dtype],
                  guard_ulps: float) -> list[ChangeRun]:
    """The runs of ``fused``'s members, keyed by their positions among ``states``."""
    from .inversion_kernel import configurations, invert
    members = fused.pick(states)
    if not fused.contiguous:
        members = [tuple(t.contiguous() for t in member) for member in members]
    found = invert(members, configurations(fused.pick(hypers), fused.pick(dtypes), guard_ulps),
                   fused)
    return found if fused.whole else [run.named(fused.positions) for run in found]
