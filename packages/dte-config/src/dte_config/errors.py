"""Errors raised by dte-config: one root, and leaves that also subclass the matching builtin.

Every rejection names the dotted key, the value found and the fix, so a user can act on the
message alone: ``actor.ppo_n_minibatches=2: <why>; fix: <what to set>``.
"""

from __future__ import annotations

import enum

__all__ = ["ConfigError", "ConfigFileError", "ConfigValidationError", "show"]


def show(value: object) -> str:
    """Render a setting's value the way a user writes it in YAML or on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return repr(value.value)  # enum members show their YAML spelling
    return repr(value)


class ConfigError(Exception):
    """Root of every error that dte-config raises."""


class ConfigValidationError(ConfigError, ValueError):
    """A setting is rejected: unknown key, wrong type, bad value or a broken cross-field rule.

    Attributes:
        key: dotted key of the setting (``actor.ppo_n_minibatches``) or a variable's name.
        value: the value found.
        problem: why it is rejected.
        fix: what to set instead.
    """

    def __init__(self, *, key: str, value: object, problem: str, fix: str) -> None:
        self.key = key
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{key}={show(value)}: {problem}; fix: {fix}")

    def __reduce__(self):  # keyword-only __init__: pickle through a helper
        return (_rebuild, (self.key, self.value, self.problem, self.fix))


def _rebuild(key: str, value: object, problem: str, fix: str) -> ConfigValidationError:
    return ConfigValidationError(key=key, value=value, problem=problem, fix=fix)


class ConfigFileError(ConfigError, FileNotFoundError):
    """A config file, or a file named in its ``defaults:`` list, does not exist."""

    def __init__(self, *, path: str, named_by: str) -> None:
        self.path = path
        self.named_by = named_by
        super().__init__(f"config file {path} not found (named by {named_by})")

    def __reduce__(self):
        return (ConfigFileError._rebuild, (self.path, self.named_by))

    @staticmethod
    def _rebuild(path: str, named_by: str) -> ConfigFileError:
        return ConfigFileError(path=path, named_by=named_by)
