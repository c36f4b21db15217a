"""Routing replay under every layout of the harness matrix.

The strongest replay check (DESIGN.md invariant 1): force random routes, run a layout,
and compare with a single-rank run of the same weights and the same forced routes. Every
token must use exactly its forced experts in every MoE layer, tokens without a route
(every 7th token, and THD/CP padding) go to the live router and agree with the
reference, and per-token losses and every gradient must match. Random routes are nothing
like what the live router would pick, so a layout that misplaces a row (SP slice, CP
zigzag, THD padding, PP/VP layer offset, EP dispatch) cannot pass by luck. What each
MoERouting recorded (R2) must be the routes taken.
"""

import pytest
import torch

from tests.support.harness import (
    Step,
    assert_losses_and_grads_match,
    full_grads,
    full_token_losses,
    router_margins,
)
from tests.support.launcher import run_workers
from tests.support.parallel import Layout
from tests.support.replay_layouts import random_forced_routes, run_replay_layout, taken_and_recorded
from tests.support.routes import full_routes
from tests.test_layouts import (
    BSHD_DATA,
    BSHD_LAYOUTS,
    GRAD_RTOL,
    LOSS_ATOL,
    MIN_MARGIN,
    MODEL,
    THD_DATA,
    THD_LAYOUTS,
)

pytestmark = pytest.mark.slow

NO_ROUTE_EVERY = 7
BSHD_FORCED = random_forced_routes(MODEL, BSHD_DATA.num_tokens, 11, NO_ROUTE_EVERY)
THD_FORCED = random_forced_routes(MODEL, THD_DATA.num_tokens, 12, NO_ROUTE_EVERY)


def _taken_and_recorded(results, data):
    return taken_and_recorded(results, data.num_tokens, MODEL.topk)


def replay_reference(result, data, forced):
    """A single-rank replay run checked (forced routes taken, live decisions far from a tie, routers with
    gradients): its per-token losses, gradients and routes taken."""
    taken = _taken_and_recorded([result], data)
    assert sorted(taken) == sorted(forced)
    for layer, experts in forced.items():
        routed = (experts >= 0).all(dim=-1)
        assert torch.equal(taken[layer][routed], experts[routed].sort(dim=-1).values), (
            f"layer {layer}: tokens did not use their forced experts"
        )
        assert (taken[layer][~routed] >= 0).all(), f"layer {layer}: a -1 row was not routed"
    # Tokens without a route are decided live: keep those decisions far from a tie.
    for layer, margin in router_margins([result]).items():
        assert margin >= MIN_MARGIN, f"layer {layer}: a live decision is {margin:.2g} from a tie"
    grads = full_grads([result])
    routers = [name for name in grads if "router" in name]
    assert routers and all(grads[name].abs().max() > 0 for name in routers), (
        "replayed routers got no gradient"
    )
    return full_token_losses([result], data.num_tokens), grads, taken


def assert_replay_matches(reference, results, data):
    """A layout took the reference's routes, with its losses and gradients."""
    ref_losses, ref_grads, ref_routes = reference
    taken = _taken_and_recorded(results, data)
    assert taken.keys() == ref_routes.keys()
    for layer, experts in ref_routes.items():
        assert torch.equal(taken[layer], experts), f"layer {layer}: routes differ from reference"
    assert_losses_and_grads_match(
        results, ref_losses, ref_grads, data.num_tokens, LOSS_ATOL, GRAD_RTOL
    )


@pytest.fixture(scope="module")
def bshd_replay_reference():
    (result,) = run_workers(run_replay_layout, 1, Layout(), BSHD_DATA, Step(), BSHD_FORCED)
    return replay_reference(result, BSHD_DATA, BSHD_FORCED)


@pytest.fixture(scope="module")
def thd_replay_reference():
    (result,) = run_workers(
        run_replay_layout, 1, Layout(), THD_DATA, Step(micro_batch_size=1), THD_FORCED
    )
    return replay_reference(result, THD_DATA, THD_FORCED)


@pytest.mark.parametrize("layout", BSHD_LAYOUTS, ids=lambda layout: layout.name)
def test_bshd_layout_replays_forced_routes(layout, bshd_replay_reference):
    results = run_workers(
        run_replay_layout, layout.world_size, layout, BSHD_DATA, Step(), BSHD_FORCED
    )
    assert_replay_matches(bshd_replay_reference, results, BSHD_DATA)


@pytest.mark.parametrize("layout", THD_LAYOUTS, ids=lambda layout: layout.name)
def test_packed_layout_replays_forced_routes(layout, thd_replay_reference):
    results = run_workers(
        run_replay_layout, layout.world_size, layout, THD_DATA, Step(micro_batch_size=2), THD_FORCED
    )
    assert_replay_matches(thd_replay_reference, results, THD_DATA)


