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


class _Permuted(Exception):
    """The dispatch took the host counts and reached the permutation."""


def _fused_dispatch_worker():
    """A dispatcher over 2 tp_ep ranks (EP=2 in the parallel state) under a config that says
    expert_model_parallel_size=1, with the fused permutation and host counts. Returns the
    dispatcher's error, or "permuted" where it took the counts."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_parallel(LAYOUT)
    try:
        num_experts, topk, hidden = 4, 2, 8
        config = TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=num_experts,
            moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
            use_cpu_initialization=True, add_bias_linear=False,
        )
        rank = dist.get_rank()
        local = [rank * 2, rank * 2 + 1]
        dispatcher = MoEAlltoAllTokenDispatcher(
            len(local), local, config, moe_utils.get_default_pg_collection()
        )
        assert dispatcher.tp_size * dispatcher.ep_size == 2
        # The fused permutation needs TransformerEngine to build; the dispatch only reads the flag.
        config.moe_permute_fusion = True

        def permute(*args, **kwargs):
            raise _Permuted

        token_dispatcher.permute = permute
        ids = torch.rand(6, num_experts, generator=torch.Generator().manual_seed(rank))
        ids = ids.topk(topk, dim=-1).indices
        routing_map = torch.zeros(6, num_experts, dtype=torch.bool).scatter(1, ids, True)
        own = torch.bincount(ids.flatten(), minlength=num_experts)
        matrix = [torch.empty_like(own) for _ in range(2)]
        dist.all_gather(matrix, own)
        try:
            dispatcher.dispatch_preprocess(
                torch.randn(6, hidden), routing_map, routing_map.float() / topk,
                host_tokens_per_expert=torch.stack(matrix),
            )
        except ValueError as err:
            return str(err)
        except _Permuted:
            return "permuted"
        return "dispatched"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_a_dispatcher_of_two_ranks_refuses_host_counts_with_the_fused_permutation():
    """The fused sort by local expert takes device split sizes, so host counts are refused over
    more than one tp_ep rank: the dispatcher's own group of 2 decides, not the config's
    expert_tensor_parallel_size * expert_model_parallel_size of 1 (sized from the config, the
    counts were taken and the dispatch reached the permutation)."""
    errors = run_workers(_fused_dispatch_worker, 2)
    assert all("moe_permute_fusion" in e for e in errors), errors
