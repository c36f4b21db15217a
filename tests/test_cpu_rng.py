"""Megatron's RNG tracker on a machine without CUDA (patch: CPU generator states)."""

import pytest
import torch
from megatron.core.tensor_parallel import random as megatron_random

from tests.support.replay import init_single_rank


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_rank()


def seeded_draws(seed):
    megatron_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    tracker = megatron_random.get_cuda_rng_tracker()
    default = torch.rand(3)
    with tracker.fork():
        model_parallel = torch.rand(3)
    with tracker.fork(megatron_random.get_expert_parallel_rng_tracker_name()):
        expert = torch.rand(3)
    with tracker.fork():
        model_parallel_next = torch.rand(3)
    return default, model_parallel, expert, model_parallel_next


def test_seeding_and_forking_are_reproducible_and_distinct():
    first, second = seeded_draws(42), seeded_draws(42)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    default, model_parallel, expert, model_parallel_next = first
    assert not torch.equal(default, model_parallel) and not torch.equal(model_parallel, expert)
    # A fork continues its own stream, and leaves the default stream where it was.
    assert not torch.equal(model_parallel, model_parallel_next)
    assert not torch.equal(seeded_draws(43)[1], model_parallel)


def test_fork_leaves_the_default_stream_untouched():
    megatron_random.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    untouched = torch.rand(4)
    megatron_random.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    with megatron_random.get_cuda_rng_tracker().fork():
        torch.rand(10)
    assert torch.equal(torch.rand(4), untouched)


def test_recompute_replays_dropout_under_the_forked_state():
    megatron_random.model_parallel_cuda_manual_seed(5, force_reset_rng=True)
    x = torch.randn(64, requires_grad=True)

    def dropout(t):
        with megatron_random.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(t, p=0.5, training=True)

    out = megatron_random.checkpoint(dropout, False, x)
    out.sum().backward()
    # The recomputed mask is the forward's: the gradient is 2 exactly where the output is kept.
    assert torch.equal(x.grad, (out != 0).float() * 2)
