"""Host token counts over expert parallelism: every rank of the tp_ep group must pass the same
matrix (each sends by its own row and receives by the others'). moe_check_host_tokens_per_expert_
across_ranks checks that they do, by name, before the first dispatch of a forward: a matrix that
differs only in another rank's row passes every rank's own-row check."""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_r3.routing_replay import moe_routing_for_chunk
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt

MODEL = TinyMoE()
LAYOUT = Layout(ep=2, dp=2)


def _worker(rank_with_another_matrix):
    """One replayed forward with host counts on 2 ranks (EP=2); the rank named holds a matrix
    whose other rank's row has two expert counts swapped. Returns the error, or None."""
    init_parallel(LAYOUT)
    try:
        _, (chunk,) = build_gpt(LAYOUT, MODEL, flags=["--moe-enable-routing-replay"],
                                moe_check_host_tokens_per_expert_across_ranks=True)
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, MODEL.vocab_size, (2, 8), generator=gen)
        layers = [i + 1 for i in MODEL.moe_layers]
        ids = torch.rand(len(layers), tokens.numel(), MODEL.num_experts, generator=gen)
        ids = ids.topk(MODEL.topk, dim=-1).indices
        own = torch.stack([torch.bincount(row.flatten(), minlength=MODEL.num_experts) for row in ids])
        matrix = [torch.empty_like(own) for _ in range(dist.get_world_size())]
        dist.all_gather(matrix, own, group=parallel_state.get_expert_tensor_and_model_parallel_group())
        matrix = torch.stack(matrix)
        if rank == rank_with_another_matrix:
            other = 1 - rank
            row = matrix[other, 0]
            first, second = int(row.argmax()), int(row.argmin())
            row[[first, second]] = row[[second, first]]
        routing = moe_routing_for_chunk(chunk, ids, layers, every_token_routed=True,
                                        host_tokens_per_expert=matrix)
        try:
            chunk(tokens, torch.arange(8).expand(2, -1), None, extra_block_kwargs={"moe_routing": routing})
        except ValueError as err:
            return str(err)
        return None
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_ranks_that_hold_another_matrix_are_named_before_the_dispatch():
    errors = run_workers(_worker, 2, 1)
    assert all(e is not None and "ranks [1] of it hold another matrix than its rank 0" in e
               for e in errors), errors


@pytest.mark.slow
def test_the_same_matrix_on_every_rank_passes():
    assert run_workers(_worker, 2, None) == [None, None]
