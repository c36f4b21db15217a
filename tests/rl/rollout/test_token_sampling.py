"""megatron_r3.rl.rollout.token_sampling: the engine's inverse-CDF draws from uniforms drawn once per rollout."""

import numpy as np
import pytest
import torch

from megatron_r3.rl.rollout.token_sampling import sample_tokens, sampling_uniforms


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.5, -3.0, 0.0], dtype=torch.float64)
    draws = 200_000
    for temperature in (0.5, 1.0, 2.0):
        uniforms = sampling_uniforms(seed=7, iteration=int(temperature * 10), data_parallel_rank=0, steps=1,
                                     count=draws)[0]
        tokens = sample_tokens(logits.expand(draws, -1), uniforms, temperature)
        frequency = np.bincount(tokens.numpy(), minlength=len(logits)) / draws
        p = torch.softmax(logits / temperature, dim=-1).numpy()
        # Binomial counts: 5 standard deviations, about 1 in 2 million per token by chance.
        assert np.all(np.abs(frequency - p) <= 5 * np.sqrt(p * (1 - p) / draws) + 1e-12), (temperature, frequency, p)


def test_a_token_of_probability_zero_is_never_drawn_whatever_the_uniform():
    logits = torch.tensor([[-float("inf"), 0.0, -float("inf"), 1.0, -float("inf")]] * 4, dtype=torch.float64)
    uniforms = torch.tensor([0.0, 1e-300, 0.5, 1 - 2 ** -53], dtype=torch.float64)
    assert sample_tokens(logits, uniforms, 1.0).tolist() == [1, 1, 3, 3]


def test_each_token_is_the_first_whose_cumulative_probability_exceeds_its_uniform():
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(64, 37)) * 3)
    uniforms = torch.from_numpy(rng.random(64))
    cdf = np.cumsum(torch.softmax(logits, dim=-1).numpy(), axis=-1)
    expected = [int(np.argmax(row > u * row[-1])) for row, u in zip(cdf, uniforms.numpy())]
    assert sample_tokens(logits.float(), uniforms, 1.0).tolist() == expected  # float32 logits, float64 draws


def test_uniforms_depend_on_seed_iteration_and_rank_only():
    a = sampling_uniforms(1, 2, 0, steps=5, count=8)
    assert a.dtype == torch.float64 and a.shape == (5, 8) and bool(((a >= 0) & (a < 1)).all())
    assert torch.equal(a, sampling_uniforms(1, 2, 0, steps=5, count=8))
    for other in (sampling_uniforms(2, 2, 0, 5, 8), sampling_uniforms(1, 3, 0, 5, 8), sampling_uniforms(1, 2, 1, 5, 8)):
        assert not torch.equal(a, other)


@pytest.mark.gpu
def test_a_gpu_draws_the_tokens_a_cpu_draws():
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.normal(size=(256, 1000)) * 4)
    uniforms = sampling_uniforms(0, 1, 0, steps=1, count=256)[0]
    cpu = sample_tokens(logits, uniforms, 0.7)
    gpu = sample_tokens(logits.cuda(), uniforms.cuda(), 0.7).cpu()
    # A float64 cumsum summed in another order moves a boundary by ~1e-16: no draw lands that close.
    assert torch.equal(cpu, gpu)
