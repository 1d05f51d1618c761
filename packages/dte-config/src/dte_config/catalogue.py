"""The catalogue of AReaL's experiment-config keys, shipped as data so no AReaL is needed.

``areal_keys.json`` maps every dotted key of AReaL's ``GRPOConfig`` (list entries as ``[]``:
``actor.scheduling_spec[].env_vars``) to a type spec: ``int``, ``float``, ``bool``, ``str``,
``any``, ``struct`` (a nested config), ``list[T]``, ``dict[T]`` (string keys), alternatives
joined by ``|``, and a trailing ``?`` when null is allowed. It holds names and types only.
Regenerate it with the ``areal`` extra installed::

    python -m dte_config.catalogue > packages/dte-config/src/dte_config/areal_keys.json
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.resources
import json
import sys
import types
import typing
from collections.abc import Mapping

__all__ = ["AREAL_ROOT", "AREAL_VERSION", "areal_keys", "keys_of"]

AREAL_VERSION = "1.0.4"
AREAL_ROOT = "areal.api.cli_args.GRPOConfig"
CATALOGUE_FILE = "areal_keys.json"
LIST_ENTRY = "[]"
OPTIONAL = "?"


@functools.cache
def areal_keys() -> Mapping[str, str]:
    """The shipped catalogue: dotted key -> type spec, for AReaL `AREAL_VERSION`."""
    text = importlib.resources.files(__package__).joinpath(CATALOGUE_FILE).read_text()
    document = json.loads(text)
    return types.MappingProxyType(document["keys"])


def keys_of(config_cls: type) -> dict[str, str]:
    """Walk a dataclass type and return its catalogue: dotted key -> type spec."""
    keys: dict[str, str] = {}
    _walk(config_cls, "", keys)
    return keys


def _walk(cls: type, prefix: str, keys: dict[str, str]) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        key = prefix + field.name
        keys[key] = _spec(annotation)
        separator = LIST_ENTRY + "." if _is_sequence(annotation) else "."
        for nested in _dataclasses_in(annotation):
            _walk(nested, key + separator, keys)


def _alternatives(annotation: object) -> tuple[list[object], bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [arg for arg in args if arg is not type(None)]
        return rest, len(rest) != len(args)
    return [annotation], False


def _spec(annotation: object) -> str:
    alternatives, optional = _alternatives(annotation)
    spec = "|".join(_single(alternative) for alternative in alternatives)
    return spec + (OPTIONAL if optional else "")


def _single(annotation: object) -> str:
    origin = typing.get_origin(annotation) or annotation
    args = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis]
    if dataclasses.is_dataclass(annotation):
        return "struct"
    if annotation in (int, float, bool, str):
        return annotation.__name__  # type: ignore[union-attr]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "str"
    if origin in (list, tuple):
        return f"list[{_spec(args[0]) if args else 'any'}]"
    if origin is dict:
        return f"dict[{_spec(args[1]) if args else 'any'}]"
    return "any"


def _is_sequence(annotation: object) -> bool:
    alternatives, _ = _alternatives(annotation)
    return any(typing.get_origin(alt) in (list, tuple) for alt in alternatives)


def _dataclasses_in(annotation: object) -> list[type]:
    if dataclasses.is_dataclass(annotation):
        return [annotation]  # type: ignore[list-item]
    found: list[type] = []
    for arg in typing.get_args(annotation):
        found.extend(_dataclasses_in(arg))
    return found


def _main() -> None:
    import areal.api.cli_args as cli_args  # the `areal` extra; never at module import

    document = {
        "areal_version": AREAL_VERSION,
        "root": AREAL_ROOT,
        "keys": dict(sorted(keys_of(cli_args.GRPOConfig).items())),
    }
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    _main()
