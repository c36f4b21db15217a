"""How far the trainer's log-probs are from the rollout engine's, over the tokens a loss sees.

The sums add up over microbatches and ranks; the means are the metrics the launcher logs
(``mismatch/replay/*`` and ``mismatch/live/*``).
"""

from __future__ import annotations

import numpy as np
import torch

MISMATCH_METRICS = ("logp_abs_diff", "logp_sq_diff", "k3_kl", "frac_abs_gt_ln2", "frac_abs_gt_ln5")
"""Names of the train/rollout mismatch metrics, in :func:`logprob_mismatch_metrics` order."""


def logprob_mismatch_sums(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Sums behind the train/rollout mismatch metrics, over tokens where ``mask`` is 1.

    With ``d = logp_rollout - logp_train`` per token, returns a float64 tensor ``[6]``:
    tokens, sum of ``|d|``, sum of ``d**2``, sum of the k3 KL estimate ``exp(d) - 1 - d``,
    and the numbers of tokens with ``|d| > ln 2`` (ratio outside ``[1/2, 2]``) and
    ``|d| > ln 5``. Sums (not means) so that microbatches and ranks add up; see
    :func:`logprob_mismatch_metrics`.
    """
    mask = mask.to(torch.float64)
    diff = (rollout_logprobs.to(torch.float64) - train_logprobs.to(torch.float64)) * mask
    size = diff.abs()
    return torch.stack([
        mask.sum(),
        size.sum(),
        (diff * diff).sum(),
        ((torch.exp(diff) - 1 - diff) * mask).sum(),
        ((size > np.log(2.0)).to(torch.float64) * mask).sum(),
        ((size > np.log(5.0)).to(torch.float64) * mask).sum(),
    ])


def logprob_mismatch_metrics(sums: torch.Tensor) -> dict[str, float]:
    """Means over tokens of :func:`logprob_mismatch_sums`, named as in :data:`MISMATCH_METRICS`.

    Mean ``|d|``, mean ``d**2``, mean k3 KL, and the fractions of tokens with
    ``|d| > ln 2`` and ``|d| > ln 5``.
    """
    tokens, *totals = (float(v) for v in sums)
    tokens = max(tokens, 1.0)
    return {name: total / tokens for name, total in zip(MISMATCH_METRICS, totals)}
