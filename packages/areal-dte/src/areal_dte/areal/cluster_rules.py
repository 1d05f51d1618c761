"""What the AReaL cluster mode can run with the delta path on, checked before any worker starts.

The actor side in cluster mode (`megatron_actor`) today:

- finds changed elements with the snapshot detector, on host copies of the Hugging
  Face-named tensors that AReaL's own weight-update walk produces. ``adamw`` needs the
  sharded moments of Megatron's DistributedOptimizer and ``cast`` a hook on its
  master-to-model copy; neither is wired into AReaL's Megatron engine yet;
- is called through the engine's ``update_weights``, which only AReaL's v1 train controller
  does (v2 delivers weights through AWEX alone), and sends over AReaL's xccl
  weight-update group;
- builds one payload per version, for the whole model, on the single pipeline head;
- has no rollout weight digests, sync-stream recovery or deterministic rollout yet.

Each of these is a `Requirement`: a setting outside it raises `ClusterModeError` naming the
key, the value and the fix. A setting that only tunes a path cluster mode does not take
logs a warning instead. With the delta path off nothing here applies: AReaL's own
full-weight path runs.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import attrs
from dte_config import DeltaConfig, DeltaMethod
from dte_config.delta import ACTOR, DIAGNOSTICS, PERFORMANCE, setting_values
from dte_config.errors import show
from dte_config.rl import lookup

from ..areal_import import areal_module
from ..errors import ClusterModeError

__all__ = ["XCCL", "check_areal", "check_delta"]

log = logging.getLogger(__name__)

OR_FULL = "or set actor.enable_delta_weight_update=false (AReaL's full-weight path)"
NOT_YET = "is not built for the AReaL cluster mode yet"
XCCL = "xccl"
"""AReaL's weight-update type whose group the delta payloads ride."""


@attrs.frozen(kw_only=True)
class Requirement:
    """One setting, the values cluster mode runs with, and what to do otherwise."""

    key: str
    """Dotted key of the setting."""
    accepts: Callable[[Any], bool]
    """True for the values cluster mode runs with."""
    problem: str
    """Why other values cannot run."""
    fix: str
    """What to set instead."""

    def check(self, value: object) -> None:
        """Raise `ClusterModeError` unless `value` is accepted."""
        if not self.accepts(value):
            raise ClusterModeError(key=self.key, value=value, problem=self.problem, fix=self.fix)


def _diagnostic(name: str, what: str) -> Requirement:
    return Requirement(key=f"{DIAGNOSTICS}.{name}", accepts=operator.not_,
                       problem=f"{what} {NOT_YET}", fix=f"set {DIAGNOSTICS}.{name}=false")


def _controller_v1(section: str) -> Requirement:
    return Requirement(
        key=f"{section}._version", accepts=lambda version: version == "v1",
        problem="AReaL 1.0.4's v2 controllers deliver weights through AWEX alone and never "
                "call the actor engine's update_weights, where the delta path runs",
        fix=f"set {ACTOR}._version=v1 and rollout._version=v1, {OR_FULL}")


def _single_pipeline_stage(backend: str) -> bool:
    allocation = areal_module("areal.api.alloc_mode").ModelAllocation.from_str(backend)
    return allocation.parallel.pp_size == 1


DELTA_REQUIREMENTS = (
    Requirement(
        key=f"{ACTOR}.weight_update_delta_method",
        accepts=lambda method: method is DeltaMethod.SNAPSHOT,
        problem="cluster mode finds changes with the snapshot detector only; adamw needs "
                "the DistributedOptimizer's sharded moments and cast a hook on its "
                "master-to-model copy, neither wired into AReaL's Megatron engine yet",
        fix=f"set {ACTOR}.weight_update_delta_method=snapshot, {OR_FULL}",
    ),
    _diagnostic("weight_digests", "comparing rollout digests with the actor's"),
    _diagnostic("recovery", "resuming the sync stream from checkpoints"),
    _diagnostic("deterministic_rollout", "deterministic rollout"),
)
"""Delta settings cluster mode needs, read from the `DeltaConfig` (also in the workers)."""

AREAL_REQUIREMENTS = (
    _controller_v1(ACTOR),
    _controller_v1("rollout"),
    Requirement(
        key=f"{ACTOR}.weight_update_mode",
        accepts=lambda mode: mode == XCCL,
        problem=f"payloads travel over AReaL's {XCCL} weight-update group",
        fix=f"set {ACTOR}.weight_update_mode={XCCL}",
    ),
    Requirement(
        key=f"{ACTOR}.megatron.fp8_config",
        accepts=lambda fp8: fp8 is None,
        problem="the snapshot detector compares 2-, 4- and 8-byte elements, and FP8 "
                "weights are 1 byte",
        fix=f"set {ACTOR}.megatron.fp8_config=null, {OR_FULL}",
    ),
    Requirement(
        key=f"{ACTOR}.backend",
        accepts=_single_pipeline_stage,
        problem="a version's payload covers the whole model and is built on the actor's one "
                "pipeline head",
        fix="use one pipeline stage (p1) in actor.backend",
    ),
)
"""AReaL settings the delta path needs, read from AReaL's parsed ``GRPOConfig``."""

WITHOUT_EFFECT = {
    f"{PERFORMANCE}.p2p_coalesce": "a version travels as one broadcast, not as two-round P2P",
}
"""Tuning settings that change nothing in cluster mode, and why."""


def check_delta(delta: DeltaConfig) -> None:
    """Reject delta settings cluster mode cannot run; warn about ones without effect here.

    Raises:
        ClusterModeError: the first requirement broken (nothing when the path is off).
    """
    if not delta.enable_delta_weight_update:
        return
    values = setting_values(delta)
    for requirement in DELTA_REQUIREMENTS:
        requirement.check(values[requirement.key])
    defaults = setting_values(DeltaConfig())
    for key, reason in WITHOUT_EFFECT.items():
        if values[key] != defaults[key]:
            log.warning("%s=%s has no effect in cluster mode: %s", key, show(values[key]),
                        reason)


def check_areal(config: Any, delta: DeltaConfig) -> None:
    """`check_delta`, then the AReaL settings the delta path needs.

    Args:
        config: AReaL's ``GRPOConfig`` as AReaL parsed it (its defaults filled in).
        delta: the delta settings.

    Raises:
        ClusterModeError: the first requirement broken (nothing when the path is off).
    """
    check_delta(delta)
    if not delta.enable_delta_weight_update:
        return
    for requirement in AREAL_REQUIREMENTS:
        requirement.check(lookup(config, requirement.key))
