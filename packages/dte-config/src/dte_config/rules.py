"""Startup checks: the delta path against the surrounding RL config, before any GPU work.

`validate` does nothing beyond warnings while ``actor.enable_delta_weight_update`` is false;
the existing full-weight path then runs as before. When it is true, each requirement below
is checked in order and the first one broken is raised, naming the key, its value, the
delta setting that needs it, and the fix. Settings that have no effect in the chosen mode
log one warning each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from dte_config.delta import (
    ACTOR,
    DIAGNOSTICS,
    PERFORMANCE,
    DeltaConfig,
    DeltaMethod,
    setting_values,
)
from dte_config.env import ENV_NAMES, env_variables
from dte_config.errors import ConfigValidationError, show
from dte_config.rl import FLOAT32, RLConfig
from dte_config.run import RunConfig
from dte_config.structure import unknown_key
from dte_config.validators import key_of

__all__ = ["REQUIREMENTS", "Requirement", "validate"]

log = logging.getLogger(__name__)

ENABLE = f"{ACTOR}.enable_delta_weight_update"
METHOD = f"{ACTOR}.weight_update_delta_method"
SEPARATION = "separation"
ANY_METHOD = frozenset(DeltaMethod)
ADAMW_ONLY = frozenset({DeltaMethod.ADAMW})
TO_CAST = f" or {METHOD}=cast"
TO_OFF = f" or {ENABLE}=false"
INVERSION_SETTINGS = frozenset(
    f"{PERFORMANCE}.{name}"
    for name in (
        "streaming_reconstruct",
        "inversion_allreduce_window_mb",
        "inversion_compute_on_cpu",
    )
)
SNAPSHOT_VERIFICATION = f"{DIAGNOSTICS}.snapshot_verification"


def _always(_rl: RLConfig) -> bool:
    return True


def _as_is(value: object) -> object:
    return value


def _null(_value: object) -> None:
    return None


def _backend(name: str) -> Callable[[Any], bool]:
    return lambda value: value.split(":", 1)[0].strip().lower() == name


@attrs.frozen(kw_only=True)
class Requirement:
    """One setting of the RL run that the delta path needs, for some change detectors."""

    field: str = attrs.field(validator=attrs.validators.in_(attrs.fields_dict(RLConfig)))
    """The `RLConfig` attribute checked."""
    methods: frozenset[DeltaMethod] = attrs.field(
        default=ANY_METHOD, validator=attrs.validators.instance_of(frozenset)
    )
    """The change detectors that need it."""
    holds: Callable[[Any], bool] = attrs.field(validator=attrs.validators.is_callable())
    """True when the value is acceptable."""
    why: str = attrs.field(validator=attrs.validators.instance_of(str))
    """What the delta setting does that needs it, continuing ``<setting>=<value> ...``."""
    fix: str = attrs.field(validator=attrs.validators.instance_of(str))
    """What to set instead."""
    when: Callable[[RLConfig], bool] = attrs.field(
        default=_always, validator=attrs.validators.is_callable()
    )
    """Only checked when this holds for the whole RL config."""
    written: Callable[[Any], object] = attrs.field(
        default=_as_is, validator=attrs.validators.is_callable()
    )
    """The rejected value as the config spells it, for the message."""
    engine: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Names AReaL's engines (Megatron actor, SGLang rollout); skipped for an embedded run."""


