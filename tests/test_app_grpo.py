"""GRPO advantages, the clipped policy loss, and the embedded profile's settings."""

from __future__ import annotations


import pytest
import torch


from dte_config import ConfigValidationError
from gsm8k_separation.experiment import load_profile
from gsm8k_separation.grpo import clipped_policy_loss, group_advantages


def test_group_advantages_normalise_each_group():
    """Each group is centred and scaled by its own std; equal rewards give zeros."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    advantages = group_advantages(rewards, group_size=4)
    assert torch.allclose(torch.tensor([1.0, -1.0, 1.0, -1.0]), advantages[:4], atol=1e-5)
    assert torch.equal(torch.zeros(4), advantages[4:])


def test_group_advantages_reject_partial_groups():
    """Rewards that do not split into whole groups are an error."""
    with pytest.raises(ValueError, match=r"shape \(3,\) do not split into groups of 2"):
        group_advantages(torch.ones(3), group_size=2)


def test_clipped_loss_on_policy_is_minus_mean_advantage():
    """At ratio 1 the loss is -mean(A) over masked tokens, and its gradient is -A/count."""
    logprobs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    loss = clipped_policy_loss(logprobs, logprobs.detach(), advantages, mask, eps_clip=0.2)
    loss.backward()
    assert torch.isclose(torch.tensor(0.0), loss)  # -(1 + 1 - 2) / 3
    expected = torch.tensor([[-1 / 3, -1 / 3, 0.0], [2 / 3, 0.0, 0.0]])
    assert torch.allclose(expected, logprobs.grad)


def test_clipped_loss_clips_outside_the_range():
    """A ratio above 1 + eps with a positive advantage has no gradient (clipped)."""
    old = torch.zeros(1, 1)
    logprobs = torch.full((1, 1), 0.5, requires_grad=True)  # ratio e^0.5 > 1.2
    loss = clipped_policy_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 1),
                               eps_clip=0.2)
    loss.backward()
    assert torch.isclose(torch.tensor(-1.2), loss)
    assert torch.equal(torch.zeros(1, 1), logprobs.grad)


def test_embedded_profile_validates():
    """configs/local.yaml passes dte-config's load and startup checks as an embedded run
    (no Megatron/SGLang backend), and `embedded.*` overrides reach the app's section."""
    profile = load_profile(None, ["actor.weight_update_anchor_interval=2",
                                  "embedded.model.hidden_size=32"])
    assert 2 == profile.run.delta.weight_update_anchor_interval
    assert profile.run.delta.weight_update_delta_diagnostics.weight_digests
    assert ("", 32) == (profile.run.rl.actor_backend, profile.embedded.model.hidden_size)


def test_profile_rejects_unknown_and_bad_keys():
    """Unknown AReaL keys, broken startup checks and bad embedded keys name the key."""
    with pytest.raises(ConfigValidationError, match=r"^actor\.ppo_n_minibatches=2: "):
        load_profile(None, ["actor.ppo_n_minibatches=2"])
    with pytest.raises(ConfigValidationError, match=r"^embedded\.model\.width=3: unknown key"):
        load_profile(None, ["embedded.model.width=3"])
    with pytest.raises(ConfigValidationError,
                       match=r"^embedded\.model\.head_dim=0: must be a positive integer"):
        load_profile(None, ["embedded.model.head_dim=0"])
