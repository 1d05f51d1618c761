"""Shared fixtures: the reference example config and its typed settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from dte_config import RunConfig, load_config

DATA = Path(__file__).parent / "data"
EXAMPLE = DATA / "gsm8k_grpo_qwen3_30b_a3b.yaml"
COMPOSED = DATA / "small_cast.yaml"


@pytest.fixture(scope="session")
def example_path() -> Path:
    """The seed-shaped reference example YAML."""
    return EXAMPLE


@pytest.fixture(scope="session")
def composed_path() -> Path:
    """A small YAML that composes the reference example through ``defaults:``."""
    return COMPOSED


@pytest.fixture(scope="session")
def example() -> RunConfig:
    """The typed settings of the reference example."""
    return load_config(EXAMPLE, []).config
