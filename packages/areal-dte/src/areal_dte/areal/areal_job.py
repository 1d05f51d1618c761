"""AReaL 1.0.4's own objects for a run in cluster mode, built from this project's config.

`plan_cluster` takes the validated experiment tree (AReaL keys plus the delta keys under
``actor``, as `dte_config.load_config` returns it) and builds, with AReaL's own code and
before any worker starts:

- AReaL's ``GRPOConfig``, through AReaL's structured-config parsing (`experiment_config`).
  AReaL has no delta keys, so they are left out of what it parses and reach the workers as
  ``DTE_*`` variables (`dte_config.export_env`) in the ``env_vars`` of every scheduling
  spec: the actor's, the rollout's, the datasets';
- the scheduler of ``scheduler.type`` (`build_scheduler`), as AReaL's trainer builds it;
- AReaL's parse of both allocations (``actor.backend``, ``rollout.backend``);
- the import path of the actor's engine class (`actor_engine`): areal-dte's Megatron
  actor with the delta path on, AReaL's own with it off;
- with the delta path on, SGLang's external-model package in the rollout specs
  (`SGLANG_EXTENSION`), through which every rollout process installs the delta SGLang
  adapter.

With the delta path on, `cluster_rules` rejects what cluster mode cannot run.
"""

from __future__ import annotations

import attrs
from dte_config import DeltaConfig, RunConfig, export_env
from dte_config.load import LoadedConfig
from omegaconf import DictConfig, OmegaConf

from ..areal_import import areal_module
from ..errors import ClusterModeError
from .cluster_rules import check_areal

__all__ = [
    "AREAL_ACTOR",
    "DELTA_ACTOR",
    "SGLANG_EXTENSION",
    "SGLANG_EXTENSION_VAR",
    "ClusterPlan",
    "actor_engine",
    "build_scheduler",
    "experiment_config",
    "plan_cluster",
]

AREAL_ACTOR = "areal.engine.megatron_engine.MegatronPPOActor"
"""AReaL's Megatron PPO actor: its full-weight update runs unchanged."""
DELTA_ACTOR = "areal_dte.areal.megatron_actor.DeltaMegatronPPOActor"
"""AReaL's actor with the delta path; train workers import it by this path."""
SGLANG_EXTENSION_VAR = "SGLANG_EXTERNAL_MODEL_PACKAGE"
SGLANG_EXTENSION = "areal_dte.areal.sglang_ext"
"""The package SGLang imports in every rollout process (``SGLANG_EXTENSION_VAR`` in the
rollout specs' ``env_vars``): it installs the delta SGLang adapter (`sglang_ext`)."""
SCHEDULERS = {"local": "LocalScheduler", "slurm": "SlurmScheduler", "ray": "RayScheduler"}
"""``scheduler.type`` -> AReaL's scheduler class in ``areal.infra``."""


def experiment_config(tree: DictConfig, run: RunConfig):
    """AReaL's ``GRPOConfig`` of the experiment, the delta settings in its workers' env.

    Args:
        tree: the experiment tree with the delta keys (``dte_config.load_config(...).tree``).
        run: its typed settings (``.config``), validated.

    Returns:
        AReaL's ``GRPOConfig`` as AReaL's own parsing builds it; with the delta path on,
        every scheduling spec's ``env_vars`` holds all ``DTE_*`` variables.

    Raises:
        AReaLImportError: AReaL is not installed.
    """
    cli_args = areal_module("areal.api.cli_args")
    trimmed = LoadedConfig(tree=tree, config=run).without_delta_keys()
    config = OmegaConf.to_object(cli_args.to_structured_cfg(trimmed, cli_args.GRPOConfig))
    if run.delta.enable_delta_weight_update:
        # Only the workers read them, from their specs: the controller's environment stays.
        export_env(run.delta, environ={}, tree=config)
        for spec in config.rollout.scheduling_spec:
            spec.env_vars = {**(spec.env_vars or {}), SGLANG_EXTENSION_VAR: SGLANG_EXTENSION}
    return config


