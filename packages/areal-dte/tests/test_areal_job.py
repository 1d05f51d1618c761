"""With the areal extra: AReaL 1.0.4's real config, allocations and schedulers for cluster mode.

Nothing here starts a worker or needs a GPU. Run: see the package README.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import areal_example as example
import pytest
from areal_dte.areal import compat
from areal_dte.areal.areal_job import (
    AREAL_ACTOR,
    DELTA_ACTOR,
    SGLANG_EXTENSION,
    SGLANG_EXTENSION_VAR,
    experiment_config,
    plan_cluster,
)
from areal_dte.errors import AReaLImportError, ClusterModeError, IncompatibleStackError
from dte_config import ConfigValidationError, DeltaMethod, read_env
from dte_config.env import env_variables

pytestmark = pytest.mark.areal

ON, OFF = example.DELTA_IN_CLUSTER, example.DELTA_OFF
"""The delta path as cluster mode runs it (the seed as shipped); AReaL's own full-weight path."""


@pytest.fixture(scope="module")
def areal():
    """AReaL's config module, or a skip without the areal extra."""
    return example.areal_or_skip()


@pytest.fixture
def load(areal, tmp_path):
    """Dotted overrides -> the example, validated, its file roots under tmp_path."""
    return example.example_loader(tmp_path)


def test_example_parses_into_areal_config(areal, load):
    """AReaL's own parsing builds its GRPOConfig; the delta keys stay out of it."""
    loaded = load(*ON)
    config = experiment_config(loaded.tree, loaded.config)
    assert (areal.GRPOConfig, areal.PPOActorConfig, False) == (
        type(config), type(config.actor), hasattr(config.actor, "enable_delta_weight_update"))


def test_areal_parses_both_allocations(load):
    """actor.backend and rollout.backend as AReaL's allocation parser reads them."""
    plan = plan_cluster(*_parts(load(*ON)))
    actor, rollout = plan.actor_allocation, plan.rollout_allocation
    assert ("megatron", 4, 2, 1, 8, 1, 8) == (
        actor.backend, actor.parallel.tp_size, actor.parallel.dp_size, actor.parallel.pp_size,
        actor.parallel.ep_size, actor.parallel.etp_size, actor.parallel.world_size)
    assert ("sglang", 4, 2, 1, 8) == (
        rollout.backend, rollout.parallel.tp_size, rollout.parallel.dp_size,
        rollout.parallel.pp_size, rollout.parallel.world_size)


def test_delta_settings_reach_every_worker_spec(load):
    """All DTE_* variables sit in the actor's and the rollout's scheduling specs, and a
    worker reads back exactly the run's delta settings from them."""
    loaded = load(*ON, "actor.weight_update_anchor_interval=7")
    config = plan_cluster(*_parts(loaded)).config
    specs = [*config.actor.scheduling_spec, *config.rollout.scheduling_spec]
    expected = env_variables(loaded.config.delta)
    assert [expected] * len(specs) == [_dte(spec.env_vars) for spec in specs]
    assert [loaded.config.delta] * len(specs) == [read_env(_dte(s.env_vars)) for s in specs]
    assert "7" == expected["DTE_ANCHOR_INTERVAL"]


def test_rollout_specs_name_the_sglang_extension(load):
    """With the path on, every rollout spec (and no actor spec) makes SGLang import the
    package that installs the delta SGLang adapter; with it off, none does."""
    on = plan_cluster(*_parts(load(*ON))).config
    off = plan_cluster(*_parts(load(*OFF))).config
    assert [SGLANG_EXTENSION] * len(on.rollout.scheduling_spec) == [
        spec.env_vars[SGLANG_EXTENSION_VAR] for spec in on.rollout.scheduling_spec]
    specs = [*on.actor.scheduling_spec, *off.actor.scheduling_spec,
             *off.rollout.scheduling_spec]
    assert [None] * len(specs) == [(s.env_vars or {}).get(SGLANG_EXTENSION_VAR) for s in specs]


def test_delta_on_selects_areal_dte_engine(load):
    """With the delta path on, the actor's workers build areal-dte's Megatron actor."""
    plan = plan_cluster(*_parts(load(*ON)))
    module = DELTA_ACTOR.rpartition(".")[0]
    assert (DELTA_ACTOR, True) == (plan.actor_engine, importlib.util.find_spec(module) is not None)


