"""AReaL's private names that cluster mode relies on, checked against the pinned release.

Where cluster mode wraps or replaces a name AReaL does not publish (a module attribute
looked up at call time, a private attribute, a closure's use of a module helper), it checks
at startup that the installed AReaL is the pinned release and that the code it wraps still
uses that name, so a different AReaL fails at once with `AReaLCompatError` instead of
running AReaL's unwrapped path.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import CodeType

from .areal_import import areal_module
from .errors import PINNED_AREAL, AReaLCompatError

__all__ = ["check_release", "check_uses", "nested_code"]


def check_release() -> str:
    """The installed AReaL version, which must be `PINNED_AREAL`.

    Raises:
        AReaLCompatError: another release is installed.
    """
    installed = areal_module("areal").__version__
    if installed != PINNED_AREAL:
        raise AReaLCompatError("areal.__version__", expected=PINNED_AREAL, installed=installed)
    return installed


def check_uses(where: str, code: CodeType | None, names: Iterable[str]) -> None:
    """Check that ``code`` (the code object at ``where``, with the comprehensions and
    functions inside it) uses every one of ``names``.

    Raises:
        AReaLCompatError: another release, no such code, or a name it no longer uses.
    """
    installed = check_release()
    missing = sorted(set(names) - (_names(code) if code is not None else set()))
    if missing:
        raise AReaLCompatError(where, expected=f"code that uses {', '.join(missing)}",
                               installed=installed)


def _names(code: CodeType) -> set[str]:
    inner = (const for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*(_names(c) for c in inner))


def nested_code(code: CodeType, name: str) -> CodeType | None:
    """The code object of the function ``name`` defined directly inside ``code``."""
    return next((const for const in code.co_consts
                 if isinstance(const, CodeType) and const.co_name == name), None)
