"""The deterministic rollout diagnostics tell a single differing weight element apart."""

from __future__ import annotations

import torch
from gsm8k_separation.experiment import load_profile
from gsm8k_separation.rollout import RolloutWorker
from gsm8k_separation.spec import job_spec

PROMPTS = ["Natalia sold clips to 48 of her friends in April. How many clips? "]


def test_one_flipped_element_breaks_identity(tmp_path):
    """Both copies hold the same bits: identical. One bf16 element of the delta-synced
    copy one pattern off: the diagnostics report a difference."""
    profile = load_profile(None, [
        "actor.weight_update_delta_diagnostics.deterministic_rollout=true",
        "gconfig.max_new_tokens=4", "embedded.model.hidden_size=32",
        "embedded.model.intermediate_size=48"])
    spec = job_spec(profile, store=tmp_path / "store", reference_store=tmp_path / "reference",
                    model=None)
    worker = RolloutWorker(spec)
    torch.manual_seed(0)
    with torch.no_grad():
        for ours, theirs in zip(worker.policy.parameters(), worker.reference.parameters(),
                                strict=True):
            ours.copy_(torch.randn_like(ours))
            theirs.copy_(ours)
    assert worker.diagnose(prompts=PROMPTS, seed=7)["identical"]
    norm = worker.policy.model.norm.weight.data
    norm.view(torch.int16)[0] += 1
    assert not worker.diagnose(prompts=PROMPTS, seed=7)["identical"]