def test_delta_off_keeps_areal_engine_and_config(areal, load):
    """With the delta path off, AReaL's own engine and config: no DTE_* added, and the
    example's own v2/adamw settings are no obstacle."""
    loaded = load(*OFF)
    plan = plan_cluster(*_parts(loaded))
    lazy = importlib.import_module("areal.engine")._LAZY_IMPORTS  # AReaL's own class path
    assert f"{lazy['MegatronPPOActor']}.MegatronPPOActor" == AREAL_ACTOR == plan.actor_engine
    written_in_yaml = _dte(loaded.tree.actor.scheduling_spec[0].env_vars)
    specs = [*plan.config.actor.scheduling_spec, *plan.config.rollout.scheduling_spec]
    assert [written_in_yaml] * len(specs) == [_dte(spec.env_vars) for spec in specs]
    assert "DTE_ENABLE_DELTA_WEIGHT_UPDATE" not in written_in_yaml


@pytest.mark.skipif(example.MEGATRON_STACK, reason="AReaL's Megatron stack is installed here")
def test_delta_engine_without_megatron_stack_says_what_is_missing(areal):
    """Importing the worker's engine without AReaL's Megatron stack names the module."""
    with pytest.raises(AReaLImportError) as caught:
        importlib.import_module(DELTA_ACTOR.rpartition(".")[0])
    assert ("areal.engine.megatron_engine", "No module named 'mbridge'") == (
        caught.value.module, caught.value.cause)


@pytest.mark.skipif(not example.MEGATRON_STACK,
                    reason="needs AReaL's Megatron stack (Python >= 3.12)")
def test_delta_engine_is_areal_megatron_actor(areal):
    """The worker's engine class is a subclass of AReaL's Megatron PPO actor."""
    engine = importlib.import_module(DELTA_ACTOR.rpartition(".")[0]).DeltaMegatronPPOActor
    base = importlib.import_module("areal.engine.megatron_engine").MegatronPPOActor
    assert (True, DELTA_ACTOR) == (issubclass(engine, base),
                                   f"{engine.__module__}.{engine.__name__}")


REJECTED = [
    (("actor.weight_update_delta_method=snapshot",), "actor.weight_update_delta_method",
     DeltaMethod.SNAPSHOT),
    (("actor._version=v1",), "actor._version", "v1"),
    (("rollout._version=v1",), "rollout._version", "v1"),
    (("actor.weight_update_delta_diagnostics.recovery=true",),
     "actor.weight_update_delta_diagnostics.recovery", True),
    (("actor.weight_update_delta_diagnostics.deterministic_rollout=true",),
     "actor.weight_update_delta_diagnostics.deterministic_rollout", True),
    (("scheduler.type=kubernetes",), "scheduler.type", "kubernetes"),
    ((*OFF, "scheduler.type=kubernetes"), "scheduler.type", "kubernetes"),
]


@pytest.mark.parametrize(("overrides", "key", "value"), REJECTED,
                         ids=[f"{key}={value}" for _, key, value in REJECTED])
def test_what_cluster_mode_cannot_run_is_rejected_before_any_worker(load, overrides, key,
                                                                    value):
    """Each combination cluster mode cannot run raises ClusterModeError naming the key and
    the value (a ConfigValidationError, as dte-config's own rejections); no scheduler is
    built for them."""
    with pytest.raises(ClusterModeError) as caught:
        plan_cluster(*_parts(load(*overrides)))
    assert (key, value, True) == (caught.value.key, caught.value.value,
                                  isinstance(caught.value, ConfigValidationError))
    assert [] == example.started_processes()


def test_fp8_weights_are_rejected(areal, load):
    """FP8 weights (1-byte elements) are refused: the detectors compare 2-byte bits."""
    with pytest.raises(ClusterModeError) as caught:
        plan_cluster(*_parts(load(*ON, "actor.megatron.fp8_config={}")))
    assert ("actor.megatron.fp8_config", areal.FP8EngineConfig()) == (caught.value.key,
                                                                     caught.value.value)


