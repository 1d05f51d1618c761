"""Build dte-config's attrs classes from plain mappings (YAML subtrees), strictly.

Unknown keys are rejected with a spelling hint; enum fields take their value's spelling
(``adamw``); nested attrs classes take a mapping; every other value goes to the field's own
validators unchanged, so ``"1"`` never becomes ``1``.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import attrs

from dte_config.errors import ConfigValidationError
from dte_config.validators import key_of

__all__ = ["structure", "unknown_key"]

T = TypeVar("T")


def unknown_key(key: str, value: object, *, known: Iterable[str]) -> ConfigValidationError:
    """The error for a key that no schema names, with the closest known spelling if any."""
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, sorted(known), n=1)
    parent = key[: -len(name)]
    fix = f"remove it or write {parent}{close[0]}" if close else "remove it"
    return ConfigValidationError(key=key, value=value, problem="unknown key", fix=fix)


def structure(cls: type[T], data: object, *, key: str) -> T:
    """Build `cls` from the mapping `data` written under the dotted `key`.

    Raises:
        ConfigValidationError: `data` is no mapping, has an unknown key, or a value is
            rejected by the field's validators.
    """
    if not isinstance(data, Mapping):
        raise ConfigValidationError(
            key=key,
            value=data,
            problem=f"expected a mapping of {cls.__name__} keys, got {type(data).__name__}",
            fix=f"write {key} as a mapping",
        )
    fields = {field.name: field for field in attrs.fields(attrs.resolve_types(cls))}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        field = fields.get(name)
        if field is None:
            raise unknown_key(f"{key}.{name}" if key else name, value, known=fields)
        kwargs[name] = _value(field, value)
    return cls(**kwargs)


def _value(field: attrs.Attribute[Any], value: object) -> object:
    kind = field.type
    if isinstance(kind, type) and attrs.has(kind):
        return structure(kind, value, key=key_of(field))
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and isinstance(value, str):
        spellings = {member.value: member for member in kind}
        return spellings.get(value, value)  # an unknown spelling meets the field's validator
    return value
