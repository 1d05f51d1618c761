"""GRPO's two pieces: group-normalised advantages and the clipped policy-gradient loss."""

from __future__ import annotations

import torch

ADVANTAGE_EPS = 1e-6
"""Added to a group's reward std, so a group of equal rewards gets zero advantages."""


def group_advantages(rewards: torch.Tensor, *, group_size: int, scale_by_std: bool = True
                     ) -> torch.Tensor:
    """``(r - mean(group)) / (std(group) + eps)`` for consecutive groups of `group_size`.

    Args:
        rewards: one reward per completion, groups of the same prompt consecutive.
        group_size: completions per prompt.
        scale_by_std: divide by the group's (population) std; off: mean-centred only.

    Raises:
        ValueError: the rewards do not split into whole groups.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups "
                         f"of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, unbiased=False, keepdim=True) + ADVANTAGE_EPS)
    return centred.reshape(-1)


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, *, eps_clip: float,
                        eps_clip_higher: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate, averaged over the completion tokens in `mask`.

    ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)`` per token, with
    ``ratio = exp(logprobs - old_logprobs)`` and one advantage per sequence.

    Args:
        logprobs: ``[batch, tokens]`` log-probabilities under the current policy.
        old_logprobs: the same under the policy that generated them (no gradient).
        advantages: ``[batch]``.
        mask: ``[batch, tokens]``, 1 for completion tokens that count.
        eps_clip: lower (and, without `eps_clip_higher`, upper) clip range.
        eps_clip_higher: upper clip range (DAPO's clip-higher); None: `eps_clip`.
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())
    upper = eps_clip if eps_clip_higher is None else eps_clip_higher
    adv = advantages.unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_clip, 1 + upper) * adv)
    weights = mask.to(surrogate.dtype)
    return -(surrogate * weights).sum() / weights.sum().clamp(min=1)
