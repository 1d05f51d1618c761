"""Trainer side for a plain torch loop: fp32 masters, a low-precision model copy, delta sync.

This is the single-process shape of what Megatron-core's mixed-precision optimizer does:
an optimizer updates fp32 master weights, and after each step the masters are cast into
the model's low-precision tensors, which are what the rollout needs. ``TorchActor`` owns
that cast, picks the detector and drives a ``dte_transport.Sender``.

The model copy is always the cast of the masters as of the last ``step`` or ``sync``.
What a detector cannot see turns the version into a full sync with its reason, never a
wrong delta: a loaded optimizer state, a write into a master outside the optimizer (for
``adamw``) or into the model copy (for all methods), a step gap or a step under
flush-to-zero (``adamw``). A full version re-casts every master first.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Mapping

import dte_codec
import torch
from dte_detector import CastDetector, ChangeSet, Snapshot, warm_up
from dte_detector.errors import PrecisionError
from dte_detector.steps import AdamWSteps
from dte_detector.torch_adamw import flush_to_zero
from dte_transport import Sender, SyncReport
from dte_transport.group import GroupSender

from .errors import MissedChangeError, UnknownParameterError
from .verification import check_changes
from .version_watch import VersionWatch

log = logging.getLogger(__name__)

STEP_GAP = "step_gap"
VERIFICATION_FAILED = "snapshot_verification_failed"
OPTIMIZER_LOADED = "optimizer_state_loaded"
MASTERS_WRITTEN = "master_written_outside_optimizer"
MODEL_WRITTEN = "model_copy_written_outside_step"
FLUSH_TO_ZERO = "flush_to_zero"


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
        masters: the fp32 parameters the optimizer updates, by name; one parameter may
            stand under several names (tied weights), each name gets its own copy.
        optimizer: a ``torch.optim`` optimizer over ``masters`` (AdamW for ``Method.ADAMW``).
        sender: delivers versions to the rollout side.
        method: how changes are detected.
        dtype: the model copy's dtype, i.e. what the rollout receives; a mapping gives
            it per tensor (e.g. an fp32 MoE router among bf16 weights).
        verify: snapshot verification: keep a copy of the last committed model and check
            every delta's change sets against it before sending; a failed check is logged
            as an error and the version goes out in full with reason
            ``VERIFICATION_FAILED``.

    Raises:
        PrecisionError: ``Method.ADAMW`` over a master that is not fp32.
    """

    def __init__(self, masters: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                 sender: Sender | GroupSender, *, method: Method,
                 dtype: torch.dtype | Mapping[str, torch.dtype] = torch.bfloat16,
                 verify: bool = False):
        self.masters = dict(masters)
        self.optimizer = optimizer
        self.sender = sender
        self.method = method
        if method == Method.ADAMW:
            for name, master in self.masters.items():
                if master.dtype != torch.float32:
                    raise PrecisionError(name, field="master", got=master.dtype)
        dtypes = dtype if isinstance(dtype, Mapping) else dict.fromkeys(self.masters, dtype)
        self.model = {name: p.detach().to(dtypes[name], copy=True)
                      for name, p in self.masters.items()}
        self._names: dict[int, list[str]] = {}
        for name, p in self.masters.items():
            self._names.setdefault(id(p), []).append(name)
        self._cast = CastDetector()
        self._snapshot = Snapshot()
        self._steps = AdamWSteps(lambda param: self._names.get(id(param), ()))
        self._verify = verify
        self._full_reason: str | None = None
        self._masters_seen = VersionWatch(self.masters)
        self._model_seen = VersionWatch(self.model)
        if method in (Method.ADAMW, Method.CAST):  # compile now, not in the first delta sync
            for device in {m.device for m in self.masters.values()}:
                warm_up(device, payloads=set(dtypes.values()))
        for device in {t.device for t in self.model.values()}:  # the codec's kernels too
            dte_codec.warm_up(device, payloads=set(dtypes.values()))
        if method == Method.ADAMW:  # the loaded steps are not the ones the rollout has seen
            optimizer.register_load_state_dict_post_hook(
                lambda _: self._needs_full(OPTIMIZER_LOADED))

    def step(self) -> None:
        """One optimizer step, then the cast of every master into the model copy.

        Raises:
            UnknownParameterError: the optimizer holds a parameter that is not a master
                (nothing was stepped).
        """
        self._check_parameters()
        self._outside_writes()
        adamw = self.method == Method.ADAMW
        if adamw and flush_to_zero() and any(m.device.type == "cpu"
                                             for m in self.masters.values()):
            self._needs_full(FLUSH_TO_ZERO)
        self.optimizer.step()
        if adamw:
            self._steps.record(self.optimizer)
        self._recast(self.masters, record=True)

    def sync(self, version: int) -> SyncReport:
        """Deliver the model copy as ``version`` and reset the detector on commit.

        Raises:
            UnknownParameterError: the optimizer holds a parameter that is not a master.
        """
        self._check_parameters()
        self._recast(self._outside_writes(), record=True)
        if self.sender.acknowledged is not None:
            reason = self._full_reason
            gap = self._steps.gap() if reason is None and self.method == Method.ADAMW else None
            if gap is not None:
                log.info("v%d: %s", version, gap)
                reason = STEP_GAP
            if reason is not None:
                log.warning("v%d: %s, syncing in full", version, reason)
                return self.sync_full(version, reason=reason)
        # Past the first version, every step since the commit went through ``step`` here
        # (anything else set a full reason above): the recorded step counts are the truth.
        recorded = self.sender.acknowledged is not None
        if self._full_due():  # a full version carries the masters as they are now
            self._recast(self.masters, record=False)
        try:
            report = self.sender.sync(self.model, version=version, changes=self._changes())
        except MissedChangeError as exc:
            log.error("v%d: snapshot verification failed, syncing in full: %s", version, exc)
            return self.sync_full(version, reason=f"{VERIFICATION_FAILED}: {exc}")
        self._committed(recorded=recorded)
        return report

    def sync_full(self, version: int, *, reason: str) -> SyncReport:
        """Deliver the masters, cast into the model copy, as ``version`` in full."""
        self._recast(self.masters, record=False)
        report = self.sender.sync_full(self.model, version=version, reason=reason)
        self._committed(recorded=False)
        return report

    def _full_due(self) -> bool:
        """The sender will send this version in full whatever the changes."""
        return self.sender.acknowledged is None or self.sender.anchor_due

    def _needs_full(self, reason: str) -> None:
        if self._full_reason is None:
            self._full_reason = reason

    def _check_parameters(self) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in self._names:
                    raise UnknownParameterError(tuple(param.shape), param.dtype)

    def _outside_writes(self) -> list[str]:
        """Note writes since the last cast; return the masters written outside the optimizer."""
        model = self._model_seen.moved()
        if model:  # the rollout holds what the copy held before: no detector knows that
            self._needs_full(f"{MODEL_WRITTEN}: tensor {model[0]!r}")
        masters = self._masters_seen.moved()
        if masters and self.method == Method.ADAMW:  # not one AdamW step: cannot be inverted
            self._needs_full(f"{MASTERS_WRITTEN}: tensor {masters[0]!r}")
        return masters

    def _recast(self, names: Iterable[str], *, record: bool) -> None:
        names = list(names)
        if record and self.method == Method.CAST:  # one fused pass over all of them on CUDA
            self._cast.record_and_copy_all(
                {name: (self.masters[name].detach(), self.model[name]) for name in names})
        else:
            copy_all([self.model[name] for name in names],
                     [self.masters[name].detach() for name in names])
        self._masters_seen.mark(names)
        self._model_seen.mark(names)

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
            return self._cast.changes_all(self.model)
        if self.method == Method.SNAPSHOT:
            return {n: self._snapshot.changes(n, t) for n, t in self.model.items()}
        return self._steps.changes_all(self.model)

    def _committed(self, *, recorded: bool) -> None:
        if self._verify or self.method == Method.SNAPSHOT:  # one copy serves both
            for name, tensor in self.model.items():
                self._snapshot.retain(name, tensor)
        if self.method == Method.ADAMW and recorded:
            self._steps.commit_recorded()
        elif self.method == Method.ADAMW:
            self._steps.commit([self.optimizer])
        elif self.method == Method.CAST:
            self._cast.clear()
        self._full_reason = None


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` for every pair: one multi-tensor launch per group of
    pairs on one device with one target and one source dtype (``torch._foreach_copy_``,
    the same elementwise cast as ``copy_``, bit for bit), instead of a launch per tensor.
    """
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources, strict=True):
        group = groups.setdefault((target.device, source.device, target.dtype, source.dtype),
                                  ([], []))
        group[0].append(target)
        group[1].append(source)
    for (target_device, source_device, _, _), (group_targets, group_sources) in groups.items():
        if target_device == source_device:
            torch._foreach_copy_(group_targets, group_sources)
        else:
            for target, source in zip(group_targets, group_sources):
                target.copy_(source)
