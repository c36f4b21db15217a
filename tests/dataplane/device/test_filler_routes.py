"""Filler routes where no loss can see: the planner, and the same results as live routing there.

On every layout of the replay matrix, one training pass of the trainer's microbatch
pipeline over rollout-shaped samples (prompt, completion, no route for the final token,
padded THD rows) is run twice on the same weights: with filler routes at the positions
no loss can see, and with those positions routed live. The log-probs of every
loss-bearing position and every local gradient (aux loss on, so load balancing is
covered too) must be equal, and only the filler run is sync-free.
"""

import numpy as np
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_routing import host_counts_unsupported

from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange
from megatron_r3.dataplane.device.filler_routes import (
    fill_dead_positions,
    filler_expert_ids,
    first_dead_position,
    first_dead_positions,
    with_fillers,
)
from megatron_r3.dataplane.device.microbatch_pipeline import MicrobatchPipeline
from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl.model.passes import run_pass, token_logprobs
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt

MODEL = TinyMoE(num_experts=8)
MOE_LAYERS = (2, 4)
SEQ_LENGTH = 48
MICRO_BATCH = 2


def test_first_dead_position_is_after_the_last_loss_bearing_position():
    # Position t predicts token t + 1: trained tokens 3..5 make positions 2..4 loss-bearing.
    assert first_dead_position(np.array([0, 0, 0, 1, 1, 1, 0, 0], bool)) == 5
    assert first_dead_position(np.array([0, 1, 0, 1], bool)) == 3  # the final token is trained
    assert first_dead_position(np.zeros(4, bool)) == 0  # nothing trained: nothing is seen
    assert first_dead_position(np.array([1, 0, 0], bool)) == 0  # token 0 is predicted by no position


def test_first_dead_positions_of_many_segments_equal_one_at_a_time():
    gen = np.random.default_rng(5)
    for _ in range(200):
        lengths = gen.integers(0, 9, size=int(gen.integers(1, 7)))
        masks = [gen.random(n) < gen.choice([0.0, 0.2, 0.8, 1.0]) for n in lengths]
        got = first_dead_positions(np.concatenate(masks), lengths)
        assert got.tolist() == [first_dead_position(m) for m in masks], (lengths, masks)


def test_filler_ids_are_distinct_per_token_and_spread_over_the_experts():
    ids = filler_expert_ids(count=12, start=5, num_layers=3, topk=2, num_experts=8)
    assert ids.shape == (12, 3, 2) and ids.dtype == np.uint8
    assert all(len(set(row)) == 2 for row in ids[:, 0])
    assert (ids == ids[:, :1]).all()  # the same at every layer
    counts = np.bincount(ids[:, 0].ravel(), minlength=8)
    assert counts.max() - counts.min() <= 1  # consecutive positions cycle through the experts
    assert np.array_equal(filler_expert_ids(3, 5, 1, 2, 8), ids[:3, :1])  # deterministic in the start
    with pytest.raises(ValueError, match="distinct"):
        filler_expert_ids(1, 0, 1, topk=4, num_experts=3)


def _routes(n, without=()):
    gen = np.random.default_rng(n)
    ids = np.argsort(gen.random((n, len(MOE_LAYERS), 8)), axis=-1)[..., :2]
    valid = np.ones(n, bool)
    valid[list(without)] = False
    return RolloutRoutes.from_ids(ids, num_experts=8, layer_numbers=MOE_LAYERS, valid=valid)


def test_the_planner_refuses_a_filler_where_a_loss_can_see():
    routes = _routes(6, without=(2, 5))
    with pytest.raises(ValueError, match="position 2 reaches a loss"):
        fill_dead_positions(routes, [2, 5], dead_from=4)
    filled = fill_dead_positions(routes, [5], dead_from=4)
    assert filled.valid[5] and not filled.valid[2]
    with pytest.raises(ValueError, match="has a recorded route"):
        fill_dead_positions(routes, [4], dead_from=4)


def test_with_fillers_fills_only_dead_route_less_positions():
    loss = np.array([0, 0, 1, 1, 0, 0], bool)  # positions 1, 2 bear a loss; 3.. are dead
    routes, next_filler = with_fillers([_routes(6, without=(1, 4, 5)), _routes(4, without=(3,))],
                                       [loss, np.array([0, 1, 1, 1], bool)])
    assert routes[0].valid.tolist() == [True, False, True, True, True, True]  # position 1 stays live
    assert routes[1].valid.all() and next_filler == 3


def test_padding_rows_read_from_appended_source_rows():
    plan = RoutingPlan.build(RankLayout(cp_size=2, cp_rank=1), [3, 5], source_layer_numbers=MOE_LAYERS,
                             layer_numbers=MOE_LAYERS, qkv_format="thd")
    padded = plan.with_padding_rows()
    assert plan.num_padding_rows > 0 and padded.num_padding_rows == 0
    real = plan.token_index >= 0
    assert np.array_equal(padded.token_index[real], plan.token_index[real])
    assert sorted(padded.token_index[~real]) == list(range(8, 8 + plan.num_padding_rows))
    assert padded.num_source_tokens == 8 + plan.num_padding_rows


def rollout_samples(count, seed, gap=None):
    """Prompt then completion; routes for every token but the final one (and ``gap``: (sample, token))."""
    gen = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        prompt, completion = int(gen.integers(3, 8)), int(gen.integers(4, 12))
        n = prompt + completion
        tokens = gen.integers(0, MODEL.vocab_size, n)
        ids = np.argsort(gen.random((n, len(MOE_LAYERS), MODEL.num_experts)), axis=-1)[..., :MODEL.topk]
        valid = np.ones(n, bool)
        valid[-1] = False
        if gap is not None and gap[0] == i:
            valid[gap[1]] = False
        samples.append(RolloutSample(
            token_ids=tokens, loss_mask=np.arange(n) >= prompt, logprobs=-gen.random(n).astype(np.float32),
            routes=RolloutRoutes.from_ids(ids, num_experts=MODEL.num_experts, layer_numbers=MOE_LAYERS,
                                          valid=valid)))
    return samples


