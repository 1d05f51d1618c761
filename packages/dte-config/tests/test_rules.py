"""validate: every requirement of the delta path fires with its message; off changes nothing."""

from __future__ import annotations

import logging

import attrs
import pytest
from dte_config import ConfigValidationError, DeltaConfig, DeltaMethod, RunConfig, validate
from dte_config.delta import DiagnosticsConfig, PerformanceConfig

OFF = "actor.enable_delta_weight_update=false"
CAST = "actor.weight_update_delta_method=cast"
BY_DELTA = "actor.enable_delta_weight_update=true"
BY_ADAMW = "actor.weight_update_delta_method='adamw'"
SPEC = "actor.scheduling_spec.0.env_vars"

# (id, RLConfig changes, full message, adamw only)
REJECTIONS = [
    (
        "colocation",
        {"rollout_scheduling_strategy": "colocation"},
        f"rollout.scheduling_strategy.type='colocation': {BY_DELTA} needs the rollout on its "
        f"own GPUs (separation); fix: set rollout.scheduling_strategy.type=separation or {OFF}",
        False,
    ),
    (
        "fsdp-actor",
        {"actor_backend": "fsdp:d4p1t1"},
        f"actor.backend='fsdp:d4p1t1': {BY_DELTA} needs a Megatron-core actor: it reads "
        "Megatron's optimizer and shard layout; fix: set actor.backend to a megatron: "
        f"allocation such as megatron:d2p1t4 or {OFF}",
        False,
    ),
    (
        "no-actor-backend",
        {"actor_backend": ""},
        f"actor.backend='': {BY_DELTA} needs a Megatron-core actor: it reads Megatron's "
        "optimizer and shard layout; fix: set actor.backend to a megatron: allocation such "
        f"as megatron:d2p1t4 or {OFF}",
        False,
    ),
    (
        "vllm-rollout",
        {"rollout_backend": "vllm:d4p1t1"},
        f"rollout.backend='vllm:d4p1t1': {BY_DELTA} needs an SGLang rollout: deltas are "
        "applied inside SGLang's workers; fix: set rollout.backend to an sglang: allocation "
        f"such as sglang:d2t4p1 or {OFF}",
        False,
    ),
    (
        "actor-lora",
        {"actor_use_lora": True},
        f"actor.use_lora=true: {BY_DELTA} syncs full weights, not LoRA adapters; "
        f"fix: set actor.use_lora=false or {OFF}",
        False,
    ),
    (
        "rollout-lora",
        {"rollout_use_lora": True},
        f"rollout.use_lora=true: {BY_DELTA} syncs full weights, not LoRA adapters; "
        f"fix: set rollout.use_lora=false or {OFF}",
        False,
    ),
    (
        "two-minibatches",
        {"ppo_n_minibatches": 2},
        f"actor.ppo_n_minibatches=2: {BY_ADAMW} inverts exactly one optimizer step per sync, "
        "and each PPO minibatch is one step; fix: set actor.ppo_n_minibatches=1 or "
        f"{CAST} (any minibatch count)",
        True,
    ),
    (
        "no-optimizer",
        {"optimizer_present": False},
        f"actor.optimizer=null: {BY_ADAMW} inverts the actor's optimizer step, but the actor "
        "has no optimizer; fix: configure actor.optimizer with type: adam",
        True,
    ),
    (
        "sgd",
        {"optimizer_type": "sgd"},
        f"actor.optimizer.type='sgd': {BY_ADAMW} inverts Megatron's AdamW with decoupled "
        f"weight decay (optimizer type adam); fix: set actor.optimizer.type=adam or {CAST}",
        True,
    ),
    (
        "adam-bf16",
        {"optimizer_type": "adam_bf16"},
        f"actor.optimizer.type='adam_bf16': {BY_ADAMW} inverts Megatron's AdamW with "
        "decoupled weight decay (optimizer type adam); fix: set actor.optimizer.type=adam "
        f"or {CAST}",
        True,
    ),
    (
        "cosine-weight-decay",
        {"weight_decay_incr_style": "cosine"},
        f"actor.optimizer.weight_decay_incr_style='cosine': {BY_ADAMW} assumes the same "
        f"weight decay at every step; fix: use a constant weight-decay schedule or {CAST}",
        True,
    ),
    (
        "no-distributed-optimizer",
        {"use_distributed_optimizer": False},
        f"actor.megatron.ddp.use_distributed_optimizer=false: {BY_ADAMW} inverts the step "
        "from the distributed optimizer's sharded fp32 state; fix: set "
        f"actor.megatron.ddp.use_distributed_optimizer=true or {CAST}",
        True,
    ),
    (
        "overlap-param-gather",
        {"overlap_param_gather": True},
        f"actor.megatron.ddp.overlap_param_gather=true: {BY_ADAMW} reads the bf16 weights "
        "right after the step, before an overlapped gather ends; fix: set "
        "actor.megatron.ddp.overlap_param_gather=false",
        True,
    ),
    (
        "bf16-moments",
        {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bfloat16"},
        f"actor.megatron.exp_avg_dtype='bfloat16': {BY_ADAMW} derives its guard band for "
        "fp32 master weights and moments; fix: set actor.megatron.exp_avg_dtype=float32, "
        f"actor.megatron.use_precision_aware_optimizer=false or {CAST}",
        True,
    ),
    (
        "bf16-second-moment",
        {"use_precision_aware_optimizer": True, "exp_avg_sq_dtype": "bfloat16"},
        f"actor.megatron.exp_avg_sq_dtype='bfloat16': {BY_ADAMW} derives its guard band for "
        "fp32 master weights and moments; fix: set actor.megatron.exp_avg_sq_dtype=float32, "
        f"actor.megatron.use_precision_aware_optimizer=false or {CAST}",
        True,
    ),
    (
        "bf16-master",
        {"use_precision_aware_optimizer": True, "main_params_dtype": "bfloat16"},
        f"actor.megatron.main_params_dtype='bfloat16': {BY_ADAMW} derives its guard band for "
        "fp32 master weights and moments; fix: set actor.megatron.main_params_dtype=float32, "
        f"actor.megatron.use_precision_aware_optimizer=false or {CAST}",
        True,
    ),
    (
        "actor-offload",
        {"actor_offload": True},
        f"actor.offload=true: {BY_ADAMW} reads the optimizer moments at sync time, which "
        f"actor.offload moves to the CPU; fix: set actor.offload=false or {CAST}",
        True,
    ),
    (
        "memory-saver-offload",
        {"enable_offload": True},
        f"enable_offload=true: {BY_ADAMW} reads optimizer state that torch_memory_saver "
        f"releases between phases; fix: set enable_offload=false or {CAST}",
        True,
    ),
    (
        "spec-env-disagrees",
        {"dte_env_vars": ((SPEC, "DTE_INVERSION_ALLREDUCE_WINDOW_MB", "256"),)},
        f"{SPEC}.DTE_INVERSION_ALLREDUCE_WINDOW_MB='256': disagrees with "
        "actor.weight_update_delta_performance.inversion_allreduce_window_mb=512, exported "
        "as '512'; fix: remove the variable (export_env writes it) or set "
        "actor.weight_update_delta_performance.inversion_allreduce_window_mb to match",
        False,
    ),
    (
        "spec-env-unknown",
        {"dte_env_vars": ((SPEC, "DTE_STREAMING_RECONSTRUCTION", "1"),)},
        f"{SPEC}.DTE_STREAMING_RECONSTRUCTION='1': unknown key; fix: remove it or write "
        f"{SPEC}.DTE_STREAMING_RECONSTRUCT",
        False,
    ),
]
IDS = [row[0] for row in REJECTIONS]


def _with(config: RunConfig, rl_changes: dict, **delta_changes) -> RunConfig:
    return RunConfig(
        delta=attrs.evolve(config.delta, **delta_changes),
        rl=attrs.evolve(config.rl, **rl_changes),
    )


def test_example_validates(example):
    """The reference example passes every check."""
    expected = None
    assert expected == validate(example)


@pytest.mark.parametrize(("name", "rl_changes", "message", "adamw_only"), REJECTIONS, ids=IDS)
def test_rejection_fires_with_its_message(example, name, rl_changes, message, adamw_only):
    """Each broken requirement raises ConfigValidationError naming key, value and fix."""
    with pytest.raises(ConfigValidationError) as caught:
        validate(_with(example, rl_changes))
    assert message == str(caught.value)


@pytest.mark.parametrize(("name", "rl_changes", "message", "adamw_only"), REJECTIONS, ids=IDS)
def test_disabled_delta_path_accepts_everything(example, name, rl_changes, message, adamw_only):
    """With enable_delta_weight_update=false no requirement is checked."""
    expected = None
    assert expected == validate(_with(example, rl_changes, enable_delta_weight_update=False))


ADAMW_ONLY = [row for row in REJECTIONS if row[3]]


@pytest.mark.parametrize(
    ("name", "rl_changes", "message", "adamw_only"), ADAMW_ONLY, ids=[r[0] for r in ADAMW_ONLY]
)
def test_cast_accepts_adamw_only_requirements(example, name, rl_changes, message, adamw_only):
    """The cast detector accepts any minibatch count, optimizer and offload setting."""
    expected = None
    config = _with(example, rl_changes, weight_update_delta_method=DeltaMethod.CAST)
    assert expected == validate(config)


ENGINE_ROWS = [row for row in REJECTIONS if row[1].keys() <= {"actor_backend", "rollout_backend"}]


@pytest.mark.parametrize(
    ("name", "rl_changes", "message", "adamw_only"), ENGINE_ROWS, ids=[r[0] for r in ENGINE_ROWS]
)
def test_embedded_skips_only_the_engine_requirements(
    example, name, rl_changes, message, adamw_only
):
    """embedded=True accepts any actor/rollout backend and still rejects everything else."""
    expected = None
    assert expected == validate(_with(example, rl_changes), embedded=True)
    with pytest.raises(ConfigValidationError) as caught:
        validate(_with(example, {**rl_changes, "ppo_n_minibatches": 2}), embedded=True)
    assert "actor.ppo_n_minibatches" == caught.value.key


def test_first_broken_requirement_wins(example):
    """Several broken requirements report the first one in REQUIREMENTS order."""
    config = _with(example, {"ppo_n_minibatches": 3, "rollout_scheduling_strategy": "colocation"})
    with pytest.raises(ConfigValidationError) as caught:
        validate(config)
    assert "rollout.scheduling_strategy.type" == caught.value.key


def test_error_carries_key_value_and_fix(example):
    """The error's attributes hold what its message shows."""
    with pytest.raises(ConfigValidationError) as caught:
        validate(_with(example, {"ppo_n_minibatches": 2}))
    expected = (
        "actor.ppo_n_minibatches",
        2,
        f"set actor.ppo_n_minibatches=1 or {CAST} (any minibatch count)",
    )
    assert expected == (caught.value.key, caught.value.value, caught.value.fix)


WARNINGS = [
    (
        "disabled-anchor",
        DeltaConfig(weight_update_anchor_interval=10),
        "actor.weight_update_anchor_interval=10 has no effect: "
        "actor.enable_delta_weight_update=false",
    ),
    (
        "cast-window",
        DeltaConfig(
            enable_delta_weight_update=True,
            weight_update_delta_method=DeltaMethod.CAST,
            weight_update_delta_performance=PerformanceConfig(inversion_allreduce_window_mb=256),
        ),
        "actor.weight_update_delta_performance.inversion_allreduce_window_mb=256 has no "
        "effect: only the adamw inversion uses it and actor.weight_update_delta_method='cast'",
    ),
    (
        "snapshot-verification",
        DeltaConfig(
            enable_delta_weight_update=True,
            weight_update_delta_method=DeltaMethod.SNAPSHOT,
            weight_update_delta_diagnostics=DiagnosticsConfig(snapshot_verification=True),
        ),
        "actor.weight_update_delta_diagnostics.snapshot_verification=true has no effect: "
        "actor.weight_update_delta_method='snapshot' already diffs against a snapshot",
    ),
]


@pytest.mark.parametrize(("name", "delta", "message"), WARNINGS, ids=[w[0] for w in WARNINGS])
def test_setting_without_effect_logs_one_warning(example, caplog, name, delta, message):
    """A setting that the chosen mode ignores logs exactly one warning naming it."""
    rl = attrs.evolve(example.rl, dte_env_vars=())
    with caplog.at_level(logging.WARNING, logger="dte_config"):
        validate(RunConfig(delta=delta, rl=rl))
    assert [message] == [record.getMessage() for record in caplog.records]


def test_example_logs_no_warning(example, caplog):
    """The reference example sets nothing that goes unused."""
    with caplog.at_level(logging.WARNING, logger="dte_config"):
        validate(example)
    assert [] == caplog.records
