"""megatron/rl/routing_replay.py of the Megatron-LM series against a real (tiny, CPU) GPTModel:
the engine's recording window, a bin's MoERouting in the forward, the metrics, the flags."""

import argparse
import math

import numpy as np
import pytest
import torch

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from tests.support.replay import NUM_EXPERTS, TOPK, VOCAB, init_single_rank, make_config, make_model

MOE_LAYERS = (2, 3, 4)  # make_config: dense first layer, three MoE layers


@pytest.fixture()
def models():
    init_single_rank()
    saved = list(RouterReplay.global_router_replay_instances)
    RouterReplay.global_router_replay_instances.clear()
    yield make_model(make_config(), seed=7), make_model(make_config(), seed=8)
    RouterReplay.global_router_replay_instances[:] = saved


class Wrapper(torch.nn.Module):
    """Stands for DDP / Float16Module."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_the_engine_records_with_the_generating_models_routers_only(rr, models):
    train, inference = models
    everyone = list(RouterReplay.global_router_replay_instances)
    assert len(everyone) == 6  # both models' routers: what the engine would size its buffers by
    with rr.engine_recording(Wrapper(inference)) as layers:
        assert layers == MOE_LAYERS
        assert RouterReplay.global_router_replay_instances == rr.decoder_routers(inference)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)  # as the engine does
    assert RouterReplay.global_router_replay_instances == everyone
    assert all(r.router_replay_action is None and r.recorded_topk_idx is None for r in everyone)


def bin_of(rr, routes, recorded, every_token_routed=True):
    """A BinReplay of one bin from token-aligned numpy routes [S, L, K] and a recorded mask."""
    valid = np.ones(len(routes), dtype=bool) if every_token_routed else recorded.copy()
    packed = rr.BinRoutes(ids=routes.astype(np.uint8), valid=valid, recorded=recorded,
                          every_token_routed=every_token_routed, live=int((~valid).sum()))
    return rr.BinReplay(packed, MOE_LAYERS, torch.device("cpu"))


def random_bin_routes(seq, seed):
    gen = np.random.default_rng(seed)
    return np.argsort(gen.random((seq, len(MOE_LAYERS), NUM_EXPERTS)), axis=-1)[..., :TOPK]


def forward(model, tokens, routing=None):
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    kwargs = {} if routing is None else {"extra_block_kwargs": {"moe_routing": routing}}
    with torch.no_grad():
        return model(tokens, positions, None, **kwargs)


@pytest.mark.parametrize("every_token_routed", [True, False])
def test_a_bins_routes_are_the_routes_the_forward_takes(rr, models, every_token_routed):
    model = models[0]
    seq = 12
    routes = random_bin_routes(seq, seed=3)
    recorded = np.arange(seq) < 9  # the last three: fillers, or live where not every token routes
    replay = bin_of(rr, routes, recorded, every_token_routed)
    routing = replay.moe_routing(Wrapper(model), None, None, measure=True)
    tokens = torch.randint(0, VOCAB, (1, seq))
    replayed_logits = forward(model, tokens, routing)
    taken = routing.recorded_expert_ids()  # [L, seq, K]
    given = torch.from_numpy(routes).long().permute(1, 0, 2)
    rows = slice(None) if every_token_routed else slice(0, 9)
    assert torch.equal(taken[:, rows], given[:, rows])
    sums = dict(zip(rr.ROUTING_FIELDS, replay.routing_sums(routing, Wrapper(model), None, None).tolist()))
    assert sums["used_differ"] == 0 and sums["routed"] == 9 * len(MOE_LAYERS)
    assert sums["routed_moved"] == 9 * len(MOE_LAYERS)  # positions 1..9 hold the routes of 0..8
    # The trainer's own router agrees with the random routes far from always: replay changed the forward.
    live = routing.live_expert_ids()
    assert sums["agree"] < sums["routed"]
    assert not torch.allclose(replayed_logits, forward(model, tokens))
    # Routes the forward took equal its own top-k where nothing was replayed (live rows).
    if not every_token_routed:
        assert torch.equal(taken[:, 9:], live[:, 9:])


def test_a_bins_routes_are_checked_against_the_chunks_layers(rr, models):
    model = models[0]
    routes = random_bin_routes(6, seed=4)
    packed = rr.BinRoutes(ids=routes.astype(np.uint8), valid=np.ones(6, bool), recorded=np.ones(6, bool),
                          every_token_routed=True, live=0)
    missing = rr.BinReplay(packed, (2, 3, 5), torch.device("cpu"))
    with pytest.raises(rr.RoutingReplayError, match=r"builds MoE layers \[4\] that the engine's routes do not hold"):
        missing.moe_routing(model, None, None)


def test_mismatch_sums_and_metrics(rr):
    train = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    engine = torch.tensor([[-1.0, -1.0, -0.5 - math.log(6.0), -9.0]])
    mask = torch.tensor([[True, True, True, False]])
    sums = rr.mismatch_sums(train, engine, mask)
    d = torch.tensor([0.0, 1.0, -math.log(6.0)], dtype=torch.float64)
    assert sums[0] == 3
    assert torch.isclose(sums[1], d.abs().sum())
    assert torch.isclose(sums[2], (d.exp() - 1 - d).sum())
    assert sums[3].item() == 1 + 1  # |1| > ln 2 and ln 6 > ln 2
    assert sums[4].item() == 1  # ln 6 > ln 5
    metrics = rr.ReplayMetrics(torch.device("cpu"))
    metrics.add("replay", sums)
    metrics.add("live", rr.mismatch_sums(train, train, mask))
    metrics.add("routing", torch.tensor([10.0, 8.0, 10.0, 1.0, 0.0], dtype=torch.float64))
    out = metrics.reduce()
    assert out["k3_replay"] == pytest.approx(float(sums[2]) / 3) and out["k3_live"] == 0
    assert out["outside_5x_replay"] == pytest.approx(1 / 3)
    assert out["agreement"] == 0.8 and out["agreement_moved_one_token"] == 0.1 and out["routes_used_differ"] == 0
    line = rr.format_metrics(7, out)
    assert line.startswith("routing replay | iteration 7 | ") and "k3_replay 0." in line


def rl_args(**overrides):
    values = dict(moe_enable_routing_replay=True, rl_routing_replay_metrics=False, rl_use_sequence_packing=True,
                  rl_training_cuda_graphs=False, cuda_graph_impl="local", rl_inference_pipeline_model_parallel_size=None,
                  pipeline_model_parallel_size=1, moe_expert_capacity_factor=None)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("overrides, flag", [
    ({"rl_use_sequence_packing": False}, "without --rl-use-sequence-packing"),
    ({"rl_training_cuda_graphs": True}, "--rl-training-cuda-graphs"),
    ({"cuda_graph_impl": "full_iteration"}, "--cuda-graph-impl full_iteration"),
    ({"pipeline_model_parallel_size": 2}, "an inference pipeline of 2 stages"),
    ({"pipeline_model_parallel_size": 2, "rl_inference_pipeline_model_parallel_size": 1}, None),
    ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor"),
    ({"moe_enable_routing_replay": False, "rl_routing_replay_metrics": True}, "add --moe-enable-routing-replay"),
])
def test_flags_replay_cannot_take_are_refused_by_name(rr, overrides, flag):
    if flag is None:
        rr.check_args(rl_args(**overrides))
        return
    with pytest.raises(rr.RoutingReplayError, match=flag.replace("-", r"\-")):
        rr.check_args(rl_args(**overrides))


@pytest.mark.gpu
def test_a_bins_routing_on_the_gpu_makes_no_host_sync(rr, models):
    """Building a bin's MoERouting runs in every microbatch's forward step: no host sync there.
    The engine's routes hold the layers in another order than the chunk builds them, so rows are
    selected by an index (a blocking host-to-device copy of it waited for the stream; fails before)."""
    model = models[0].cuda()
    routes = random_bin_routes(10, seed=5)  # columns for layers 4, 2, 3 below
    packed = rr.BinRoutes(ids=routes.astype(np.uint8), valid=np.ones(10, bool), recorded=np.ones(10, bool),
                          every_token_routed=True, live=0)
    replay = rr.BinReplay(packed, (4, 2, 3), torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routing = replay.moe_routing(Wrapper(model), None, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    given = torch.from_numpy(routes).long().permute(1, 0, 2).cuda()  # [layers 4, 2, 3; tokens; K]
    assert routing.layer_numbers == list(MOE_LAYERS)
    assert torch.equal(routing.expert_ids, given[[1, 2, 0]])