def test_rejection_message_names_key_value_and_fix(load):
    """A v1 actor controller is refused in cluster mode, with the way out."""
    with pytest.raises(ClusterModeError) as caught:
        plan_cluster(*_parts(load("actor._version=v1")))
    expected = (
        "actor._version='v1': cluster mode sends deltas over AReaL's awex weight-update "
        "group, which only the v2 controllers use (v1 broadcasts full weights over xccl); "
        "fix: set actor._version=v2 and rollout._version=v2, or set "
        "actor.enable_delta_weight_update=false (AReaL's full-weight path)")
    assert expected == str(caught.value)


def test_seed_config_as_shipped_is_planned_with_adamw(load, caplog):
    """The seed's YAML with no override passes every startup check, dte-config's and
    cluster mode's, without a warning, and is planned with the adamw detector on the v2
    controllers (awex)."""
    with caplog.at_level(logging.WARNING, logger="areal_dte"):
        plan = plan_cluster(*_parts(load()))
    assert (DeltaMethod.ADAMW, "v2", "v2", DELTA_ACTOR, []) == (
        plan.delta.weight_update_delta_method, plan.config.actor._version,
        plan.config.rollout._version, plan.actor_engine, caplog.messages)


def test_other_areal_release_is_refused_before_any_worker(areal, load, monkeypatch):
    """With the delta path on, the plan checks the AReaL names the v2 controller wraps
    against the pinned release; with it off, AReaL's own path needs no such check."""
    monkeypatch.setattr(compat, "version", lambda distribution: "1.0.5")
    with pytest.raises(IncompatibleStackError) as caught:
        plan_cluster(*_parts(load()))
    plan = plan_cluster(*_parts(load(*OFF)))
    assert ("areal version", "1.0.4", "1.0.5", AREAL_ACTOR, []) == (
        caught.value.what, caught.value.expected, caught.value.got, plan.actor_engine,
        example.started_processes())


ACCEPTED = [
    ("actor.weight_update_delta_method=cast",),
    ("actor.weight_update_delta_diagnostics.weight_digests=true",),
    ("actor.weight_update_delta_diagnostics.phase_timing=true",),
    ("actor.weight_update_delta_diagnostics.snapshot_verification=true",),
    ("actor.backend=megatron:d2p2t2",),
    ("actor.weight_update_mode=disk",),
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[o[0] for o in ACCEPTED])
def test_what_cluster_mode_runs_is_planned(load, overrides):
    """The other detector, the validation controls that work in cluster mode, several
    pipeline stages and a weight_update_mode that the v2 controllers ignore: each is
    planned with the delta path on and reaches the workers' DTE_* settings."""
    loaded = load(*overrides)
    plan = plan_cluster(*_parts(loaded))
    specs = plan.config.actor.scheduling_spec
    assert [loaded.config.delta] * len(specs) == [read_env(_dte(s.env_vars)) for s in specs]


@pytest.mark.parametrize("kind", ["local", "slurm", "ray"])
def test_areal_schedulers_build_without_starting_workers(areal, load, kind):
    """scheduler.type builds AReaL's own scheduler; no process, no Ray cluster starts."""
    import ray

    plan = plan_cluster(*_parts(load(*ON, f"scheduler.type={kind}")))
    infra = importlib.import_module("areal.infra")
    expected = {"local": infra.LocalScheduler, "slurm": infra.SlurmScheduler,
                "ray": infra.RayScheduler}[kind]
    assert (expected, [], False) == (type(plan.scheduler), example.started_processes(),
                                     ray.is_initialized())


def test_plan_describes_itself_for_a_dry_run(load):
    """The dry run's lines: scheduler, both allocations, the engine and the sync path."""
    plan = plan_cluster(*_parts(load(*ON)))
    expected = [
        "scheduler: LocalScheduler (scheduler.type=local)",
        f"actor: megatron(actor):d2t4e8, 8 GPUs, engine {DELTA_ACTOR}",
        "rollout: sglang(rollout):d2t4, 8 GPUs",
        "weight sync: delta (adamw), full anchor every 20 deltas, over awex (controller v2)",
    ]
    assert expected == plan.describe()


def _parts(loaded):
    return loaded.tree, loaded.config


def _dte(env_vars):
    return {name: value for name, value in env_vars.items() if name.startswith("DTE_")}
