"""What an AdamW inversion over many tensors decides from their layout alone, kept from
one call to the next (``Inverter``, which ``steps.AdamWSteps`` holds across syncs).

Which tensors go through the kernels (``dispatch``), and their groups and device tables
(``batch.plan``), depend only on the tensors' addresses, sizes, contiguity and devices,
on the payload dtypes, on which tensors stepped and on which share a kernel
configuration. Those are read again on every call, in a few C-level passes over the
tensors (the Python in front of the first kernel launch is time the device waits for),
and what was decided is kept while they stay the same: a tensor replaced, resized,
re-typed or made non-contiguous, in place or not, changes them. Nothing of the caller's
is kept alive between calls.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import attrs
import torch

from . import batch, dispatch, inversion
from .changes import ChangeRun, ChangeSet
from .errors import PrecisionError, StepGapError
from .inversion import GUARD_ULPS, AdamWStep


class Inverter:
    """``inversion.invert_runs`` for a caller that inverts the same tensors call after
    call (``steps.AdamWSteps``, each sync), with what their layout decides kept."""

    def __init__(self) -> None:
        self._kept: _Layout | None = None

    def runs(self, names: Sequence[str],
             states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             hypers: Sequence[AdamWStep], previous: Sequence[int],
             dtypes: Sequence[torch.dtype], *, guard_ulps: float = GUARD_ULPS
             ) -> tuple[list[ChangeSet | None], list[ChangeRun]]:
        """``inversion.invert_runs``: the same results, checks and errors."""
        flat = list(itertools.chain.from_iterable(states))
        moved = list(map(operator.sub, [hyper.step for hyper in hypers], previous))
        if (list(map(_DTYPE, flat)).count(torch.float32) != len(flat)
                or moved.count(1) + moved.count(0) != len(moved)):
            _raise_first(names, states, hypers, previous)
        # every dtype is fp32 here; the devices follow from the addresses (CUDA's unified
        # addressing gives each device and the host address ranges of their own)
        contiguous = list(map(torch.Tensor.is_contiguous, flat))
        signature = (list(map(torch.Tensor.data_ptr, flat)), contiguous,
                     list(map(torch.Tensor.numel, flat[::3])), moved, list(dtypes),
                     dispatch.forced())
        kept = self._kept
        if kept is None or kept.signature != signature:
            kept = self._kept = _Layout.of(states, moved, dtypes, contiguous, signature)
        found: list[ChangeSet | None] = [None] * len(states)
        for at in kept.empty:
            found[at] = ChangeSet.empty(states[at][0], dtype=dtypes[at])
        for at in kept.reference:
            p, m, v = states[at]
            # through the module: the reference is one function, wherever it is patched
            found[at] = inversion._invert_reference(
                p.detach().reshape(-1), m.detach().reshape(-1), v.detach().reshape(-1),
                hypers[at], dtypes[at], guard_ulps)
        runs: list[ChangeRun] = []
        for fused in kept.fused:
            runs += fused.invert(states, hypers, dtypes, guard_ulps)
        return found, runs


_DTYPE = operator.attrgetter("dtype")
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


@attrs.define(eq=False)
class _Fused:
    """The tensors of one device that go through the kernels, and their last plan (which
    holds no tensor of the caller's: nothing is kept alive between calls)."""

    positions: list[int]
    """Their positions among the call's tensors, ascending."""
    contiguous: bool
    """Whether all of them are contiguous (else each call copies, and plans anew)."""
    plan: tuple[tuple[int, ...], list] | None = None
    """The key ids and groups of the last call (another key partition plans anew)."""

    def invert(self, states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               hypers: Sequence[AdamWStep], dtypes: Sequence[torch.dtype],
               guard_ulps: float) -> list[ChangeRun]:
        """The members' runs, keyed by their positions among ``states``."""
        from .inversion_kernel import configurations, invert_planned, plan_groups
        positions = self.positions
        whole = len(positions) == len(states)  # then the runs' own keys are the positions
        members = states
        if not whole:
            members = [states[at] for at in positions]
            hypers = [hypers[at] for at in positions]
            dtypes = [dtypes[at] for at in positions]
        if not self.contiguous:
            members = [tuple(t.contiguous() for t in member) for member in members]
        keys = configurations(hypers, dtypes, guard_ulps)
        ids = batch.key_ids(keys)
        if self.plan is None or self.plan[0] != ids or not self.contiguous:
            self.plan = (ids, plan_groups(members, keys))
        found = invert_planned(members, keys, self.plan[1])
        return found if whole else [run.named(positions) for run in found]


@attrs.frozen(eq=False)
class _Layout:
    """What ``Inverter`` decided for the tensors of one ``signature``."""

    signature: tuple
    empty: list[int]
    """Skipped tensors (no step since the reference) and empty ones."""
    reference: list[int]
    """Tensors the torch reference inverts."""
    fused: list[_Fused]
    """Per device, the tensors the kernels invert."""

    @classmethod
    def of(cls, states: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
           moved: Sequence[int], dtypes: Sequence[torch.dtype], contiguous: Sequence[bool],
           signature: tuple) -> _Layout:
        """The layout of ``states`` (``contiguous``: per tensor of ``states``, flat, in
        order), kept under ``signature``."""
        empty, reference = [], []
        fused: dict[torch.device, list[int]] = {}
        for at, ((p, m, v), stepped, dtype) in enumerate(zip(states, moved, dtypes)):
            if not stepped or not p.numel():
                empty.append(at)
            elif dispatch.kernels_for(p, m, v, payload=dtype):
                fused.setdefault(p.device, []).append(at)
            else:
                reference.append(at)
        return cls(signature, empty, reference,
                   [_Fused(positions, all(contiguous[3 * at + k] for at in positions
                                          for k in range(3)))
                    for positions in fused.values()])
