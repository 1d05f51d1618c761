"""Which AdamW step each tensor took since the last sync: what ``invert_adamw`` inverts.

A trainer may step several times between syncs while each tensor steps at most once (a
tensor without gradient is left alone by torch's AdamW, step count included), and the lr
or betas may change between those steps. So each tensor keeps the state of its own last
step, recorded right after an optimizer step only if its step count moved since what was
recorded (or, with nothing recorded, since the last commit). A tensor that stepped more
than once since the commit is a step gap: that version must go in full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from .changes import ChangeSet, FlatChanges
from .errors import StepGapError
from .inverter import Inverter
from .torch_adamw import AdamWState, torch_adamw_states


class AdamWSteps:
    """Per tensor name, its AdamW state after its last step since the last ``commit``.

    Args:
        names: the names one optimizer parameter is synced under (several for tied
            weights, none for a parameter the caller does not sync).
    """

    def __init__(self, names: Callable[[torch.Tensor], Sequence[str]]):
        self._names = names
        self._stepped: dict[str, AdamWState] = {}
        self._synced: dict[str, int] = {}
        self._inverter = Inverter()

    def record(self, optimizer: torch.optim.Optimizer) -> None:
        """Call right after ``optimizer.step()`` (before any lr scheduler step)."""
        for state in torch_adamw_states(optimizer):
            for name in self._names(state.param):
                last = self._stepped.get(name)
                seen = last.hyper.step if last is not None else self._synced.get(name, 0)
                if state.hyper.step != seen:
                    self._stepped[name] = state

    def gap(self) -> StepGapError | None:
        """The first tensor that took more than one step since the commit, if any."""
        for name, state in self._stepped.items():
            previous = self._synced.get(name, 0)
            if state.hyper.step != previous + 1:
                return StepGapError(name, previous=previous, current=state.hyper.step)
        return None

    def changes(self, name: str, model: torch.Tensor) -> ChangeSet:
        """The change set of ``model`` (the tensor in the payload dtype) since the commit.

        Raises:
            StepGapError: more than one step since the commit.
        """
        return self.changes_all({name: model})[name]

    def changes_all(self, models: Mapping[str, torch.Tensor]) -> FlatChanges:
        """``changes`` of every ``name: model``, inverted together (``inverter.Inverter``:
        what depends only on the tensors' layout is kept from the last call), in
        ``models``' order; the fused kernels' results stay in their flat runs.

        Raises:
            StepGapError: more than one step since the commit, for any of them.
        """
        stepped = {name: self._stepped[name] for name in models if name in self._stepped}
        synced = self._synced
        names = list(stepped)
        found, runs = self._inverter.runs(
            names, [(s.param, s.exp_avg, s.exp_avg_sq) for s in stepped.values()],
            [s.hyper for s in stepped.values()], [synced.get(name, 0) for name in stepped],
            [models[name].dtype for name in stepped])
        loose = {name: c for name, c in zip(names, found) if c is not None}
        loose.update((name, ChangeSet.empty(model)) for name, model in models.items()
                     if name not in stepped)  # not stepped
        return FlatChanges(tuple(models), [run.named(names) for run in runs], loose)

    def commit(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """A version was delivered: step counts from the optimizers themselves (a loaded
        state has steps this object never saw), nothing stepped since."""
        self._synced = {name: s.hyper.step for opt in optimizers
                        for s in torch_adamw_states(opt) for name in self._names(s.param)}
        self._stepped.clear()

    def commit_recorded(self) -> None:
        """A version was delivered, and every optimizer step since the last commit went
        through ``record`` (the caller knows: no loaded state, no step outside it): the
        step counts are the recorded ones, so nothing is read from the optimizers (fused
        AdamW keeps them on the device)."""
        self._synced.update((name, s.hyper.step) for name, s in self._stepped.items())
        self._stepped.clear()
