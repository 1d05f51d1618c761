"""With the areal extra: the GSM8K example's cluster mode, built up to the first GPU worker.

Run: UV_PROJECT_ENVIRONMENT=/tmp/areal-venv uv run --locked --extra areal pytest -m areal
tests/test_app_cluster.py (packages/areal-dte/README.md).
"""

from __future__ import annotations

import importlib
import traceback
from pathlib import Path

import areal_example as example
import pytest
from areal_dte.areal.areal_job import DELTA_ACTOR
from areal_dte.errors import AReaLImportError
from gsm8k_separation.cluster import REWARD, WORKFLOW, prepare_cluster, run_cluster
from gsm8k_separation.model import tokenizer_dir

pytestmark = pytest.mark.areal

GSM8K = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
HF_CONFIGS = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: train.jsonl
  - split: test
    path: test.jsonl
---
"""
"""The README header of a Hugging Face dataset folder that declares openai/gsm8k's ``main``
configuration over the two jsonl files (what AReaL's GSM8K loader asks for)."""


@pytest.fixture(scope="module")
def areal():
    """AReaL's config module, or a skip without the areal extra."""
    return example.areal_or_skip()


@pytest.fixture
def load(areal, tmp_path):
    """Dotted overrides -> the example, validated, with the offline Qwen3 tokenizer."""
    return example.example_loader(tmp_path, f"tokenizer_path={tokenizer_dir()}")


@pytest.fixture
def gsm8k(tmp_path):
    """A local copy of GSM8K laid out as AReaL's loader reads openai/gsm8k."""
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K} (the shared data checkout is absent)")
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    (folder / "README.md").write_text(HF_CONFIGS)
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").symlink_to(GSM8K / f"{split}.jsonl")
    return folder


def test_prepare_builds_areal_datasets_and_workflow(load):
    """By default the datasets are AReaL data-service datasets (loaded by CPU workers once
    the trainer starts) and the workflow arguments build AReaL's RLVR workflow."""
    job = prepare_cluster(*_parts(load(*example.DELTA_IN_CLUSTER)))
    rdataset = importlib.import_module("areal.infra.data_service.rdataset").RDataset
    module, _, name = WORKFLOW.rpartition(".")
    workflow = getattr(importlib.import_module(module), name)(**job.workflow_kwargs)
    assert (rdataset, rdataset, REWARD, 4) == (
        type(job.train_dataset), type(job.valid_dataset), workflow.reward_fn,
        workflow.gconfig.n_samples)
    assert job.plan.config.eval_gconfig is job.eval_workflow_kwargs["gconfig"]


def test_gsm8k_from_train_dataset_path_through_areal(load, gsm8k):
    """train_dataset.path / valid_dataset.path go through AReaL's GSM8K loader (here on the
    controller: scheduling_spec null), and AReaL's reward scores the reference answer."""
    job = prepare_cluster(*_parts(load(
        *example.DELTA_IN_CLUSTER, f"train_dataset.path={gsm8k}", f"valid_dataset.path={gsm8k}",
        "train_dataset.scheduling_spec=null", "valid_dataset.scheduling_spec=null")))
    first = job.train_dataset[0]
    module, _, name = REWARD.rpartition(".")
    reward = getattr(importlib.import_module(module), name)
    scores = [reward(None, f"so the answer is \\boxed{{{n}}}", [], [], first["answer"])
              for n in (72, 71)]
    assert (7473, 1319, True, [1.0, 0.0]) == (
        len(job.train_dataset), len(job.valid_dataset),
        first["messages"][0]["content"].startswith("Natalia sold clips"), scores)


@pytest.mark.skipif(example.MEGATRON_STACK,
                    reason="with AReaL's Megatron stack the trainer would go on to start workers")
@pytest.mark.parametrize(("overrides", "raised", "through_areal_dte"), [
    (example.DELTA_IN_CLUSTER, AReaLImportError, True),
    (example.DELTA_OFF, ModuleNotFoundError, False),
], ids=["delta-on", "delta-off"])
def test_run_cluster_builds_the_chosen_actor_engine_first(load, overrides, raised,
                                                          through_areal_dte):
    """AReaL's trainer, run on the job, gets as far as building the actor's engine class,
    before any worker: areal-dte's Megatron actor with the delta path on, AReaL's own with
    it off. Here neither imports (no Megatron stack on Python 3.11), which shows which."""
    job = prepare_cluster(*_parts(load(*overrides)))
    with pytest.raises(raised) as caught:
        run_cluster(job)
    files = {frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)}
    engine_file = DELTA_ACTOR.rpartition(".")[0].replace(".", "/") + ".py"
    assert (True, through_areal_dte, True, []) == (
        any(f.endswith("areal/trainer/rl_trainer.py") for f in files),
        any(f.endswith(engine_file) for f in files),
        "No module named 'mbridge'" in str(caught.value), example.started_processes())


def test_seed_config_dry_run_plans_adamw_on_awex(areal, tmp_path, capsys):
    """The README's dry run of the seed's config as shipped (only the scheduler and file
    roots given, as a cluster user would): every startup check passes, exit 0, planned with
    the adamw detector over AReaL's awex group under the v2 controllers."""
    from gsm8k_separation.cli import main

    roots = [f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path}"]
    assert 0 == main(["--config", str(example.EXAMPLE), "--dry-run", "scheduler.type=slurm",
                      *roots])
    out = capsys.readouterr().out.splitlines()
    assert ["weight sync: delta (adamw), full anchor every 20 deltas, over awex (controller v2)",
            "dry run: would run the cluster job through AReaL's slurm scheduler"] == out[-2:]


def test_dry_run_with_another_areal_is_refused_in_one_line(areal, tmp_path, capsys,
                                                          monkeypatch):
    """An AReaL other than 1.0.4 under the delta path: exit 2, one line naming the installed
    version and the fix, before anything starts."""
    from areal_dte.areal import compat
    from gsm8k_separation.cli import main

    monkeypatch.setattr(compat, "version", lambda distribution: "1.0.5")
    roots = [f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path}"]
    assert 2 == main(["--config", str(example.EXAMPLE), "scheduler.type=slurm", *roots])
    assert ("error: areal version 1.0.5: areal version: expected 1.0.4, got 1.0.5; cluster "
            "mode installs itself into these exact versions (packages/areal-dte/README.md); "
            "fix: install the cluster image's versions (packages/areal-dte/README.md) in this "
            "environment, or set actor.enable_delta_weight_update=false"
            ) == capsys.readouterr().err.strip()


def _parts(loaded):
    return loaded.tree, loaded.config
