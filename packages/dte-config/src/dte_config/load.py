"""Load an experiment config: compose the YAML, reject unknown keys and wrong types, type it.

The AReaL part of the tree is checked against the shipped AReaL key catalogue; the delta keys
under ``actor`` are checked by `DeltaConfig` itself. Cross-field rules are `validate`'s job.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from omegaconf import DictConfig, OmegaConf

from dte_config.catalogue import areal_keys
from dte_config.compose import compose
from dte_config.delta import ACTOR, DeltaConfig
from dte_config.rl import RLConfig
from dte_config.run import RunConfig
from dte_config.schema import check_keys
from dte_config.structure import structure

__all__ = ["LoadedConfig", "load_config"]

log = logging.getLogger(__name__)

DELTA_KEYS = tuple(field.name for field in attrs.fields(DeltaConfig))


@attrs.frozen(kw_only=True)
class LoadedConfig:
    """A composed, resolved OmegaConf tree and the typed settings read from it."""

    tree: DictConfig = attrs.field(eq=False)
    """The whole experiment config, ``defaults:`` merged, overrides applied, resolved."""
    config: RunConfig
    """The typed settings that `validate` checks."""
    sections: Mapping[str, Any] = attrs.field(factory=dict, eq=False)
    """The caller's own root sections (``sections=`` of `load_config`), resolved, unchecked."""

    def without_delta_keys(self) -> DictConfig:
        """A copy of the tree without the delta keys and the caller's own sections, for
        AReaL's own config classes."""
        trimmed = self.tree.copy()
        for name in self.sections:
            trimmed.pop(name, None)
        actor = trimmed.get(ACTOR)
        if isinstance(actor, DictConfig):
            for name in DELTA_KEYS:
                actor.pop(name, None)
        return trimmed


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    *,
    sections: Sequence[str] = (),
) -> LoadedConfig:
    """Compose `path` with dotted `overrides` and read the typed settings.

    Args:
        path: the experiment YAML; None: start from an empty tree (all defaults).
        overrides: ``dotted.key=value`` items, applied in order after composition.
        sections: root keys that belong to the caller (an application's own settings):
            composed and overridden like the rest, then handed back in
            `LoadedConfig.sections` instead of being checked against AReaL's keys.

    Raises:
        ConfigFileError: a config file does not exist.
        ConfigValidationError: malformed YAML or override, unknown key, or wrong type.
    """
    tree = compose(path, overrides)
    data: dict[str, Any] = OmegaConf.to_container(tree, resolve=True)  # type: ignore[assignment]
    own = {name: data.pop(name) for name in sections if name in data}
    delta_data = _pop_delta_keys(data)
    check_keys(data, areal_keys())
    config = RunConfig(delta=structure(DeltaConfig, delta_data, key=ACTOR), rl=RLConfig.read(data))
    log.debug("loaded %s with %d overrides: %s", path, len(overrides), config)
    return LoadedConfig(tree=tree, config=config, sections=own)


def _pop_delta_keys(data: dict[str, Any]) -> dict[str, Any]:
    actor = data.get(ACTOR)
    if not isinstance(actor, Mapping):
        return {}
    return {name: actor.pop(name) for name in DELTA_KEYS if name in actor}
