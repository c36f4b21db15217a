"""The clipped policy-gradient objective (PPO / GRPO): group advantages and the per-token loss.

GRPO scores each sample against the other rollouts of its prompt: the advantage
of sample ``i`` in a group is ``(r_i - mean(r)) / (std(r) + eps)``, the same for
every one of its completion tokens. The loss of a completion token is PPO's
clipped surrogate with the importance ratio ``exp(logp - logp_old)``::

    loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio, 1 + clip_ratio))

``logp_old`` is the log-prob of the policy that sampled the token: the rollout
engine's (R3 and live routing) or the trainer's own old-log-prob pass (R2).
Sums, not means, come back, so that microbatches and ranks add up and the step
divides by the iteration's completion tokens (``calculate_per_token_loss``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages: each reward normalised within its group of ``group_size`` consecutive samples.

    Args:
        rewards: One reward per sample; the rollouts of a prompt are consecutive.
        group_size: Rollouts per prompt.
        eps: Added to the group's standard deviation; a group whose rewards are all
            equal gets advantage 0.

    Returns:
        float64 ``[len(rewards)]``.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size} rollouts per prompt")
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    return (centred / (groups.std(axis=1, keepdims=True) + eps)).reshape(-1)


def clipped_policy_loss_sums(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
) -> torch.Tensor:
    """The clipped surrogate loss summed over the tokens where ``mask`` is 1.

    Args:
        logprobs: The policy's log-probs of the sampled tokens (differentiable).
        old_logprobs: Log-probs of the policy that sampled them (not differentiated).
        advantages: Per-token advantages (the sample's, on each of its completion tokens).
        mask: 1 on the completion tokens trained on, 0 elsewhere.
        clip_ratio: PPO's epsilon; the ratio is clipped to ``[1 - clip_ratio, 1 + clip_ratio]``.

    Returns:
        The float32 loss sum, differentiable with respect to ``logprobs``.
    """
    mask = mask.to(torch.float32)
    ratio = torch.exp(logprobs.float() - old_logprobs.detach().float())
    advantages = advantages.float()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    return (torch.maximum(unclipped, clipped) * mask).sum()
