"""Settings of the delta weight-update path, written under ``actor.*`` in the experiment YAML.

Field names are the YAML keys (the seed's names for the first three), so one spelling serves
YAML, command-line overrides, Python and error messages. Every field validates its type and
range at construction and raises `ConfigValidationError` naming its dotted key.
"""

from __future__ import annotations

import enum

import attrs

from dte_config.validators import at_least, member_of, setting, strict

__all__ = [
    "DeltaConfig",
    "DeltaMethod",
    "DiagnosticsConfig",
    "PerformanceConfig",
    "setting_fields",
    "setting_values",
]

ACTOR = "actor"
PERFORMANCE = f"{ACTOR}.weight_update_delta_performance"
DIAGNOSTICS = f"{ACTOR}.weight_update_delta_diagnostics"
DEFAULT_ANCHOR_INTERVAL = 20
DEFAULT_ALLREDUCE_WINDOW_MB = 512


class DeltaMethod(enum.StrEnum):
    """How the actor finds the bf16 elements that changed since the last sync."""

    ADAMW = "adamw"
    """Invert one AdamW step from the optimizer moments; needs exactly one step per sync."""
    CAST = "cast"
    """Record which elements flip when Megatron casts fp32 master weights to bf16; any steps."""
    SNAPSHOT = "snapshot"
    """Diff against a kept bf16 copy of the weights; the reference, costs a model copy."""


@attrs.frozen(kw_only=True)
class PerformanceConfig:
    """How the delta path trades memory and overlap for speed (``DTE_*`` performance settings)."""

    streaming_reconstruct: bool = setting(
        True, key=f"{PERFORMANCE}.streaming_reconstruct", validator=strict(bool)
    )
    """Rebuild pre-step values parameter by parameter, never as a second full model copy."""
    p2p_coalesce: bool = setting(True, key=f"{PERFORMANCE}.p2p_coalesce", validator=strict(bool))
    """Two-round sparse P2P: nnz counts per peer, then one index and one value buffer per peer."""
    inversion_allreduce_window_mb: int = setting(
        DEFAULT_ALLREDUCE_WINDOW_MB,
        key=f"{PERFORMANCE}.inversion_allreduce_window_mb",
        validator=[strict(int), at_least(1)],
    )
    """MiB of the sharded-optimizer inversion's collectives kept in flight at once."""
    inversion_compute_on_cpu: bool = setting(
        False, key=f"{PERFORMANCE}.inversion_compute_on_cpu", validator=strict(bool)
    )
    """Run the AdamW inversion on the CPU; false: on the payload's device (the GPU)."""


@attrs.frozen(kw_only=True)
class DiagnosticsConfig:
    """Validation and experiment controls; all off by default, none needed for correctness."""

    snapshot_verification: bool = setting(
        False, key=f"{DIAGNOSTICS}.snapshot_verification", validator=strict(bool)
    )
    """Keep a bf16 snapshot on the actor and check every detected change set against it."""
    weight_digests: bool = setting(
        False, key=f"{DIAGNOSTICS}.weight_digests", validator=strict(bool)
    )
    """Compare per-tensor digests of the rollout's weights with the actor's after each sync."""
    phase_timing: bool = setting(False, key=f"{DIAGNOSTICS}.phase_timing", validator=strict(bool))
    """Time each sync phase (detect, encode, send, apply, verify) and log it."""
    recovery: bool = setting(False, key=f"{DIAGNOSTICS}.recovery", validator=strict(bool))
    """Save the sync stream's versions with trainer checkpoints and resume it after a restart."""
    deterministic_rollout: bool = setting(
        False, key=f"{DIAGNOSTICS}.deterministic_rollout", validator=strict(bool)
    )
    """Run the rollout deterministically so delta and full-sync runs compare token by token."""


@attrs.frozen(kw_only=True)
class DeltaConfig:
    """The delta weight-update path: on/off, change detector, anchors, tuning, diagnostics."""

    enable_delta_weight_update: bool = setting(
        False, key=f"{ACTOR}.enable_delta_weight_update", validator=strict(bool)
    )
    """On: the first sync is full, later contiguous versions send only changed elements."""
    weight_update_delta_method: DeltaMethod = setting(
        DeltaMethod.ADAMW,
        key=f"{ACTOR}.weight_update_delta_method",
        validator=member_of(DeltaMethod),
    )
    """Which change detector the actor runs: adamw, cast or snapshot."""
    weight_update_anchor_interval: int = setting(
        DEFAULT_ANCHOR_INTERVAL,
        key=f"{ACTOR}.weight_update_anchor_interval",
        validator=[strict(int), at_least(0)],
    )
    """Full anchor sync after N committed deltas; 0: never."""
    weight_update_delta_performance: PerformanceConfig = setting(
        PerformanceConfig(), key=PERFORMANCE, validator=strict(PerformanceConfig)
    )
    """Performance settings of the delta path."""
    weight_update_delta_diagnostics: DiagnosticsConfig = setting(
        DiagnosticsConfig(), key=DIAGNOSTICS, validator=strict(DiagnosticsConfig)
    )
    """Validation and experiment controls, all off by default."""


def setting_fields(cls: type = DeltaConfig) -> dict[str, attrs.Attribute]:
    """Dotted key -> attrs field of every leaf setting of `cls`, nested classes flattened."""
    found: dict[str, attrs.Attribute] = {}
    for field in attrs.fields(attrs.resolve_types(cls)):
        if attrs.has(field.type):
            found.update(setting_fields(field.type))
        else:
            found[field.metadata["key"]] = field
    return found


def setting_values(delta: DeltaConfig) -> dict[str, object]:
    """Dotted key -> value of every leaf setting of `delta`."""
    values: dict[str, object] = {}
    for field in attrs.fields(type(delta)):
        value = getattr(delta, field.name)
        if attrs.has(type(value)):
            values.update(setting_values(value))
        else:
            values[field.metadata["key"]] = value
    return values
