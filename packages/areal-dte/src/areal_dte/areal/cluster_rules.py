"""What the AReaL cluster mode can run with the delta path on, checked before any worker starts.

Cluster mode runs on AReaL 1.0.4's v2 stack, the one the seed's config selects
(``_version: v2``): weights move over AReaL's awex weight-update group, each Megatron rank
sending the changes of its own shard, found inside Megatron's distributed optimizer by the
``adamw`` or ``cast`` detector (`areal_dte.megatron`). So cluster mode needs:

- the v2 controllers for the actor and the rollout (AReaL's v1 controllers send through its
  xccl broadcast, which carries no delta);
- a detector that works inside the optimizer: ``adamw`` or ``cast``, not ``snapshot``
  (a host copy of the model; ``snapshot_verification`` is the check that keeps one);
- 2-byte model weights: the detectors compare bf16 bits, FP8 weights are 1 byte.

Of the validation controls, weight digests, phase timing and snapshot verification run in
cluster mode (off by default); resuming the sync stream from checkpoints and the
deterministic rollout diagnostics belong to the embedded job. Each rule is a `Requirement`:
a setting outside it raises `ClusterModeError` naming the key, the value and the fix. With
the delta path off nothing here applies: AReaL's own full-weight path runs unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import attrs
from dte_config import DeltaConfig, DeltaMethod
from dte_config.delta import ACTOR, DIAGNOSTICS, setting_values
from dte_config.rl import lookup

from ..errors import ClusterModeError

__all__ = ["V2", "check_areal", "check_delta"]

OR_FULL = "or set actor.enable_delta_weight_update=false (AReaL's full-weight path)"
V2 = "v2"
"""AReaL's controller version whose weight updates go through awex."""
OPTIMIZER_METHODS = frozenset({DeltaMethod.ADAMW, DeltaMethod.CAST})
"""The detectors that run inside Megatron's distributed optimizer."""


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


def _embedded_only(name: str, what: str) -> Requirement:
    return Requirement(key=f"{DIAGNOSTICS}.{name}", accepts=operator.not_,
                       problem=f"{what} is a control of the embedded job, not of cluster mode",
                       fix=f"set {DIAGNOSTICS}.{name}=false")


def _controller_v2(section: str) -> Requirement:
    return Requirement(
        key=f"{section}._version", accepts=lambda version: version == V2,
        problem="cluster mode sends deltas over AReaL's awex weight-update group, which only "
                "the v2 controllers use (v1 broadcasts full weights over xccl)",
        fix=f"set {ACTOR}._version={V2} and rollout._version={V2}, {OR_FULL}")


DELTA_REQUIREMENTS = (
    Requirement(
        key=f"{ACTOR}.weight_update_delta_method",
        accepts=OPTIMIZER_METHODS.__contains__,
        problem="cluster mode finds changes inside Megatron's distributed optimizer (adamw or "
                "cast); the snapshot detector would keep a host copy of the model",
        fix=f"set {ACTOR}.weight_update_delta_method=adamw (or cast; "
            f"{DIAGNOSTICS}.snapshot_verification=true checks it against a snapshot), {OR_FULL}",
    ),
    _embedded_only("recovery", "resuming the sync stream from the app's checkpoints"),
    _embedded_only("deterministic_rollout", "the deterministic rollout comparison"),
)
"""Delta settings cluster mode needs, read from the `DeltaConfig` (also in the workers)."""

AREAL_REQUIREMENTS = (
    _controller_v2(ACTOR),
    _controller_v2("rollout"),
    Requirement(
        key=f"{ACTOR}.megatron.fp8_config",
        accepts=lambda fp8: fp8 is None,
        problem="the detectors compare the bits of 2-byte model weights, and FP8 weights "
                "are 1 byte",
        fix=f"set {ACTOR}.megatron.fp8_config=null, {OR_FULL}",
    ),
)
"""AReaL settings the delta path needs, read from AReaL's parsed ``GRPOConfig``."""


def check_delta(delta: DeltaConfig) -> None:
    """Reject delta settings cluster mode cannot run.

    Raises:
        ClusterModeError: the first requirement broken (nothing when the path is off).
    """
    if not delta.enable_delta_weight_update:
        return
    values = setting_values(delta)
    for requirement in DELTA_REQUIREMENTS:
        requirement.check(values[requirement.key])


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