def filler_worker(layout, samples):
    device = init_parallel(layout)
    try:
        config, chunks = build_gpt(layout, MODEL, seed=0, device=device, flags=["--moe-enable-routing-replay"],
                                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1)
        rows = RowLayout(RankLayout.of_this_rank(config.sequence_parallel), config,
                         SEQ_LENGTH, MICRO_BATCH, device)
        spec = RoutingSpec(MODEL.num_layers, MOE_LAYERS, MODEL.num_experts, MODEL.topk)
        exchange = None
        if host_counts_unsupported(config) is None:  # the allgather dispatcher takes no host counts
            exchange = ExpertCountExchange(parallel_state.get_expert_tensor_and_model_parallel_group(),
                                           MODEL.num_experts)
        pipeline = MicrobatchPipeline(rows, spec, exchange)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        mine = samples[dp_rank * len(samples) // dp:(dp_rank + 1) * len(samples) // dp]

        def loss_fn(index, batch, logits):
            logprobs = token_logprobs(logits, batch.labels)
            mask = batch.loss_mask
            return (-logprobs * mask).sum(), mask.sum().to(torch.int), {
                "logprobs": logprobs[mask.bool()].detach().cpu()}

        out = {}
        for fillers in (True, False):
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            result = run_pass(chunks, pipeline.prepare(mine, rollout_routes=True, fillers=fillers), loss_fn,
                              forward_only=False)
            out[fillers] = {
                "logprobs": [o["logprobs"] for o in result.outputs],
                "grads": {f"{c}.{n}": p.grad.cpu().clone() for c, chunk in enumerate(chunks)
                          for n, p in chunk.named_parameters() if p.grad is not None},
                "host_split": result.host_split_microbatches,
                "microbatches": len(result.items),
            }
        return out
    finally:
        parallel_state.destroy_model_parallel()


FILLER_LAYOUTS = [
    Layout(),
    Layout(tp=2, sp=True),
    Layout(cp=2, packed=True),
    Layout(ep=2, dp=2, dispatcher="alltoall"),
    Layout(ep=2, dp=2, dispatcher="allgather"),
    Layout(pp=2, first_stage_layers=1, recompute="full"),
    Layout(pp=2, vp=2),
    Layout(tp=2, sp=True, ep=2, etp=2, dp=2),
    Layout(tp=2, sp=True, pp=2),
]
# Expert GEMMs group tokens per expert, and fillers change which tokens share a group with a
# loss-bearing one: a matmul's result for one row can differ by an ulp with the group's size,
# and a sum over tokens by a few ulps of its largest term. 8 fp32 ulps of the tensor's largest
# value bound that; a filler that reached a loss changes results by orders of magnitude more
# (the negative control below).
RTOL_OF_MAX = 1e-6


def assert_equal_to_rounding(got, want, name=""):
    atol = RTOL_OF_MAX * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("layout", FILLER_LAYOUTS, ids=lambda layout: layout.name)
def test_fillers_change_nothing_a_loss_sees_under_layouts(layout):
    samples = rollout_samples(8, seed=3)
    for result in run_workers(filler_worker, layout.world_size, layout, samples, backend="gloo"):
        filled, live = result[True], result[False]
        for a, b in zip(filled["logprobs"], live["logprobs"]):
            assert_equal_to_rounding(a, b)
        assert filled["grads"].keys() == live["grads"].keys() and filled["grads"]
        for name, grad in filled["grads"].items():
            assert_equal_to_rounding(grad, live["grads"][name], name)
        if layout.dispatcher == "alltoall":
            assert filled["host_split"] == filled["microbatches"] and live["host_split"] == 0


def test_a_capture_gap_keeps_its_microbatch_live_and_a_filler_there_changes_the_loss():
    """The negative control: a loss-bearing position without a route stays live (its
    microbatch takes Megatron's path), and forcing a filler there changes the result."""
    layout = Layout()
    gap = (1, 4)  # sample 1, a prompt token whose output reaches the completion's losses
    samples = rollout_samples(4, seed=5, gap=gap)
    (result,) = run_workers(filler_worker, 1, layout, samples, backend="gloo")
    assert result[True]["host_split"] == 1  # the first microbatch (samples 0, 1) routes token 4 live
    forced = [RolloutSample(s.token_ids, s.loss_mask, s.logprobs, s.routes) for s in samples]
    dead_from = first_dead_position(forced[1].loss_mask)
    with pytest.raises(ValueError, match="reaches a loss"):
        fill_dead_positions(forced[1].routes, [gap[1]], dead_from)
    routes = forced[1].routes
    ids, valid = routes.ids.copy(), routes.valid.copy()
    ids[gap[1]] = filler_expert_ids(1, 0, len(MOE_LAYERS), MODEL.topk, MODEL.num_experts)
    valid[gap[1]] = True
    forced[1] = RolloutSample(forced[1].token_ids, forced[1].loss_mask, forced[1].logprobs,
                              RolloutRoutes(ids, valid, routes.num_experts, routes.layer_numbers))
    (bypassed,) = run_workers(filler_worker, 1, layout, forced, backend="gloo")
    assert bypassed[True]["host_split"] == 2
    change = (bypassed[True]["logprobs"][0] - result[True]["logprobs"][0]).abs().max()
    assert change > 1e3 * RTOL_OF_MAX
