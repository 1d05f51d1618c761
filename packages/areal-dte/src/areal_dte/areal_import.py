"""AReaL modules, imported when first needed, so that areal-dte imports without AReaL."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import AReaLImportError

__all__ = ["areal_module"]


def areal_module(name: str) -> ModuleType:
    """Import the AReaL module ``name`` (``"areal.api.cli_args"``).

    Raises:
        AReaLImportError: it, or something it imports, is missing or fails to import.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise AReaLImportError(name, cause=str(exc)) from exc
