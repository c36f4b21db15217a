"""megatron_r3.rl.trainer.policy_loss: GRPO group advantages and the clipped policy-gradient loss, against direct
computations."""

import math

import numpy as np
import pytest
import torch

from megatron_r3.rl.trainer.policy_loss import clipped_policy_loss_sums, group_advantages


def test_group_advantages_normalise_within_each_group():
    rng = np.random.default_rng(0)
    rewards = rng.random(12)
    advantages = group_advantages(rewards, 4, eps=1e-6)
    for g in range(3):
        group = rewards[4 * g:4 * g + 4]
        mean = sum(group) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 4)
        for i in range(4):
            assert advantages[4 * g + i] == pytest.approx((group[i] - mean) / (std + 1e-6))


def test_a_group_of_equal_rewards_has_no_advantage():
    assert group_advantages([0.5, 0.5, 1.0, 0.0], 2).tolist() == [0.0, 0.0, pytest.approx(1.0, rel=1e-5), pytest.approx(-1.0, rel=1e-5)]


def test_rewards_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="5 rewards do not split into groups of 2"):
        group_advantages(np.ones(5), 2)


def test_clipped_loss_and_its_gradient_match_a_direct_computation():
    rng = np.random.default_rng(1)
    n, clip = 64, 0.2
    logp = -rng.random(n) * 3
    old = logp + rng.normal(0, 0.3, n)  # ratios well inside and well outside [0.8, 1.2]
    adv = rng.normal(0, 1, n)
    mask = rng.random(n) < 0.7

    expected_loss, expected_grad = 0.0, np.zeros(n)
    for t in range(n):
        if not mask[t]:
            continue
        ratio = math.exp(logp[t] - old[t])
        unclipped, clipped = -adv[t] * ratio, -adv[t] * min(max(ratio, 1 - clip), 1 + clip)
        expected_loss += max(unclipped, clipped)
        # d/dlogp of the term taken: the clipped term is constant outside the clip range.
        takes_unclipped = unclipped >= clipped or 1 - clip < ratio < 1 + clip
        expected_grad[t] = -adv[t] * ratio if takes_unclipped else 0.0

    logp_t = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    loss = clipped_policy_loss_sums(logp_t, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), clip)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    np.testing.assert_allclose(logp_t.grad.numpy(), expected_grad, rtol=1e-5, atol=1e-6)
    assert (expected_grad == 0).sum() > (~mask).sum(), "some tokens should be clipped"


def test_old_logprobs_get_no_gradient():
    old = torch.zeros(3, requires_grad=True)
    loss = clipped_policy_loss_sums(torch.zeros(3, requires_grad=True), old, torch.ones(3), torch.ones(3), 0.2)
    loss.backward()
    assert old.grad is None
