"""Host-known split sizes under replay: counts from host routes, one exchange per microbatch,
and a dispatcher that uses them with bit-identical results and no device-side counting."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange, local_expert_counts
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.routes import RolloutRoutes, concat_routes
from tests.support.batches import make_sequences
from tests.support.harness import Step, full_grads, full_token_losses
from tests.support.launcher import run_workers
from tests.support.parallel import Layout
from tests.support.pipeline import pipeline_config
from tests.support.replay_layouts import random_forced_routes, run_replay_layout
from tests.support.tiny_moe import TinyMoE

EXPERTS, TOPK, LAYERS = 8, 2, (2, 4, 5)


def random_samples(lengths, seed, without_route=()):
    gen = np.random.default_rng(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = np.argsort(gen.random((n, len(LAYERS), EXPERTS)), axis=-1)[..., :TOPK]
        valid = np.ones(n, bool)
        for sample, token in without_route:
            if sample == i:
                valid[token] = False
        samples.append(RolloutRoutes.from_ids(ids, num_experts=EXPERTS, layer_numbers=LAYERS, valid=valid))
    return samples


def direct_counts(samples, plan):
    """Counting token by token, the way the router's routing map would."""
    rows = [token for sample in samples for token in sample.to_int64()]
    counts = np.zeros((plan.num_local_layers, EXPERTS), np.int64)
    for token in plan.token_index:
        for i, layer in enumerate(plan.layer_index):
            for expert in rows[token][layer]:
                counts[i, expert] += 1
    return counts


@pytest.mark.parametrize(
    "rank",
    [RankLayout(), RankLayout(tp_size=2, tp_rank=1, sequence_parallel=True), RankLayout(cp_size=2, cp_rank=1),
     RankLayout(pp_rank=1)],
    ids=["single", "sp-rank1", "cp-rank1", "pp-rank1"],
)
def test_local_counts_equal_a_direct_count(rank):
    lengths = [8, 12, 4]
    samples = random_samples(lengths, seed=3)
    config = pipeline_config(6, pp=2)
    plan = RoutingPlan.build(rank, lengths, source_layer_numbers=LAYERS, config=config, qkv_format="thd")
    ids, valid = concat_routes(samples)
    counts = local_expert_counts(ids, valid, plan, EXPERTS)
    assert np.array_equal(counts, direct_counts(samples, plan))
    assert (counts.sum(axis=1) == plan.num_local_tokens * TOPK).all()


def test_no_counts_when_a_token_has_no_route_or_is_padding():
    lengths = [8, 12]
    plan = RoutingPlan.build(RankLayout(), lengths, source_layer_numbers=LAYERS, layer_numbers=LAYERS,
                             qkv_format="thd")
    ids, valid = concat_routes(random_samples(lengths, seed=4, without_route=[(1, 11)]))
    assert local_expert_counts(ids, valid, plan, EXPERTS) is None
    ids, valid = concat_routes(random_samples(lengths, seed=4))
    padded = RoutingPlan.build(RankLayout(cp_size=2), [7, 12], source_layer_numbers=LAYERS,
                               layer_numbers=LAYERS, qkv_format="thd")
    assert local_expert_counts(ids[:19], valid[:19], padded, EXPERTS) is None  # 7 pads to 8


def exchange_worker(missing_on_rank):
    group = dist.new_group([0, 1])
    exchange = ExpertCountExchange(group, num_experts=3)
    rank = dist.get_rank()
    chunk0 = np.arange(6).reshape(2, 3) + 10 * rank
    chunk1 = np.arange(3).reshape(1, 3) + 100 * rank
    local = [chunk0, None if rank == missing_on_rank else chunk1]
    return exchange.gather(local, [2, 1])


def test_exchange_gathers_every_ranks_counts_in_group_order():
    results = run_workers(exchange_worker, 2, -1, backend="gloo")
    for chunks in results:
        assert torch.equal(chunks[0][1], torch.arange(6).reshape(2, 3) + 10)
        assert torch.equal(chunks[0][0], torch.arange(6).reshape(2, 3))
        assert torch.equal(chunks[1][:, 0], torch.stack([torch.arange(3), torch.arange(3) + 100]))
        assert chunks[0].dtype == torch.int64 and chunks[0].shape == (2, 2, 3)


def test_exchange_gives_no_counts_to_anyone_when_one_rank_lacks_them():
    for chunks in run_workers(exchange_worker, 2, 1, backend="gloo"):
        assert chunks == [None, None]


MODEL = TinyMoE(num_experts=8, router_logit_std=2.0)
DATA = make_sequences([16] * 8, MODEL.vocab_size, seed=1)
FORCED = random_forced_routes(MODEL, DATA.num_tokens, seed=21)


def counting_worker(layout, step, host_counts):
    """The replay run, counting calls of the dispatcher's device-side counting (preprocess)."""
    calls = []
    device_path = MoEAlltoAllTokenDispatcher.preprocess

    def counted(self, routing_map):
        calls.append(routing_map.shape)
        return device_path(self, routing_map)

    MoEAlltoAllTokenDispatcher.preprocess = counted
    try:
        out = run_replay_layout(layout, DATA, step, FORCED, host_counts=host_counts)
    finally:
        MoEAlltoAllTokenDispatcher.preprocess = device_path
    out["device_counting_calls"] = len(calls)
    return out


HOST_COUNT_LAYOUTS = [
    Layout(),  # 8 local experts: the sort by local expert too
    Layout(ep=2, dp=2, recompute="full"),
    Layout(tp=2, sp=True, ep=2, etp=1, dp=2),
    Layout(tp=2, sp=True, ep=2, etp=2, dp=2),  # expert-TP splits on the host too
    Layout(pp=2, vp=2),
]


@pytest.mark.parametrize("layout", HOST_COUNT_LAYOUTS, ids=lambda layout: layout.name)
def test_host_counts_give_bit_identical_losses_and_grads(layout):
    step = Step(model=MODEL)
    # NCCL with a GPU per rank where there are enough GPUs, gloo otherwise.
    device = run_workers(counting_worker, layout.world_size, layout, step, False)
    host = run_workers(counting_worker, layout.world_size, layout, step, True)
    assert sum(r["device_counting_calls"] for r in device) > 0
    assert all(r["device_counting_calls"] == 0 for r in host)
    assert torch.equal(full_token_losses(host, DATA.num_tokens, atol=0), full_token_losses(device, DATA.num_tokens))
    host_grads, device_grads = full_grads(host), full_grads(device)
    assert host_grads.keys() == device_grads.keys()
    for name, grad in device_grads.items():
        assert torch.equal(host_grads[name], grad), name
