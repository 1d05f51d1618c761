"""Compose an experiment YAML with OmegaConf: ``defaults:`` lists, dotted overrides, resolution.

``defaults:`` follows Hydra's file composition for the case AReaL's examples use: each entry
names a YAML file relative to the including file (``.yaml`` optional), merged at the root
(``name`` and ``name@_global_`` alike); ``_self_`` marks where the including file's own keys
merge, and the end when absent. Overrides are ``dotted.key=value`` with YAML-typed values;
list entries are addressed by index (``actor.scheduling_spec.0.image=...``); a leading
``+`` or ``++`` is accepted and ignored, since unknown keys are rejected later anyway.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dte_config.errors import ConfigFileError, ConfigValidationError

__all__ = ["compose"]

DEFAULTS = "defaults"
SELF = "_self_"
GLOBAL_PACKAGE = "_global_"
SUFFIX = ".yaml"
OVERRIDE_VALUE = "value"


def compose(path: str | os.PathLike[str] | None, overrides: Sequence[str]) -> DictConfig:
    """Load `path` (no file: an empty tree), apply `overrides`, resolve interpolations.

    Raises:
        ConfigFileError: `path` or a file in a ``defaults:`` list does not exist.
        ConfigValidationError: malformed YAML, ``defaults:`` entry or override, a cycle of
            defaults, or an interpolation that does not resolve.
    """
    tree = _load(Path(path), ()) if path is not None else OmegaConf.create({})
    for override in overrides:
        _apply(tree, override)
    try:
        OmegaConf.resolve(tree)
    except OmegaConfBaseException as error:
        raise ConfigValidationError(
            key=str(getattr(error, "full_key", "") or "<interpolation>"),
            value=getattr(error, "msg", str(error)).splitlines()[0],
            problem="interpolation does not resolve",
            fix="define the referenced key or write the value",
        ) from None
    return tree


def _load(path: Path, chain: tuple[Path, ...]) -> DictConfig:
    path = path.resolve()
    named_by = str(chain[-1]) if chain else "the caller"
    if path in chain:
        raise ConfigValidationError(
            key=f"{chain[-1]}: {DEFAULTS}",
            value=str(path),
            problem="defaults form a cycle",
            fix="remove one of the entries that include each other",
        )
    if not path.is_file():
        raise ConfigFileError(path=str(path), named_by=named_by)
    try:
        own = OmegaConf.load(path)
    except yaml.YAMLError as error:
        raise ConfigValidationError(
            key=str(path),
            value=str(error).splitlines()[0],
            problem="malformed YAML",
            fix="correct the YAML syntax",
        ) from None
    if not isinstance(own, DictConfig):
        raise ConfigValidationError(
            key=str(path),
            value=type(own).__name__,
            problem="expected a mapping at the top",
            fix="write the config as a mapping of keys",
        )
    return _merge_defaults(own, path, (*chain, path))


def _merge_defaults(own: DictConfig, path: Path, chain: tuple[Path, ...]) -> DictConfig:
    entries = own.pop(DEFAULTS, None)
    entries = [] if entries is None else OmegaConf.to_container(entries)
    if not isinstance(entries, list):
        raise ConfigValidationError(
            key=f"{path}: {DEFAULTS}",
            value=entries,
            problem="expected a list",
            fix="write defaults as a list of file names and _self_",
        )
    if SELF not in entries:
        entries.append(SELF)
    merged = OmegaConf.create({})
    for index, entry in enumerate(entries):
        part = own if entry == SELF else _load(_entry_path(entry, path, index), chain)
        merged = OmegaConf.merge(merged, part)
    return merged  # type: ignore[return-value]


def _entry_path(entry: object, path: Path, index: int) -> Path:
    name, _, package = str(entry).partition("@")
    if not isinstance(entry, str) or not name or package not in ("", GLOBAL_PACKAGE):
        raise ConfigValidationError(
            key=f"{path}: {DEFAULTS}.{index}",
            value=entry,
            problem="only file entries merged at the root are supported",
            fix=f"write a file name relative to this file, optionally with @{GLOBAL_PACKAGE}",
        )
    target = path.parent / name
    return target if target.suffix == SUFFIX else target.with_name(target.name + SUFFIX)


def _apply(tree: DictConfig, override: str) -> None:
    key, equals, raw = override.partition("=")
    key = key.strip().lstrip("+")
    if not equals or not key or key.startswith("~"):
        raise ConfigValidationError(
            key=key or "<override>",
            value=override,
            problem="malformed override",
            fix="write dotted.key=value",
        )
    try:
        parsed = OmegaConf.from_dotlist([f"{OVERRIDE_VALUE}={raw}"])
        value = OmegaConf.to_container(parsed)[OVERRIDE_VALUE]
        OmegaConf.update(tree, key, value, merge=True)
    except (OmegaConfBaseException, yaml.YAMLError) as error:
        raise ConfigValidationError(
            key=key,
            value=raw,
            problem=str(error).splitlines()[0],
            fix="address an existing list entry by index, or a mapping key",
        ) from None
