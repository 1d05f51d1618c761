"""Check a plain config tree against the AReaL key catalogue: unknown keys and wrong types.

Types are strict: bool is not an integer, an integer is a number, and strings are never
converted (``ppo_n_minibatches: "2"`` is rejected, where OmegaConf would convert it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from dte_config.catalogue import LIST_ENTRY, OPTIONAL
from dte_config.errors import ConfigValidationError
from dte_config.structure import unknown_key
from dte_config.validators import KIND_NAMES, is_kind

__all__ = ["check_keys"]

SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def check_keys(tree: Mapping[str, object], catalogue: Mapping[str, str]) -> None:
    """Reject the first key of `tree` that `catalogue` lacks or whose value has the wrong type.

    Raises:
        ConfigValidationError: naming the dotted key (list entries by index), the value and
            the fix.
    """
    children: dict[str, dict[str, str]] = defaultdict(dict)
    for key, spec in catalogue.items():
        parent, _, name = key.rpartition(".")
        children[parent][name] = spec
    _check_struct(tree, "", "", children)


def _check_struct(
    node: Mapping[str, object], path: str, shown: str, children: Mapping[str, dict[str, str]]
) -> None:
    known = children.get(path, {})
    for name, value in node.items():
        key = f"{shown}.{name}" if shown else str(name)
        if name not in known:
            raise unknown_key(key, value, known=known)
        _check_value(value, known[name], f"{path}.{name}" if path else str(name), key, children)


def _check_value(
    value: object, spec: str, path: str, shown: str, children: Mapping[str, dict[str, str]]
) -> None:
    if value is None and spec.endswith(OPTIONAL):
        return
    alternatives = spec.removesuffix(OPTIONAL).split("|")
    for alternative in alternatives:
        if _fits(value, alternative):
            _check_inside(value, alternative, path, shown, children)
            return
    raise _wrong_type(shown, value, alternatives, nullable=spec.endswith(OPTIONAL))


def _fits(value: object, spec: str) -> bool:
    if spec == "any":
        return True
    if spec == "struct" or spec.startswith("dict["):
        return isinstance(value, Mapping)
    if spec.startswith("list["):
        return isinstance(value, Sequence) and not isinstance(value, str)
    return is_kind(value, SCALARS[spec])


def _check_inside(
    value: object, spec: str, path: str, shown: str, children: Mapping[str, dict[str, str]]
) -> None:
    if spec == "struct":
        _check_struct(value, path, shown, children)  # type: ignore[arg-type]
    elif spec.startswith("list["):
        for index, item in enumerate(value):  # type: ignore[arg-type]
            _check_value(item, spec[5:-1], path + LIST_ENTRY, f"{shown}.{index}", children)
    elif spec.startswith("dict["):
        for name, item in value.items():  # type: ignore[union-attr]
            _check_value(item, spec[5:-1], path + LIST_ENTRY, f"{shown}.{name}", children)


def _describe(spec: str) -> tuple[str, str]:
    if spec in SCALARS:
        return KIND_NAMES[SCALARS[spec]]
    if spec == "struct" or spec.startswith("dict["):
        return "a mapping", "write a mapping"
    return "a list", "write a list"


def _wrong_type(
    key: str, value: object, alternatives: list[str], *, nullable: bool
) -> ConfigValidationError:
    described = [_describe(spec) for spec in alternatives]
    expected = " or ".join(name for name, _ in described) + (" or null" if nullable else "")
    return ConfigValidationError(
        key=key,
        value=value,
        problem=f"expected {expected}, got {type(value).__name__}",
        fix=" or ".join(fix for _, fix in described) + (" or null" if nullable else ""),
    )
