"""The run's settings: an experiment YAML checked by dte-config, plus the app's own section.

The YAML holds AReaL keys and the delta keys (``actor.enable_delta_weight_update`` and
friends), composed with dotted overrides and checked by `dte_config.load_config` and
`dte_config.validate`. A profile with an ``embedded:`` section (what AReaL has no key for:
the tiny model's shape, the shaped reward; checked here by `EmbeddedConfig`) runs the
embedded job: a torch AdamW actor and an HF ``generate`` rollout in place of AReaL's
Megatron and SGLang engines, so `validate` runs with ``embedded=True``. A profile without
one is a cluster config for AReaL (``scheduler.type``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from attrs.validators import instance_of
from dte_config import ConfigValidationError, RunConfig, load_config, validate

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
DEFAULT_PROFILE = Path(__file__).resolve().parent / "configs" / "local.yaml"

def _size(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigValidationError(key=f"{EMBEDDED}.model.{attribute.name}", value=value,
                                    problem="must be a positive integer",
                                    fix="use a size > 0")


def _flag(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigValidationError(key=f"{EMBEDDED}.{attribute.name}", value=value,
                                    problem="must be a boolean", fix="write true or false")


@attrs.frozen(kw_only=True)
class ModelShape:
    """The tiny random Qwen3 policy (``embedded.model``); ignored with ``--model PATH``."""

    hidden_size: int = attrs.field(default=64, validator=_size)
    """Width of the residual stream."""
    intermediate_size: int = attrs.field(default=192, validator=_size)
    """Width of the MLP."""
    num_hidden_layers: int = attrs.field(default=2, validator=_size)
    """Decoder layers."""
    num_attention_heads: int = attrs.field(default=4, validator=_size)
    """Query heads."""
    num_key_value_heads: int = attrs.field(default=2, validator=_size)
    """Key/value heads (grouped-query attention); divides the query heads."""
    head_dim: int = attrs.field(default=16, validator=_size)
    """Width of one head."""

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigValidationError(
                key=f"{EMBEDDED}.model.num_key_value_heads", value=self.num_key_value_heads,
                problem=f"does not divide embedded.model.num_attention_heads="
                        f"{self.num_attention_heads}",
                fix="pick a divisor of the query heads")


@attrs.frozen(kw_only=True)
class EmbeddedConfig:
    """The app's ``embedded:`` section."""

    model: ModelShape = attrs.field(factory=ModelShape, validator=instance_of(ModelShape))
    """Shape of the random policy."""
    shaped_reward: bool = attrs.field(default=True, validator=_flag)
    """Add `rewards.shaped_reward` to groups whose exact rewards are all zero."""


@attrs.frozen(kw_only=True)
class Profile:
    """Everything a run reads from its YAML and overrides."""

    tree: Any = attrs.field(eq=False)
    """The composed AReaL + delta tree (OmegaConf), resolved."""
    run: RunConfig
    """The typed delta and RL settings, validated."""
    embedded: EmbeddedConfig | None
    """The app's own section; None for a cluster config."""


def load_profile(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> Profile:
    """Compose `path` (default: the embedded profile) with overrides, check and type it.

    Raises:
        ConfigValidationError: an unknown key, a wrong type or a broken startup check.
        ConfigFileError: the file does not exist.
    """
    loaded = load_config(DEFAULT_PROFILE if path is None else path, overrides,
                         sections=[EMBEDDED])
    section = loaded.sections.get(EMBEDDED)
    validate(loaded.config, embedded=section is not None)
    embedded = None if section is None else _embedded(section or {})
    return Profile(tree=loaded.tree, run=loaded.config, embedded=embedded)


def _embedded(data: Mapping[str, Any]) -> EmbeddedConfig:
    known = {f.name for f in attrs.fields(EmbeddedConfig)}
    _reject_unknown(data, known, EMBEDDED)
    model = dict(data.get("model") or {})
    _reject_unknown(model, {f.name for f in attrs.fields(ModelShape)}, f"{EMBEDDED}.model")
    return EmbeddedConfig(model=ModelShape(**model),
                          shaped_reward=data.get("shaped_reward", True))


def _reject_unknown(data: Mapping[str, Any], known: set[str], prefix: str) -> None:
    for name, value in data.items():
        if name not in known:
            raise ConfigValidationError(key=f"{prefix}.{name}", value=value,
                                        problem="unknown key",
                                        fix=f"use one of {', '.join(sorted(known))}")
