"""megatron_r3.rl.trainer.logprob_mismatch: the train/rollout mismatch sums and metrics."""

import numpy as np
import pytest
import torch

from megatron_r3.rl.trainer.logprob_mismatch import logprob_mismatch_metrics, logprob_mismatch_sums


def test_mismatch_sums_follow_their_definitions():
    rng = np.random.default_rng(1)
    train = -rng.random(50) * 3
    rollout = train + rng.normal(0, 1.0, 50)
    mask = rng.random(50) < 0.6
    sums = logprob_mismatch_sums(torch.tensor(train), torch.tensor(rollout), torch.tensor(mask))
    d = (rollout - train)[mask]
    ratio = np.exp(-d)
    expected = [mask.sum(), np.abs(d).sum(), (d * d).sum(), (np.exp(d) - 1 - d).sum(),
                ((ratio < 1 / 2) | (ratio > 2)).sum(), ((ratio < 1 / 5) | (ratio > 5)).sum()]
    assert expected[5] > 0
    np.testing.assert_allclose(sums.numpy(), expected, rtol=1e-12)
    metrics = logprob_mismatch_metrics(sums)
    assert list(metrics) == ["logp_abs_diff", "logp_sq_diff", "k3_kl", "frac_abs_gt_ln2", "frac_abs_gt_ln5"]
    assert metrics["logp_abs_diff"] == pytest.approx(np.abs(d).mean())
    assert metrics["logp_sq_diff"] == pytest.approx((d * d).mean())
    assert metrics["frac_abs_gt_ln2"] == pytest.approx(expected[4] / mask.sum())
    assert metrics["frac_abs_gt_ln5"] == pytest.approx(expected[5] / mask.sum())
