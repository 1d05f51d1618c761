"""The cluster example for the ``areal``-marked tests: the seed's YAML, run from a temp dir."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from dte_config import load_config, validate
from dte_config.load import LoadedConfig

EXAMPLE = (Path(__file__).resolve().parents[1]
           / "apps/gsm8k_separation/configs/gsm8k_grpo_qwen3_30b_a3b.yaml")
DELTA_IN_CLUSTER = ()
"""What the example needs on top to run the delta path in cluster mode: nothing, the seed's
config runs as shipped (adamw, v2 controllers)."""
DELTA_OFF = ("actor.enable_delta_weight_update=false",)
MEGATRON_STACK = all(importlib.util.find_spec(name) is not None
                     for name in ("mbridge", "megatron.core"))
"""Whether AReaL's Megatron engine could import here: it imports mbridge (Python >= 3.12)
as well as megatron-core, which the default environment has on its own."""


def areal_or_skip():
    """AReaL's config module; a skip where the areal extra is not installed."""
    return pytest.importorskip("areal.api.cli_args",
                               reason="needs the areal extra (see packages/areal-dte/README.md)")


def example_loader(tmp_path: Path, *base: str) -> Callable[..., LoadedConfig]:
    """A function: dotted overrides -> the example loaded and validated, with its file roots
    under ``tmp_path``, ``scheduler.type=local`` and the ``base`` overrides first."""
    roots = {"cluster.fileroot": tmp_path / "experiments",
             "cluster.name_resolve.nfs_record_root": tmp_path / "name_resolve"}
    for root in roots.values():
        root.mkdir()
    first = [*(f"{key}={path}" for key, path in roots.items()), "scheduler.type=local", *base]

    def load(*overrides: str) -> LoadedConfig:
        loaded = load_config(EXAMPLE, [*first, *overrides])
        validate(loaded.config)
        return loaded

    return load


def started_processes() -> list:
    """Processes this test process started (psutil comes with the areal extra), less
    multiprocessing's resource tracker and fork server, which an earlier test's spawned or
    forked ranks (``group_worker.ranks``) leave running for the life of the test process."""
    return [child for child in importlib.import_module("psutil").Process().children()
            if not any(helper in " ".join(child.cmdline()) for helper in (
                "multiprocessing.resource_tracker", "multiprocessing.forkserver"))]
