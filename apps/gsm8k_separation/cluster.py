"""The AReaL cluster mode of the GSM8K example: AReaL's own trainer, launcher and recipe.

``scheduler.type=local|slurm|ray`` (with the ``areal`` extra) runs the experiment through
AReaL 1.0.4's single-controller ``PPOTrainer`` on its local, Slurm or Ray scheduler, with
areal-dte's Megatron actor when ``actor.enable_delta_weight_update`` is on and AReaL's own
full-weight path when it is off. The GSM8K parts are AReaL's: its dataset loader
(``train_dataset.path``: ``openai/gsm8k`` or a local copy of that dataset repository, whose
README declares the ``main`` configuration), its single-turn RLVR workflow and its GSM8K
reward.

`prepare_cluster` builds everything that exists before a GPU worker starts (the
`ClusterJob`); `run_cluster` starts AReaL's trainer on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from areal_dte.areal_import import areal_module
from areal_dte.areal.areal_job import ClusterPlan, plan_cluster
from dte_config import RunConfig

WORKFLOW = "areal.workflow.rlvr.RLVRWorkflow"
"""AReaL's single-turn workflow: generate, then score the completion with ``REWARD``."""
REWARD = "areal.reward.gsm8k.gsm8k_reward_fn"
"""AReaL's GSM8K reward: 1.0 when the completion's answer matches the reference."""


@attrs.frozen(kw_only=True)
class ClusterJob:
    """A cluster run as built before any GPU worker starts."""

    plan: ClusterPlan
    """AReaL's config, scheduler, allocations and the actor's engine class."""
    train_dataset: Any = attrs.field(eq=False)
    """``train_dataset.path`` through AReaL's loader (a data-service dataset when
    ``train_dataset.scheduling_spec`` is set, AReaL's default)."""
    valid_dataset: Any = attrs.field(eq=False)
    """The same for ``valid_dataset``; None when the config has none."""
    workflow_kwargs: Mapping[str, Any] = attrs.field(eq=False)
    """Arguments of ``WORKFLOW`` for training rollouts."""
    eval_workflow_kwargs: Mapping[str, Any] = attrs.field(eq=False)
    """Arguments of ``WORKFLOW`` for evaluation (``eval_gconfig``)."""


def prepare_cluster(tree: Any, run: RunConfig) -> ClusterJob:
    """Build the run: AReaL's config and scheduler, the datasets, the workflow arguments.

    Args:
        tree: the validated experiment tree (AReaL keys and the delta keys).
        run: its typed settings.

    Raises:
        AReaLImportError: AReaL is not installed.
        ClusterModeError: a setting cluster mode cannot run, named with its fix.
    """
    plan = plan_cluster(tree, run)
    config = plan.config
    tokenizer = areal_module("areal.utils.hf_utils").load_hf_tokenizer(config.tokenizer_path)
    loader = areal_module("areal.dataset").get_custom_dataset
    valid = config.valid_dataset
    workflow = {"reward_fn": REWARD, "gconfig": config.gconfig,
                "tokenizer": config.tokenizer_path, "enable_thinking": False}
    return ClusterJob(
        plan=plan,
        train_dataset=loader(split=config.train_dataset.split,
                             dataset_config=config.train_dataset, tokenizer=tokenizer),
        valid_dataset=None if valid is None else loader(split=valid.split, dataset_config=valid,
                                                        tokenizer=tokenizer),
        workflow_kwargs=workflow,
        eval_workflow_kwargs={**workflow, "gconfig": config.eval_gconfig})


def run_cluster(job: ClusterJob) -> None:
    """Run AReaL's trainer on the job until ``total_train_epochs`` or ``total_train_steps``.

    Raises:
        AReaLImportError: AReaL's trainer, or (delta path on) its Megatron engine, cannot
            be imported.
    """
    from areal_dte.areal.areal_trainer import DeltaPPOTrainer  # imports AReaL's trainer

    with DeltaPPOTrainer(job.plan, train_dataset=job.train_dataset,
                         valid_dataset=job.valid_dataset) as trainer:
        trainer.train(workflow=WORKFLOW, workflow_kwargs=dict(job.workflow_kwargs),
                      eval_workflow=WORKFLOW, eval_workflow_kwargs=dict(job.eval_workflow_kwargs))