def build_scheduler(config):
    """AReaL's scheduler for ``config.scheduler.type``, built as AReaL's trainer builds it.

    Building one starts no worker; local and slurm clear this trial's name-resolve entries
    and need ``cluster.fileroot`` (and an nfs ``name_resolve.nfs_record_root``) to exist.

    Raises:
        ClusterModeError: ``scheduler.type`` is not local, slurm or ray.
    """
    kind = config.scheduler.type
    if kind not in SCHEDULERS:
        raise ClusterModeError(key="scheduler.type", value=kind,
                               problem="cluster mode runs on AReaL's schedulers",
                               fix=f"set scheduler.type to one of {', '.join(SCHEDULERS)}")
    return getattr(areal_module("areal.infra"), SCHEDULERS[kind])(exp_config=config)


def actor_engine(delta: DeltaConfig) -> str:
    """Import path of the engine class the actor's workers build."""
    return DELTA_ACTOR if delta.enable_delta_weight_update else AREAL_ACTOR


@attrs.frozen(kw_only=True)
class ClusterPlan:
    """Everything built before any worker starts; `areal_trainer.DeltaPPOTrainer` runs it."""

    config: object = attrs.field(eq=False)
    """AReaL's ``GRPOConfig`` (``DTE_*`` in the scheduling specs with the delta path on)."""
    delta: DeltaConfig
    """The delta settings."""
    scheduler: object = attrs.field(eq=False)
    """AReaL's scheduler of ``scheduler.type``; no worker started."""
    actor_allocation: object = attrs.field(eq=False)
    """AReaL's ``ModelAllocation`` of ``actor.backend``."""
    rollout_allocation: object = attrs.field(eq=False)
    """AReaL's ``ModelAllocation`` of ``rollout.backend``."""
    actor_engine: str
    """Import path of the actor's engine class (`actor_engine`)."""

    def describe(self) -> list[str]:
        """A few lines for a dry run: scheduler, allocations, engine, weight sync."""
        delta, actor = self.delta, self.config.actor
        sync = (f"delta ({delta.weight_update_delta_method.value}), full anchor every "
                f"{delta.weight_update_anchor_interval} deltas, over awex (controller "
                f"{actor._version})"
                if delta.enable_delta_weight_update
                else f"AReaL's full-weight path ({actor.weight_update_mode}, controller "
                     f"{actor._version})")
        return [
            f"scheduler: {type(self.scheduler).__name__} (scheduler.type="
            f"{self.config.scheduler.type})",
            f"actor: {self.actor_allocation}, {self.actor_allocation.parallel.world_size} "
            f"GPUs, engine {self.actor_engine}",
            f"rollout: {self.rollout_allocation}, "
            f"{self.rollout_allocation.parallel.world_size} GPUs",
            f"weight sync: {sync}",
        ]


def plan_cluster(tree: DictConfig, run: RunConfig) -> ClusterPlan:
    """AReaL's config, allocations and scheduler for the experiment; no worker started.

    Raises:
        AReaLImportError: AReaL is not installed.
        ClusterModeError: a setting cluster mode cannot run (`cluster_rules`), or an
            unknown ``scheduler.type``.
        IncompatibleStackError: with the delta path on, an AReaL other than the pinned release
            (`controller_v2.check_controller`).
    """
    config = experiment_config(tree, run)
    check_areal(config, run.delta)
    if run.delta.enable_delta_weight_update:  # the controller's AReaL names, before any worker
        areal_module("areal_dte.areal.controller_v2").check_controller()
    allocation = areal_module("areal.api.alloc_mode").ModelAllocation
    return ClusterPlan(
        config=config,
        delta=run.delta,
        actor_allocation=allocation.from_str(config.actor.backend, name="actor"),
        rollout_allocation=allocation.from_str(config.rollout.backend, name="rollout"),
        scheduler=build_scheduler(config),
        actor_engine=actor_engine(run.delta),
    )
