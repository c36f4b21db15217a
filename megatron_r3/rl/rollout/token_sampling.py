"""How the rollout engine draws tokens: inverse-CDF sampling from uniforms drawn once per rollout.

The uniforms of a rollout are drawn on the host, all at once, from a generator seeded with
``(seed, iteration, data-parallel rank)``: one per generation step and sample. A token is then
a deterministic function of its logits and its uniform (the first vocabulary entry whose
cumulative probability exceeds it), computed in float64 wherever the logits are. So sampling
needs no host round trip per token, and the ranks of a replica, every parallel layout, a CPU
and a GPU all draw the same token from the same logits.
"""

from __future__ import annotations

import numpy as np
import torch


def sampling_uniforms(seed: int, iteration: int, data_parallel_rank: int, steps: int, count: int) -> torch.Tensor:
    """float64 ``[steps, count]`` in ``[0, 1)`` on the host: the uniform of each step and sample of a rollout."""
    state = np.random.SeedSequence([seed, iteration, data_parallel_rank]).generate_state(2)
    generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.rand((steps, count), dtype=torch.float64, generator=generator)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> torch.Tensor:
    """One token per row of ``logits`` from ``softmax(logits / temperature)``, by inverse CDF.

    Args:
        logits: ``[n, vocab]``, finite.
        uniforms: ``[n]`` in ``[0, 1)``, on the device of ``logits``.
        temperature: > 0.

    Returns:
        int64 ``[n]``: for row ``i`` the first token whose cumulative probability exceeds
        ``uniforms[i]`` (a token of probability 0 is never drawn).
    """
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)  # the scale of the sum's rounding
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=logits.shape[-1] - 1)
