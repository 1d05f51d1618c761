"""AReaL's PPO trainer, run from a `ClusterPlan`.

Two of ``PPOTrainer``'s steps take the plan's objects: the scheduler is the plan's (AReaL
builds the same one, `areal_job.build_scheduler`), and with the delta path on the actor's
workers build the plan's engine class, areal-dte's Megatron actor, under
`controller_v2.DeltaActorControllerV2` (AReaL's v2 actor controller, whose weight updates
raise on a refusal and resend the version in full once). Everything else is
AReaL's trainer as it is, in single-controller mode; with the delta path off it is AReaL's
run unchanged. Importing this module imports AReaL's trainer (`AReaLImportError`).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..areal_import import areal_module
from .areal_job import ClusterPlan
from .controller_v2 import DeltaActorControllerV2

__all__ = ["DeltaPPOTrainer"]

_rl_trainer = areal_module("areal.trainer.rl_trainer")


class DeltaPPOTrainer(_rl_trainer.PPOTrainer):
    """``PPOTrainer`` on the plan's scheduler and actor engine.

    Args:
        plan: what `areal_job.plan_cluster` built.
        train_dataset: the training set (AReaL's ``get_custom_dataset``).
        valid_dataset: the evaluation set, or None for none.
    """

    def __init__(self, plan: ClusterPlan, *, train_dataset: Any, valid_dataset: Any = None):
        self.plan = plan
        super().__init__(plan.config, train_dataset=train_dataset, valid_dataset=valid_dataset)

    def _init_scheduler(self) -> Any:
        return self.plan.scheduler

    def _create_train_engine(self, actor_config: Any, alloc: Any) -> Any:
        if actor_config is not self.config.actor or not self.plan.delta.enable_delta_weight_update:
            return super()._create_train_engine(actor_config, alloc)
        module, _, name = self.plan.actor_engine.rpartition(".")
        engine = getattr(importlib.import_module(module), name)  # AReaLImportError stays typed
        actor = DeltaActorControllerV2(train_engine=engine, config=actor_config,
                                       scheduler=self.scheduler)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor
