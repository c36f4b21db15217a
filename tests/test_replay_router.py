"""TopKRouter replay: every score function replays exactly, probabilities are the trainer's
scores at the replayed ids (with gradients), -1 rows route live, aux losses and the
expert-bias counters see the routes actually taken."""

import pytest
import torch

from megatron.core.transformer.moe.moe_routing import MoERouting
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_default_pg_collection,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter

from tests.support.replay import NUM_EXPERTS, TOPK, init_single_rank, make_config, random_routes

SEQ, BATCH, HIDDEN = 6, 3, 32
LAYER = 2


# In-process CPU models: Megatron must not pick up a visible GPU (gpu-marked tests excepted).
pytestmark = pytest.mark.usefixtures("megatron_on_cpu")


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_rank()


VARIANTS = {
    "softmax_post_topk": dict(),
    "softmax_pre_topk": dict(moe_router_pre_softmax=True),
    "softmax_scaled": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
    "sigmoid": dict(moe_router_score_function="sigmoid"),
    "sigmoid_expert_bias": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    ),
    "group_limited": dict(
        moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2
    ),
    "sigmoid_group_limited_scaled": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=1.5,
    ),
}


def make_router(**overrides):
    config = make_config(**overrides)
    torch.manual_seed(3)
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    router.set_layer_number(LAYER)
    if router.expert_bias is not None:
        # A bias that pulls the live top-k away from the replayed experts.
        router.expert_bias.copy_(torch.linspace(-1.0, 1.0, NUM_EXPERTS))
    return router


def expected_probs(config, logits, ids):
    """The replayed probabilities, written from the definition of each score function."""
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            probs = torch.softmax(logits, dim=-1).gather(1, ids)
        else:
            probs = torch.softmax(logits.gather(1, ids), dim=-1)
    else:
        scores = torch.sigmoid(logits).gather(1, ids)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    return torch.zeros_like(logits).scatter(1, ids, probs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_score_function_replays_exactly_with_router_grads(variant):
    router = make_router(**VARIANTS[variant])
    hidden = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    ids = random_routes(1, SEQ * BATCH, seed=11)
    routing = MoERouting(layer_numbers=[LAYER], expert_ids=ids)

    probs, routing_map = router(hidden, moe_routing=routing)

    want_map = torch.zeros(SEQ * BATCH, NUM_EXPERTS, dtype=torch.bool).scatter(1, ids[0], True)
    assert torch.equal(routing_map, want_map)
    logits = torch.nn.functional.linear(hidden.detach().view(-1, HIDDEN), router.weight.detach())
    torch.testing.assert_close(probs, expected_probs(router.config, logits, ids[0]))
    assert torch.equal(routing.recorded_expert_ids(), ids)

    (probs * torch.randn_like(probs)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rows_without_route_use_the_live_router(variant):
    router = make_router(**VARIANTS[variant])
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    live_probs, live_map = router(hidden)

    ids = random_routes(1, SEQ * BATCH, seed=5)
    no_route = torch.zeros(SEQ * BATCH, dtype=torch.bool)
    no_route[::3] = True
    ids[0, no_route] = -1
    probs, routing_map = router(hidden, moe_routing=MoERouting([LAYER], expert_ids=ids))

    assert torch.equal(routing_map[no_route], live_map[no_route])
    torch.testing.assert_close(probs[no_route], live_probs[no_route])
    replayed = ~no_route
    want_map = torch.zeros(SEQ * BATCH, NUM_EXPERTS, dtype=torch.bool)
    want_map = want_map.scatter(1, ids[0].clamp(min=0), True)
    assert torch.equal(routing_map[replayed], want_map[replayed])
    # -1 is not replayed as an expert id: the live rows do not all land on expert 0.
    assert not routing_map[no_route][:, 0].all()


@pytest.mark.parametrize("variant", ["softmax_post_topk", "sigmoid_expert_bias", "group_limited"])
def test_live_expert_ids_are_the_routers_own_choice_under_replay(variant):
    router = make_router(**VARIANTS[variant])
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    live = MoERouting([LAYER])
    router(hidden, moe_routing=live)
    ids = random_routes(1, SEQ * BATCH, seed=7)
    ids[0, ::4] = -1
    replayed = MoERouting([LAYER], expert_ids=ids)
    router(hidden, moe_routing=replayed)

    # Without replay the live choice is the route taken; with it, the same live choice is
    # kept beside the replayed routes (the rows without a route took the live choice).
    assert torch.equal(live.live_expert_ids(), live.recorded_expert_ids())
    assert torch.equal(replayed.live_expert_ids(), live.recorded_expert_ids())
    taken = torch.where(ids < 0, live.recorded_expert_ids(), ids)
    assert torch.equal(replayed.recorded_expert_ids(), taken)
    assert not torch.equal(replayed.live_expert_ids(), replayed.recorded_expert_ids())


def test_expert_bias_counts_the_replayed_routes():
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    ids = random_routes(1, SEQ * BATCH, seed=2)
    router.local_tokens_per_expert.zero_()
    router(hidden, moe_routing=MoERouting([LAYER], expert_ids=ids))
    want = torch.bincount(ids[0].flatten(), minlength=NUM_EXPERTS).float()
    assert torch.equal(router.local_tokens_per_expert, want)


@pytest.mark.parametrize("aux_type", ["aux_loss", "seq_aux_loss"])
def test_aux_loss_balances_the_replayed_routes(aux_type):
    coeff = 0.01
    router = make_router(moe_router_load_balancing_type=aux_type, moe_aux_loss_coeff=coeff)
    router.train()
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    # Every token to experts 6 and 7: a maximally unbalanced replay.
    ids = torch.tensor([6, 7]).expand(1, SEQ * BATCH, TOPK).contiguous()
    clear_aux_losses_tracker()
    router(hidden, moe_routing=MoERouting([LAYER], expert_ids=ids))

    name = "load_balancing_loss" if aux_type == "aux_loss" else "seq_load_balancing_loss"
    got = get_moe_layer_wise_logging_tracker()[name]["values"][LAYER - 1]
    logits = torch.nn.functional.linear(hidden.view(-1, HIDDEN), router.weight.detach())
    scores = torch.softmax(logits, dim=-1)
    if aux_type == "aux_loss":
        counts = torch.bincount(ids[0].flatten(), minlength=NUM_EXPERTS).float()
        want = NUM_EXPERTS * (counts / (SEQ * BATCH * TOPK) * scores.mean(0)).sum()
    else:
        # Per sample b: the tokens s * BATCH + b.
        per_sample = []
        for b in range(BATCH):
            s_scores = scores.view(SEQ, BATCH, -1)[:, b]
            sample_ids = ids[0].view(SEQ, BATCH, TOPK)[:, b].flatten()
            counts = torch.bincount(sample_ids, minlength=NUM_EXPERTS)
            per_sample.append(NUM_EXPERTS * (counts / (SEQ * TOPK) * s_scores.mean(0)).sum())
        want = torch.stack(per_sample).mean()
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_replay_needs_the_config_flag():
    router = make_router(moe_enable_routing_replay=False)
    ids = random_routes(1, SEQ * BATCH)
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        router(torch.randn(SEQ, BATCH, HIDDEN), moe_routing=MoERouting([LAYER], expert_ids=ids))


def test_recording_only_keeps_the_upstream_aux_loss_in_forward_and_recompute():
    """Without replayed ids the aux loss is upstream's, also when a recompute replays the
    recording (so recompute and no recompute give the same gradients)."""
    coeff = 0.01
    router = make_router(
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=coeff,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    router.train()
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    clear_aux_losses_tracker()
    router(hidden)
    upstream = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][LAYER - 1]
    upstream = upstream.clone()
    routing = MoERouting([LAYER])
    for _ in range(2):  # first pass records, second replays the recording
        clear_aux_losses_tracker()
        router(hidden, moe_routing=routing)
        got = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][LAYER - 1]
        torch.testing.assert_close(got, upstream, rtol=0, atol=0)


@pytest.mark.gpu
def test_router_replay_forward_and_backward_do_not_sync_the_device():
    """The replay path (live top-k, replayed ids, gathered probs, -1 rows) is device-only."""
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    ids = random_routes(1, SEQ * BATCH, seed=4).cuda()
    ids[0, ::3] = -1

    def step():
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True)
        probs, _ = router(hidden, moe_routing=MoERouting([LAYER], expert_ids=ids))
        probs.sum().backward()

    step()  # first call moves the gate to the GPU
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
