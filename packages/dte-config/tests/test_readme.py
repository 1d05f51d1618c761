"""The package README documents exactly the public names and DTE_* variables that exist."""

from __future__ import annotations

import re
from pathlib import Path

import dte_config
from dte_config.env import ENV_NAMES

README = (Path(__file__).parents[1] / "README.md").read_text()


def test_readme_lists_every_variable():
    """The settings table names every DTE_* variable, each beside its key."""
    rows = re.findall(
        r"^\| `([a-z0-9_.]+)` \| `[^`]+` \| `(DTE_[A-Z0-9_]+)` \|", README, re.MULTILINE
    )
    expected = {key.removeprefix("actor."): name for key, name in ENV_NAMES.items()}
    assert expected == dict(rows)


def test_readme_lists_every_public_name():
    """The public names table covers __all__."""
    documented = set(re.findall(r"^\| `([A-Za-z_]+)[`(,]", README, re.MULTILINE))
    documented |= set(re.findall(r"^\| `[A-Za-z_]+`, `([A-Za-z_]+)`", README, re.MULTILINE))
    expected = set(dte_config.__all__)
    assert expected == expected & documented
