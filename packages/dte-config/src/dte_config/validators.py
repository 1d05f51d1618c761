"""attrs validators that raise `ConfigValidationError` naming the setting's dotted key.

A field's dotted key (``actor.weight_update_anchor_interval``) lives in its metadata under
``"key"``; fields without one are named by their attribute name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs

from dte_config.errors import ConfigValidationError

__all__ = ["KIND_NAMES", "at_least", "is_kind", "key_of", "member_of", "setting", "strict"]

KIND_NAMES = {
    bool: ("true or false", "write true or false"),
    int: ("an integer", "write an integer"),
    float: ("a number", "write a number"),
    str: ("a string", "write a string (quote it if it looks like a number)"),
}

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def key_of(attribute: attrs.Attribute[Any]) -> str:
    """The dotted key a field is written under, or its attribute name."""
    return attribute.metadata.get("key", attribute.name)


def is_kind(value: object, kind: type) -> bool:
    """True when `value` is of `kind`, with bool never counting as a number."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def strict(kind: type) -> Validator:
    """Reject values whose type is not exactly `kind` (bool is no int; int is a float)."""

    def check(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not is_kind(value, kind):
            expected, fix = KIND_NAMES.get(
                kind, (f"a {kind.__name__}", f"write a mapping of {kind.__name__} keys")
            )
            raise ConfigValidationError(
                key=key_of(attribute),
                value=value,
                problem=f"expected {expected}, got {type(value).__name__}",
                fix=fix,
            )

    return check


def at_least(bound: int) -> Validator:
    """Reject integers below `bound`."""

    def check(_instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
        if value < bound:
            raise ConfigValidationError(
                key=key_of(attribute),
                value=value,
                problem=f"must be >= {bound}",
                fix=f"write an integer >= {bound}",
            )

    return check


def member_of(enum_type: type[enum.Enum]) -> Validator:
    """Reject anything that is not a member of `enum_type`."""

    def check(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, enum_type):
            choices = " | ".join(member.value for member in enum_type)
            raise ConfigValidationError(
                key=key_of(attribute),
                value=value,
                problem=f"expected one of {choices}",
                fix=f"write one of {choices}",
            )

    return check


def setting(default: Any, *, key: str, validator: Validator | list[Validator]) -> Any:
    """An attrs field with an immutable default, validators and its dotted key."""
    return attrs.field(default=default, validator=validator, metadata={"key": key})
