"""The shipped AReaL key catalogue and the strict key/type check built on it."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import attrs
import pytest
from dte_config import ConfigValidationError, RLConfig
from dte_config.catalogue import AREAL_VERSION, areal_keys, keys_of
from dte_config.schema import check_keys

NOT_IN_AREAL = {"actor.optimizer.weight_decay_incr_style"}


def test_catalogue_covers_every_checked_key():
    """Every AReaL key that RLConfig reads is in the catalogue (one is a documented extra)."""
    read = {field.metadata["key"] for field in attrs.fields(RLConfig) if "key" in field.metadata}
    expected = NOT_IN_AREAL
    assert expected == {key for key in read if key not in areal_keys()}


def test_catalogue_is_areal_1_0_4():
    """The catalogue describes AReaL 1.0.4's GRPOConfig, the version the extra pins."""
    expected = ("1.0.4", "list[struct]", "dict[str]", "int", "struct?")
    keys = areal_keys()
    assert expected == (
        AREAL_VERSION,
        keys["actor.scheduling_spec"],
        keys["actor.scheduling_spec[].env_vars"],
        keys["actor.ppo_n_minibatches"],
        keys["ref"],
    )


class _Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class _Spec:
    env_vars: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Engine:
    specs: tuple[_Spec, ...] = ()
    limit: int | None = None
    colour: _Colour = _Colour.RED
    extra: Any = None
    either: int | str = 0
    sizes: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Root:
    engine: _Engine | None = None
    rate: float = 0.0


def test_keys_of_walks_nested_dataclasses():
    """keys_of flattens nested dataclasses, lists of them, optionals, unions and enums."""
    expected = {
        "engine": "struct?",
        "engine.specs": "list[struct]",
        "engine.specs[].env_vars": "dict[str]",
        "engine.limit": "int?",
        "engine.colour": "str",
        "engine.extra": "any",
        "engine.either": "int|str",
        "engine.sizes": "list[int]",
        "rate": "float",
    }
    assert expected == keys_of(_Root)


CATALOGUE = keys_of(_Root)


@pytest.mark.parametrize(
    "tree",
    [
        {"rate": 1},
        {"rate": 0.5, "engine": None},
        {"engine": {"limit": None, "either": "x", "extra": [1, {"a": None}]}},
        {"engine": {"specs": [{"env_vars": {"A": "1"}}, {}], "sizes": [1, 2]}},
    ],
    ids=["int-is-a-number", "null-optional", "union-and-any", "list-of-structs"],
)
def test_check_accepts_well_typed_trees(tree):
    """Trees whose keys and types match the catalogue pass."""
    expected = None
    assert expected == check_keys(tree, CATALOGUE)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"rate": True}, "rate=true: expected a number, got bool; fix: write a number"),
        (
            {"engine": {"limit": 1.5}},
            "engine.limit=1.5: expected an integer or null, got float; "
            "fix: write an integer or null",
        ),
        (
            {"engine": {"either": 1.5}},
            "engine.either=1.5: expected an integer or a string, got float; fix: write an integer "
            "or write a string (quote it if it looks like a number)",
        ),
        (
            {"engine": {"sizes": [1, "2"]}},
            "engine.sizes.1='2': expected an integer, got str; fix: write an integer",
        ),
        (
            {"engine": {"specs": [{}, {"env_vars": {"A": 1}}]}},
            "engine.specs.1.env_vars.A=1: expected a string, got int; fix: write a string "
            "(quote it if it looks like a number)",
        ),
        (
            {"engine": {"specs": {"env_vars": {}}}},
            "engine.specs={'env_vars': {}}: expected a list, got dict; fix: write a list",
        ),
        (
            {"engine": {"specs": [{"env_var": {}}]}},
            "engine.specs.0.env_var={}: unknown key; "
            "fix: remove it or write engine.specs.0.env_vars",
        ),
        (
            {"engine": 3},
            "engine=3: expected a mapping or null, got int; fix: write a mapping or null",
        ),
        ({"zzz": 1}, "zzz=1: unknown key; fix: remove it"),
    ],
    ids=[
        "bool-not-number",
        "float-not-int",
        "union",
        "list-entry",
        "dict-value",
        "not-a-list",
        "unknown-in-list-entry",
        "not-a-mapping",
        "unknown-no-hint",
    ],
)
def test_check_rejects_with_message(tree, message):
    """The first unknown key or wrong type raises, naming its dotted key and index."""
    with pytest.raises(ConfigValidationError) as caught:
        check_keys(tree, CATALOGUE)
    assert message == str(caught.value)


@pytest.mark.areal
def test_catalogue_matches_installed_areal():
    """The shipped catalogue equals the one generated from the installed AReaL."""
    cli_args = pytest.importorskip(
        "areal.api.cli_args", reason="needs the areal extra (see the package README)"
    )
    expected = dict(areal_keys())
    assert expected == keys_of(cli_args.GRPOConfig)
