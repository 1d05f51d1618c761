"""The run's settings: an experiment YAML checked by dte-config, plus the app's own section.

The YAML holds AReaL keys and the delta keys (``actor.enable_delta_weight_update`` and
friends), composed with dotted overrides and checked by `dte_config.load_config` and
`dte_config.validate`, plus an ``embedded:`` section for what AReaL has no key for (the
tiny model's shape, the shaped reward), which the app checks itself (`EmbeddedConfig`).

Two settings the embedded profile cannot express to dte-config, worked around here:

- dte-config rejects unknown root keys, so ``embedded:`` is split off before `load_config`
  sees the file (``embedded.*`` overrides go to it as well).
- `validate` requires ``actor.backend`` to be ``megatron:...`` and ``rollout.backend`` to be
  ``sglang:...``. The embedded actor is a torch AdamW loop and the rollout is HF
  ``generate``; neither has an AReaL backend name. When the YAML leaves both unset, the
  check runs against stand-in names (`STANDIN_BACKENDS`) and the app says so once.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from attrs.validators import instance_of
from dte_config import ConfigValidationError, RunConfig, load_config, validate
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
DEFAULT_PROFILE = Path(__file__).resolve().parent / "configs" / "local.yaml"
STANDIN_BACKENDS = {"actor_backend": "megatron:d1p1t1", "rollout_backend": "sglang:d1p1t1"}
"""What `validate` is shown for the embedded torch actor and HF rollout (see module doc)."""



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
    embedded: EmbeddedConfig
    """The app's own section."""
    standins: tuple[str, ...] = ()
    """RL keys `validate` saw stand-in values for (empty when the YAML sets them)."""


def load_profile(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> Profile:
    """Compose `path` (default: the embedded profile) with overrides, check and type it.

    Raises:
        ConfigValidationError: an unknown key, a wrong type or a broken startup check.
        ConfigFileError: the file does not exist.
    """
    path = Path(path) if path is not None else DEFAULT_PROFILE
    ours = [o for o in overrides if o.lstrip("+").startswith(f"{EMBEDDED}.")]
    theirs = [o for o in overrides if o not in ours]
    raw = OmegaConf.load(path) if path.is_file() else OmegaConf.create({})
    section = raw.pop(EMBEDDED, None) or OmegaConf.create({})
    for override in ours:
        key, _, value = override.lstrip("+").partition("=")
        OmegaConf.update(section, key.removeprefix(f"{EMBEDDED}."),
                         OmegaConf.from_dotlist([f"v={value}"]).v, merge=True)
    loaded = _load_trimmed(raw, path, theirs) if path.is_file() else load_config(path, theirs)
    run, standins = _with_standins(loaded.config)
    validate(run)
    embedded = _embedded(OmegaConf.to_container(section, resolve=True))
    return Profile(tree=loaded.tree, run=loaded.config, embedded=embedded, standins=standins)


def _load_trimmed(raw: Any, path: Path, overrides: Sequence[str]):
    """`load_config` of `raw` (the file without ``embedded:``), saved to a temporary file;
    next to `path` when it has ``defaults:``, so that they resolve as from the original."""
    folder = path.parent if "defaults" in raw else None
    handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=".", dir=folder,
                                         delete=False)
    try:
        with handle:
            handle.write(OmegaConf.to_yaml(raw))
        return load_config(handle.name, overrides)
    finally:
        os.unlink(handle.name)


def _with_standins(run: RunConfig) -> tuple[RunConfig, tuple[str, ...]]:
    unset = {name: value for name, value in STANDIN_BACKENDS.items() if not getattr(run.rl, name)}
    if not unset:
        return run, ()
    keys = tuple(attrs.fields_dict(type(run.rl))[name].metadata["key"] for name in unset)
    return attrs.evolve(run, rl=attrs.evolve(run.rl, **unset)), keys


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
