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


def _fused_dispatch_worker():
    """A dispatcher over 2 tp_ep ranks with 2 local experts each, under moe_permute_fusion: one
    dispatch and combine with host counts and one counted by the dispatcher, TE's fused
    permutation and sort played by Megatron's unfused ones (what the dispatcher hands the fused
    sort is what is checked here; the GPU tests run TE's kernels). Returns the two expert-side
    inputs and outputs, the counts per local expert, and the split sizes the fused sorts got."""
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
        assert dispatcher.tp_size * dispatcher.ep_size == 2 and dispatcher.sort_by_local_expert
        config.moe_permute_fusion = True  # set after the build: the fused permutation needs TE to build
        sorted_by = []

        def unfused(function, record=False):
            def call(*args, fused, **kwargs):
                assert fused
                if record:
                    sorted_by.append(args[1].clone())
                return function(*args, fused=False, **kwargs)
            return call

        token_dispatcher.permute = unfused(moe_utils.permute)
        token_dispatcher.unpermute = unfused(moe_utils.unpermute)
        token_dispatcher.sort_chunks_by_idxs = unfused(moe_utils.sort_chunks_by_idxs, record=True)
        gen = torch.Generator().manual_seed(rank)
        ids = torch.rand(7, num_experts, generator=gen).topk(topk, dim=-1).indices  # 7 tokens: odd
        routing_map = torch.zeros(7, num_experts, dtype=torch.bool).scatter(1, ids, True)
        probs = routing_map.float() / topk
        tokens = torch.randn(7, hidden, generator=gen)
        own = torch.bincount(ids.flatten(), minlength=num_experts)
        matrix = [torch.empty_like(own) for _ in range(2)]
        dist.all_gather(matrix, own)
        results = {}
        for name, counts in (("host", torch.stack(matrix)), ("device", None)):
            sorted_by.clear()
            hidden_states, probs_out = dispatcher.dispatch_preprocess(
                tokens, routing_map, probs, host_tokens_per_expert=counts)
            hidden_states, probs_out = dispatcher.token_dispatch(hidden_states, probs_out)
            expert_in, per_expert, _ = dispatcher.dispatch_postprocess(hidden_states, probs_out)
            out = dispatcher.combine_postprocess(dispatcher.token_combine(
                dispatcher.combine_preprocess(expert_in * 2)))
            results[name] = (dispatcher.counts_on_host, expert_in, out, per_expert.cpu(),
                             [s.cpu() for s in sorted_by])
        return results, tokens
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_a_dispatcher_of_two_ranks_takes_host_counts_under_the_fused_permutation():
    """Under moe_permute_fusion the sort by local expert takes its split sizes from the host
    counts (on the device where there is one): the same expert inputs, counts and combined
    outputs as the dispatch that counts on the device, over 2 tp_ep ranks and an odd token count."""
    for results, tokens in run_workers(_fused_dispatch_worker, 2):
        host, device = results["host"], results["device"]
        assert (host[0], device[0]) == (True, False)
        for got, want in zip(host[1:4], device[1:4]):
            assert torch.equal(got, want)
        assert len(host[4]) == len(device[4]) == 2  # the sort after dispatch and the one before combine
        for got, want in zip(host[4], device[4]):
            assert torch.equal(got, want)
        # Each token went to 2 experts and came back doubled from each; the combine sums them (the
        # probabilities are the experts' to apply): 4 x the token, in its own place.
        torch.testing.assert_close(host[2], 4 * tokens)