def test_interleaved_forward_only_replays_forced_routes(bshd_replay_reference):
    layout = Layout(pp=2, vp=2)
    results = run_workers(
        run_replay_layout, 2, layout, BSHD_DATA, Step(forward_only=True), BSHD_FORCED
    )
    assert all("grads" not in r for r in results)
    taken = _taken_and_recorded(results, BSHD_DATA)
    for layer, experts in bshd_replay_reference[2].items():
        assert torch.equal(taken[layer], experts)
    losses = full_token_losses(results, BSHD_DATA.num_tokens)
    torch.testing.assert_close(losses, bshd_replay_reference[0], rtol=0, atol=LOSS_ATOL)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_every_token_to_one_rank(dispatcher):
    """A skewed replay (all tokens to EP rank 1's experts): counts and split sizes follow
    the replayed routing map; the result matches the single-rank run."""
    skewed = {
        layer: torch.tensor([2, 3]).expand(BSHD_DATA.num_tokens, 2).clone()
        for layer in MODEL.moe_layers
    }
    (reference,) = run_workers(run_replay_layout, 1, Layout(), BSHD_DATA, Step(), skewed)
    layout = Layout(ep=2, dp=2, dispatcher=dispatcher)
    results = run_workers(run_replay_layout, 2, layout, BSHD_DATA, Step(), skewed)
    ref = (
        full_token_losses([reference], BSHD_DATA.num_tokens),
        full_grads([reference]),
        _taken_and_recorded([reference], BSHD_DATA),
    )
    for layer in MODEL.moe_layers:
        assert (ref[2][layer] == torch.tensor([2, 3])).all()
    assert_replay_matches(ref, results, BSHD_DATA)


RECORD_THEN_REPLAY = [
    (Layout(), BSHD_DATA, 2),  # no pipelining
    (Layout(pp=2, vp=2), BSHD_DATA, 2),
    (Layout(tp=2, sp=True, ep=2, etp=1, dp=2), BSHD_DATA, 2),
    (Layout(cp=2, packed=True), THD_DATA, 2),
]


@pytest.mark.parametrize(
    "layout,data,micro_batch_size",
    RECORD_THEN_REPLAY,
    ids=[layout.name for layout, _, _ in RECORD_THEN_REPLAY],
)
def test_forward_only_recording_is_replayed_by_the_training_step(layout, data, micro_batch_size):
    """R2 under a layout: record live routes in a forward-only pass (old log-probs), then a
    training step replaying them routes every token the same way and gets the same losses."""
    record = run_workers(
        run_replay_layout, layout.world_size, layout, data,
        Step(forward_only=True, micro_batch_size=micro_batch_size), None,
    )
    recorded = full_routes([r["recorded"] for r in record], data.num_tokens, MODEL.topk)
    assert all((experts >= 0).all() for experts in recorded.values())
    train = run_workers(
        run_replay_layout, layout.world_size, layout, data,
        Step(micro_batch_size=micro_batch_size), recorded,
    )
    taken = _taken_and_recorded(train, data)
    for layer, experts in recorded.items():
        assert torch.equal(taken[layer], experts), f"layer {layer}: the step did not replay"
    torch.testing.assert_close(
        full_token_losses(train, data.num_tokens),
        full_token_losses(record, data.num_tokens),
        rtol=0,
        atol=LOSS_ATOL,
    )


VARIANTS = {
    "sigmoid_expert_bias": Step(
        flags=("--moe-router-score-function", "sigmoid"),
        config_fields=(("moe_router_enable_expert_bias", True),),
    ),
    "group_limited_pre_softmax_scaled": Step(config_fields=(
        ("moe_router_pre_softmax", True),
        ("moe_router_num_groups", 2),
        ("moe_router_group_topk", 1),
        ("moe_router_topk_scaling_factor", 2.0),
    )),
    "aux_and_seq_aux_loss": Step(config_fields=(
        ("moe_router_load_balancing_type", ["aux_loss", "seq_aux_loss"]),
        ("moe_aux_loss_coeff", [0.1, 0.1]),
    )),
}
VARIANT_LAYOUTS = [
    Layout(ep=2, dp=2, dispatcher="alltoall", recompute="selective"),
    Layout(tp=2, sp=True, ep=2, etp=1, dp=2, recompute="full"),
    Layout(pp=2, vp=2),
    Layout(cp=2),
]


# Megatron scales the aux losses by the local token count under calculate_per_token_loss,
# so with the sequence split over TP/SP or CP their gradients differ from a single rank's
# even without replay (the harness sums raw gradients; checked with live routing). The aux
# loss variant runs on layouts that keep whole sequences.
WHOLE_SEQUENCE_LAYOUTS = [VARIANT_LAYOUTS[0], VARIANT_LAYOUTS[2]]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_router_variants_replay_under_layouts(variant):
    """Score functions and aux losses: forced routes, same losses and grads as one rank
    (the aux losses see the replayed routes on every rank)."""
    forced = random_forced_routes(MODEL, BSHD_DATA.num_tokens, 13)
    step = VARIANTS[variant]
    (result,) = run_workers(run_replay_layout, 1, Layout(), BSHD_DATA, step, forced)
    reference = (
        full_token_losses([result], BSHD_DATA.num_tokens),
        full_grads([result]),
        _taken_and_recorded([result], BSHD_DATA),
    )
    for layer, experts in forced.items():
        assert torch.equal(reference[2][layer], experts.sort(dim=-1).values)
    layouts = WHOLE_SEQUENCE_LAYOUTS if "aux" in variant else VARIANT_LAYOUTS
    for layout in layouts:
        results = run_workers(
            run_replay_layout, layout.world_size, layout, BSHD_DATA, step, forced
        )
        try:
            assert_replay_matches(reference, results, BSHD_DATA)
        except AssertionError as error:
            raise AssertionError(f"{layout.name}: {error}") from None
