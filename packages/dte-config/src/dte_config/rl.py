"""The settings of the surrounding RL run that the delta path depends on.

`RLConfig` holds only the AReaL keys that the startup checks read, each with AReaL 1.0.4's
default for when a config omits it. `RLConfig.read` takes them from any config tree: a
mapping (an OmegaConf tree or a plain dict) or attribute objects (AReaL's own dataclasses).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from dte_config.validators import at_least, setting, strict

__all__ = ["ENV_PREFIX", "FLOAT32", "RLConfig", "lookup", "scheduling_specs"]

ENV_PREFIX = "DTE_"
ABSENT = object()
SCHEDULING_SPEC = "scheduling_spec"
FLOAT32 = "float32"


def _present(value: object) -> bool:
    return value is not None


def _presence(key: str) -> Any:
    """A bool field read as "the key holds a non-null value"; false when absent."""
    metadata = {"key": key, "read": _present}
    return attrs.field(default=False, validator=strict(bool), metadata=metadata)


@attrs.frozen(kw_only=True)
class RLConfig:
    """The AReaL settings the delta path's startup checks read, with AReaL 1.0.4's defaults."""

    actor_backend: str = setting("", key="actor.backend", validator=strict(str))
    """Actor engine and its parallelism, e.g. ``megatron:(attn:d2p1t4|ffn:d1p1e8)``."""
    rollout_backend: str = setting("", key="rollout.backend", validator=strict(str))
    """Rollout engine and its parallelism, e.g. ``sglang:d2t4p1``."""
    rollout_scheduling_strategy: str = setting(
        "separation", key="rollout.scheduling_strategy.type", validator=strict(str)
    )
    """``separation`` (own GPUs) or ``colocation`` (shares the actor's GPUs)."""
    actor_use_lora: bool = setting(False, key="actor.use_lora", validator=strict(bool))
    """The actor trains LoRA adapters instead of full weights."""
    rollout_use_lora: bool = setting(False, key="rollout.use_lora", validator=strict(bool))
    """The rollout serves LoRA adapters."""
    ppo_n_minibatches: int = setting(
        4, key="actor.ppo_n_minibatches", validator=[strict(int), at_least(1)]
    )
    """Minibatches per PPO update; each one is an optimizer step."""
    optimizer_present: bool = _presence("actor.optimizer")
    """The actor has an optimizer (``actor.optimizer`` is not null)."""
    optimizer_type: str = setting("adam", key="actor.optimizer.type", validator=strict(str))
    """``adam`` is Megatron's AdamW with decoupled weight decay; also ``sgd``, ``adam_bf16``."""
    weight_decay_incr_style: str = setting(
        "constant", key="actor.optimizer.weight_decay_incr_style", validator=strict(str)
    )
    """Weight-decay schedule; AReaL 1.0.4's Megatron engine always uses ``constant``."""
    use_distributed_optimizer: bool = setting(
        True, key="actor.megatron.ddp.use_distributed_optimizer", validator=strict(bool)
    )
    """Megatron shards the fp32 optimizer state over data-parallel ranks."""
    overlap_param_gather: bool = setting(
        False, key="actor.megatron.ddp.overlap_param_gather", validator=strict(bool)
    )
    """Megatron gathers updated bf16 parameters lazily, during the next forward pass."""
    use_precision_aware_optimizer: bool = setting(
        False, key="actor.megatron.use_precision_aware_optimizer", validator=strict(bool)
    )
    """Megatron keeps optimizer state in the dtypes below instead of fp32."""
    main_params_dtype: str = setting(
        FLOAT32, key="actor.megatron.main_params_dtype", validator=strict(str)
    )
    """Dtype of the master weights under the precision-aware optimizer."""
    exp_avg_dtype: str = setting(FLOAT32, key="actor.megatron.exp_avg_dtype", validator=strict(str))
    """Dtype of AdamW's first moment under the precision-aware optimizer."""
    exp_avg_sq_dtype: str = setting(
        FLOAT32, key="actor.megatron.exp_avg_sq_dtype", validator=strict(str)
    )
    """Dtype of AdamW's second moment under the precision-aware optimizer."""
    actor_offload: bool = setting(False, key="actor.offload", validator=strict(bool))
    """The actor offloads parameters and optimizer state to the CPU."""
    enable_offload: bool = setting(False, key="enable_offload", validator=strict(bool))
    """torch_memory_saver releases the actor's GPU memory between phases."""
    dte_env_vars: tuple[tuple[str, str, str], ...] = attrs.field(
        default=(), validator=strict(tuple)
    )
    """``DTE_*`` entries of the scheduling specs' env_vars: (env_vars key, name, value)."""

    @classmethod
    def read(cls, tree: object) -> RLConfig:
        """Read the checked settings from a config tree; absent keys keep their defaults.

        Args:
            tree: an OmegaConf tree, a plain mapping, or AReaL's experiment config object.
        """
        values: dict[str, Any] = {}
        for field in attrs.fields(cls):
            if "key" not in field.metadata:
                continue
            found = lookup(tree, field.metadata["key"])
            if found is ABSENT:
                continue
            read = field.metadata.get("read")
            values[field.name] = read(found) if read else _plain(found)
        return cls(**values, dte_env_vars=tuple(_dte_env_vars(tree)))


def _plain(value: object) -> object:
    return value.value if isinstance(value, enum.Enum) else value


def lookup(tree: object, dotted: str) -> object:
    """The value at `dotted` in a tree of mappings, sequences and objects, or `ABSENT`."""
    node = tree
    for part in dotted.split("."):
        node = _child(node, part)
        if node is ABSENT:
            return ABSENT
    return node


def _child(node: object, part: str) -> object:
    if node is None:
        return ABSENT
    if isinstance(node, Mapping):
        return node[part] if part in node else ABSENT
    if isinstance(node, Sequence) and not isinstance(node, str):
        index = int(part) if part.isdigit() else len(node)
        return node[index] if index < len(node) else ABSENT
    return getattr(node, part, ABSENT)


def _members(node: object) -> Iterator[tuple[str, object]]:
    if isinstance(node, Mapping):
        yield from ((str(name), value) for name, value in node.items())
    elif isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        yield from ((str(index), value) for index, value in enumerate(node))
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        yield from ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
    elif hasattr(node, "__dict__") and not isinstance(node, (type, enum.Enum)):
        yield from vars(node).items()


def scheduling_specs(tree: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, spec) for every scheduling spec at any depth of `tree`.

    A ``scheduling_spec`` is a list of specs (``actor.scheduling_spec.0``) or a single one
    (``train_dataset.scheduling_spec``).
    """
    for name, value in _members(tree):
        key = f"{prefix}{name}"
        if name != SCHEDULING_SPEC or value is None:
            yield from scheduling_specs(value, key + ".")
        elif isinstance(value, Sequence) and not isinstance(value, str):
            yield from ((f"{key}.{index}", spec) for index, spec in enumerate(value))
        else:
            yield key, value


def _dte_env_vars(tree: object) -> Iterator[tuple[str, str, str]]:
    for spec_key, spec in scheduling_specs(tree):
        env_vars = _child(spec, "env_vars")
        if not isinstance(env_vars, Mapping):
            continue
        for name, value in env_vars.items():
            if str(name).startswith(ENV_PREFIX):
                yield f"{spec_key}.env_vars", str(name), value