def _precision(field: str, key: str) -> Requirement:
    return Requirement(
        field=field,
        methods=ADAMW_ONLY,
        holds=lambda value: value == FLOAT32,
        when=lambda rl: rl.use_precision_aware_optimizer,
        why="derives its guard band for fp32 master weights and moments",
        fix=f"set {key}=float32, actor.megatron.use_precision_aware_optimizer=false{TO_CAST}",
    )


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        field="rollout_scheduling_strategy",
        holds=lambda value: value == SEPARATION,
        why="needs the rollout on its own GPUs (separation)",
        fix=f"set rollout.scheduling_strategy.type=separation{TO_OFF}",
    ),
    Requirement(
        field="actor_backend",
        holds=_backend("megatron"),
        engine=True,
        why="needs a Megatron-core actor: it reads Megatron's optimizer and shard layout",
        fix=f"set actor.backend to a megatron: allocation such as megatron:d2p1t4{TO_OFF}",
    ),
    Requirement(
        field="rollout_backend",
        holds=_backend("sglang"),
        engine=True,
        why="needs an SGLang rollout: deltas are applied inside SGLang's workers",
        fix=f"set rollout.backend to an sglang: allocation such as sglang:d2t4p1{TO_OFF}",
    ),
    Requirement(
        field="actor_use_lora",
        holds=lambda value: not value,
        why="syncs full weights, not LoRA adapters",
        fix=f"set actor.use_lora=false{TO_OFF}",
    ),
    Requirement(
        field="rollout_use_lora",
        holds=lambda value: not value,
        why="syncs full weights, not LoRA adapters",
        fix=f"set rollout.use_lora=false{TO_OFF}",
    ),
    Requirement(
        field="ppo_n_minibatches",
        methods=ADAMW_ONLY,
        holds=lambda value: value == 1,
        why="inverts exactly one optimizer step per sync, and each PPO minibatch is one step",
        fix=f"set actor.ppo_n_minibatches=1{TO_CAST} (any minibatch count)",
    ),
    Requirement(
        field="optimizer_present",
        methods=ADAMW_ONLY,
        holds=bool,
        written=_null,
        why="inverts the actor's optimizer step, but the actor has no optimizer",
        fix="configure actor.optimizer with type: adam",
    ),
    Requirement(
        field="optimizer_type",
        methods=ADAMW_ONLY,
        holds=lambda value: value == "adam",
        why="inverts Megatron's AdamW with decoupled weight decay (optimizer type adam)",
        fix=f"set actor.optimizer.type=adam{TO_CAST}",
    ),
    Requirement(
        field="weight_decay_incr_style",
        methods=ADAMW_ONLY,
        holds=lambda value: value == "constant",
        why="assumes the same weight decay at every step",
        fix=f"use a constant weight-decay schedule{TO_CAST}",
    ),
    Requirement(
        field="use_distributed_optimizer",
        methods=ADAMW_ONLY,
        holds=bool,
        why="inverts the step from the distributed optimizer's sharded fp32 state",
        fix=f"set actor.megatron.ddp.use_distributed_optimizer=true{TO_CAST}",
    ),
    Requirement(
        field="overlap_param_gather",
        methods=ADAMW_ONLY,
        holds=lambda value: not value,
        why="reads the bf16 weights right after the step, before an overlapped gather ends",
        fix="set actor.megatron.ddp.overlap_param_gather=false",
    ),
    _precision("main_params_dtype", "actor.megatron.main_params_dtype"),
    _precision("exp_avg_dtype", "actor.megatron.exp_avg_dtype"),
    _precision("exp_avg_sq_dtype", "actor.megatron.exp_avg_sq_dtype"),
    Requirement(
        field="actor_offload",
        methods=ADAMW_ONLY,
        holds=lambda value: not value,
        why="reads the optimizer moments at sync time, which actor.offload moves to the CPU",
        fix=f"set actor.offload=false{TO_CAST}",
    ),
    Requirement(
        field="enable_offload",
        methods=ADAMW_ONLY,
        holds=lambda value: not value,
        why="reads optimizer state that torch_memory_saver releases between phases",
        fix=f"set enable_offload=false{TO_CAST}",
    ),
)
"""Every requirement of the delta path, in the order `validate` checks them."""


def validate(config: RunConfig, *, embedded: bool = False) -> None:
    """Check the delta settings against the RL run; warn about settings without effect.

    Args:
        config: the settings `load_config` read.
        embedded: the caller runs its own actor and rollout in place of AReaL's Megatron
            and SGLang engines (the GSM8K example's embedded profile, a plain torch loop):
            the requirements that name those engines are skipped, all others apply.

    Raises:
        ConfigValidationError: the first requirement broken, or a ``DTE_*`` entry of a
            scheduling spec's env_vars that is unknown or disagrees with the settings.
    """
    delta, rl = config.delta, config.rl
    for key, value, reason in _ineffective(delta):
        log.warning("%s=%s has no effect: %s", key, show(value), reason)
    if not delta.enable_delta_weight_update:
        return
    method = delta.weight_update_delta_method
    for requirement in REQUIREMENTS:
        if embedded and requirement.engine:
            continue
        if method in requirement.methods and requirement.when(rl):
            _check(requirement, delta, rl)
    _check_spec_env(delta, rl)


def _check(requirement: Requirement, delta: DeltaConfig, rl: RLConfig) -> None:
    value = getattr(rl, requirement.field)
    if requirement.holds(value):
        return
    needed_by = (
        f"{ENABLE}=true"
        if requirement.methods == ANY_METHOD
        else f"{METHOD}={show(delta.weight_update_delta_method)}"
    )
    raise ConfigValidationError(
        key=key_of(attrs.fields_dict(RLConfig)[requirement.field]),
        value=requirement.written(value),
        problem=f"{needed_by} {requirement.why}",
        fix=requirement.fix,
    )


def _check_spec_env(delta: DeltaConfig, rl: RLConfig) -> None:
    expected = env_variables(delta)
    keys = {name: key for key, name in ENV_NAMES.items()}
    values = setting_values(delta)
    for spec_key, name, value in rl.dte_env_vars:
        if name not in expected:
            raise unknown_key(f"{spec_key}.{name}", value, known=expected)
        if value != expected[name]:
            key = keys[name]
            raise ConfigValidationError(
                key=f"{spec_key}.{name}",
                value=value,
                problem=f"disagrees with {key}={show(values[key])}, exported as {expected[name]!r}",
                fix=f"remove the variable (export_env writes it) or set {key} to match",
            )


def _ineffective(delta: DeltaConfig) -> Iterator[tuple[str, object, str]]:
    defaults = setting_values(DeltaConfig())
    method = delta.weight_update_delta_method
    for key, value in setting_values(delta).items():
        if key == ENABLE or value == defaults[key]:
            continue
        if not delta.enable_delta_weight_update:
            yield key, value, f"{ENABLE}=false"
        elif key in INVERSION_SETTINGS and method is not DeltaMethod.ADAMW:
            yield key, value, f"only the adamw inversion uses it and {METHOD}={show(method)}"
        elif key == SNAPSHOT_VERIFICATION and method is DeltaMethod.SNAPSHOT:
            yield key, value, f"{METHOD}='snapshot' already diffs against a snapshot"
