"""Trainer side for a plain torch loop: fp32 masters, a low-precision model copy, delta sync.

This is the single-process shape of what Megatron-core's mixed-precision optimizer does:
an optimizer updates fp32 master weights, and after each step the masters are cast into
the model's low-precision tensors, which are what the rollout needs. ``TorchActor`` owns
that cast, picks the detector and drives a ``dte_transport.Sender``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping

import torch
from dte_detector import CastDetector, ChangeSet, Snapshot, invert_adamw, torch_adamw_states
from dte_detector.errors import StepGapError
from dte_transport import Sender, SyncReport
from dte_transport.group import GroupSender

from .errors import MissedChangeError
from .verification import check_changes

log = logging.getLogger(__name__)

STEP_GAP = "step_gap"
VERIFICATION_FAILED = "snapshot_verification_failed"


class Method(enum.Enum):
    """How the changed elements of a version are found."""

    ADAMW = "adamw"
    """Invert the one AdamW step since the last sync (a step gap forces a full sync)."""
    CAST = "cast"
    """Exact dirty bits at the master -> model cast; any optimizer, any number of steps."""
    SNAPSHOT = "snapshot"
    """Bitwise diff against a retained copy of the model (costs a copy; verification)."""


class TorchActor:
    """Mixed-precision weights of a torch training loop, synced as deltas.

    Args:
        masters: the fp32 parameters the optimizer updates, by name.
        optimizer: a ``torch.optim`` optimizer over ``masters`` (AdamW for ``Method.ADAMW``).
        sender: delivers versions to the rollout side.
        method: how changes are detected.
        dtype: the model copy's dtype, i.e. what the rollout receives; a mapping gives
            it per tensor (e.g. an fp32 MoE router among bf16 weights).
        verify: snapshot verification: keep a copy of the last committed model and check
            every delta's change sets against it before sending; a failed check is logged
            as an error and the version goes out in full with reason
            ``VERIFICATION_FAILED``.
    """

    def __init__(self, masters: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                 sender: Sender | GroupSender, *, method: Method,
                 dtype: torch.dtype | Mapping[str, torch.dtype] = torch.bfloat16,
                 verify: bool = False):
        self.masters = dict(masters)
        self.optimizer = optimizer
        self.sender = sender
        self.method = method
        dtypes = dtype if isinstance(dtype, Mapping) else dict.fromkeys(self.masters, dtype)
        self.model = {name: p.detach().to(dtypes[name], copy=True)
                      for name, p in self.masters.items()}
        self._names = {id(p): name for name, p in self.masters.items()}
        self._cast = CastDetector()
        self._snapshot = Snapshot()
        self._hyper: dict[str, object] = {}
        self._synced_steps: dict[str, int] = {}
        self._verify = verify

    def step(self) -> None:
        """One optimizer step, then the cast of every master into the model copy."""
        self.optimizer.step()
        if self.method == Method.ADAMW:
            self._hyper = {self._names[id(s.param)]: s
                           for s in torch_adamw_states(self.optimizer)}
        for name, master in self.masters.items():
            if self.method == Method.CAST:
                self._cast.record(name, master, self.model[name])
            self.model[name].copy_(master.detach())

    def sync(self, version: int) -> SyncReport:
        """Deliver the model copy as ``version`` and reset the detector on commit."""
        if self.method == Method.ADAMW and self.sender.acknowledged is not None:
            gap = self._step_gap()
            if gap is not None:
                log.info("v%d: %s, syncing in full", version, gap)
                return self.sync_full(version, reason=STEP_GAP)
        try:
            report = self.sender.sync(self.model, version=version, changes=self._changes())
        except MissedChangeError as exc:
            log.error("v%d: snapshot verification failed, syncing in full: %s", version, exc)
            return self.sync_full(version, reason=f"{VERIFICATION_FAILED}: {exc}")
        self._committed()
        return report

    def sync_full(self, version: int, *, reason: str) -> SyncReport:
        """Deliver the model copy as ``version`` in full, for ``reason``."""
        report = self.sender.sync_full(self.model, version=version, reason=reason)
        self._committed()
        return report

    def _changes(self) -> Callable[[], Mapping[str, ChangeSet]]:
        if not self._verify:
            return self._detect

        def verified() -> Mapping[str, ChangeSet]:
            found = self._detect()
            check_changes(self._snapshot, self.model, found)
            return found
        return verified

    def _detect(self) -> Mapping[str, ChangeSet]:
        if self.method == Method.CAST:
            return {n: self._cast.changes(n, t) for n, t in self.model.items()}
        if self.method == Method.SNAPSHOT:
            return {n: self._snapshot.changes(n, t) for n, t in self.model.items()}
        return {n: self._invert(n) for n in self.model}

    def _invert(self, name: str) -> ChangeSet:
        state = self._hyper.get(name)
        if state is None:  # never stepped: unchanged since the start
            return ChangeSet.empty(self.model[name])
        return invert_adamw(name, state.param, state.exp_avg, state.exp_avg_sq, state.hyper,
                            previous_step=self._synced_steps.get(name, 0),
                            dtype=self.model[name].dtype)

    def _step_gap(self) -> StepGapError | None:
        for name in self.model:
            state = self._hyper.get(name)
            current = state.hyper.step if state is not None else 0
            previous = self._synced_steps.get(name, 0)
            if current not in (previous, previous + 1):
                return StepGapError(name, previous=previous, current=current)
        return None

    def _committed(self) -> None:
        if self._verify or self.method == Method.SNAPSHOT:  # one copy serves both
            for name, tensor in self.model.items():
                self._snapshot.retain(name, tensor)
        if self.method == Method.ADAMW:
            # From the optimizer, not the last step's capture: an optimizer whose state was
            # loaded (a resumed run) has steps this object never saw.
            self._synced_steps = {self._names[id(s.param)]: s.hyper.step
                                  for s in torch_adamw_states(self.optimizer)}
        elif self.method == Method.CAST:
            self._cast.clear()
