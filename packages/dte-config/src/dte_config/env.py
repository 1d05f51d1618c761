"""The ``DTE_*`` environment variables: the delta settings as seen by worker processes.

`export_env` runs once on the controller: it writes every delta setting into the process
environment and into each scheduling spec's ``env_vars``. `read_env` runs at worker start and
rebuilds the identical `DeltaConfig`. Booleans are ``0``/``1``; integers are decimal; the
method is its YAML spelling. Nothing else in the project reads these variables.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import attrs

from dte_config.delta import (
    ACTOR,
    DIAGNOSTICS,
    PERFORMANCE,
    DeltaConfig,
    DeltaMethod,
    setting_fields,
    setting_values,
)
from dte_config.errors import ConfigValidationError
from dte_config.rl import ENV_PREFIX, scheduling_specs
from dte_config.structure import structure, unknown_key

__all__ = ["ENV_NAMES", "env_variables", "export_env", "parse_env_value", "read_env"]

ENV_NAMES: Mapping[str, str] = {
    f"{ACTOR}.enable_delta_weight_update": "DTE_ENABLE_DELTA_WEIGHT_UPDATE",
    f"{ACTOR}.weight_update_delta_method": "DTE_DELTA_METHOD",
    f"{ACTOR}.weight_update_anchor_interval": "DTE_ANCHOR_INTERVAL",
    f"{PERFORMANCE}.streaming_reconstruct": "DTE_STREAMING_RECONSTRUCT",
    f"{PERFORMANCE}.p2p_coalesce": "DTE_DELTA_P2P_COALESCE",
    f"{PERFORMANCE}.inversion_allreduce_window_mb": "DTE_INVERSION_ALLREDUCE_WINDOW_MB",
    f"{PERFORMANCE}.inversion_compute_on_cpu": "DTE_INVERSION_COMPUTE_ON_CPU",
    f"{DIAGNOSTICS}.snapshot_verification": "DTE_SNAPSHOT_VERIFICATION",
    f"{DIAGNOSTICS}.weight_digests": "DTE_WEIGHT_DIGESTS",
    f"{DIAGNOSTICS}.phase_timing": "DTE_PHASE_TIMING",
    f"{DIAGNOSTICS}.recovery": "DTE_RECOVERY",
    f"{DIAGNOSTICS}.deterministic_rollout": "DTE_DETERMINISTIC_ROLLOUT",
}
"""Dotted key of every leaf setting -> the variable that carries it."""

BOOL_SPELLINGS = {"1": True, "0": False}


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, DeltaMethod):
        return value.value
    return str(value)


def env_variables(delta: DeltaConfig) -> dict[str, str]:
    """Every delta setting as a ``DTE_*`` variable: name -> text."""
    return {ENV_NAMES[key]: _format(value) for key, value in setting_values(delta).items()}


def export_env(
    delta: DeltaConfig, *, environ: MutableMapping[str, str], tree: object
) -> dict[str, str]:
    """Write every delta setting as a ``DTE_*`` variable into `environ` and `tree`'s specs.

    Args:
        delta: the settings to export.
        environ: the process environment (``os.environ``) or any mutable mapping.
        tree: the experiment config (OmegaConf tree, mapping or AReaL's config object); each
            entry of each top-level section's ``scheduling_spec`` gets the variables in its
            ``env_vars``.

    Returns:
        The variables written, name -> value.
    """
    variables = env_variables(delta)
    environ.update(variables)
    for _, spec in scheduling_specs(tree):
        _spec_env_vars(spec).update(variables)
    return variables


def _spec_env_vars(spec: Any) -> MutableMapping[str, str]:
    if isinstance(spec, MutableMapping):
        if spec.get("env_vars") is None:
            spec["env_vars"] = {}
        return spec["env_vars"]
    if getattr(spec, "env_vars", None) is None:
        spec.env_vars = {}
    return spec.env_vars


def read_env(environ: Mapping[str, str]) -> DeltaConfig:
    """Rebuild the `DeltaConfig` from ``DTE_*`` variables; absent ones keep their defaults.

    Raises:
        ConfigValidationError: an unknown ``DTE_*`` variable, or a value that does not parse
            or is out of range, named by the variable.
    """
    keys = {name: key for key, name in ENV_NAMES.items()}
    fields = setting_fields()
    nested: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name not in keys:
            raise unknown_key(name, raw, known=keys)
        *parents, leaf = keys[name].split(".")[1:]  # below "actor"
        target = nested
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = parse_env_value(fields[keys[name]], raw, name=name)
    try:
        return structure(DeltaConfig, nested, key=ACTOR)
    except ConfigValidationError as error:  # name the variable, not the YAML key
        name = ENV_NAMES[error.key]
        raise ConfigValidationError(
            key=name, value=environ[name], problem=error.problem, fix=error.fix
        ) from None


def parse_env_value(field: attrs.Attribute[Any], raw: str, *, name: str) -> object:
    """Parse one variable's text into the field's type; the range is left to the field."""
    kind = field.type
    if kind is bool:
        if raw in BOOL_SPELLINGS:
            return BOOL_SPELLINGS[raw]
        raise ConfigValidationError(
            key=name, value=raw, problem="expected 0 or 1", fix=f"set {name} to 0 or 1"
        )
    if kind is int:
        if raw.lstrip("-").isdigit() and raw.isascii():
            return int(raw)
        raise ConfigValidationError(
            key=name,
            value=raw,
            problem="expected a decimal integer",
            fix=f"set {name} to a decimal integer",
        )
    return raw  # the method: its spelling is checked by DeltaConfig
