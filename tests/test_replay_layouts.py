"""Forced random routes under every layout of the harness matrix.

The strongest replay check (DESIGN.md invariant 1): force random routes, run a layout,
and compare with a single-rank run of the same weights and the same forced routes. Every
token must use exactly its forced experts in every MoE layer, and per-token losses and
every gradient must match. Random routes are nothing like what the live router would
pick, so a layout that misplaces a row (SP slice, CP zigzag, THD padding, PP/VP layer
offset, EP dispatch) cannot pass by luck.
"""

import pytest
import torch

from tests.support.harness import Step, full_grads, full_token_losses, routes
from tests.support.launcher import run_workers
from tests.support.parallel import Layout
from tests.support.replay_layouts import random_forced_routes, run_replay_layout
from tests.test_layouts import (
    BSHD_DATA,
    BSHD_LAYOUTS,
    GRAD_RTOL,
    LOSS_ATOL,
    MODEL,
    THD_DATA,
    THD_LAYOUTS,
)

pytestmark = pytest.mark.slow

BSHD_FORCED = random_forced_routes(MODEL, BSHD_DATA.num_tokens, seed=11)
THD_FORCED = random_forced_routes(MODEL, THD_DATA.num_tokens, seed=12)


def _check_forced(results, data, forced):
    got = routes(results, data.num_tokens, MODEL.topk)
    assert sorted(got) == sorted(forced)
    for layer, experts in forced.items():
        assert torch.equal(got[layer], experts.sort(dim=-1).values), (
            f"layer {layer}: tokens did not use their forced experts"
        )


@pytest.fixture(scope="module")
def bshd_replay_reference():
    (result,) = run_workers(run_replay_layout, 1, Layout(), BSHD_DATA, Step(), BSHD_FORCED)
    return _reference(result, BSHD_DATA, BSHD_FORCED)


@pytest.fixture(scope="module")
def thd_replay_reference():
    (result,) = run_workers(
        run_replay_layout, 1, Layout(), THD_DATA, Step(micro_batch_size=1), THD_FORCED
    )
    return _reference(result, THD_DATA, THD_FORCED)


def _reference(result, data, forced):
    _check_forced([result], data, forced)
    grads = full_grads([result])
    routers = [name for name in grads if "router" in name]
    assert routers and all(grads[name].abs().max() > 0 for name in routers), (
        "replayed routers got no gradient"
    )
    return full_token_losses([result], data.num_tokens), grads


def _assert_matches(reference, results, data, forced):
    ref_losses, ref_grads = reference
    _check_forced(results, data, forced)
    losses = full_token_losses(results, data.num_tokens)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
    grads = full_grads(results)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item() / ref.abs().max().item()
        assert err <= GRAD_RTOL, f"{name}: relative gradient error {err:.3g}"


@pytest.mark.parametrize("layout", BSHD_LAYOUTS, ids=lambda layout: layout.name)
def test_bshd_layout_replays_forced_routes(layout, bshd_replay_reference):
    results = run_workers(
        run_replay_layout, layout.world_size, layout, BSHD_DATA, Step(), BSHD_FORCED
    )
    _assert_matches(bshd_replay_reference, results, BSHD_DATA, BSHD_FORCED)


@pytest.mark.parametrize("layout", THD_LAYOUTS, ids=lambda layout: layout.name)
def test_packed_layout_replays_forced_routes(layout, thd_replay_reference):
    results = run_workers(
        run_replay_layout,
        layout.world_size,
        layout,
        THD_DATA,
        Step(micro_batch_size=2),
        THD_FORCED,
    )
    _assert_matches(thd_replay_reference, results, THD_DATA, THD_FORCED)


def test_interleaved_forward_only_replays_forced_routes(bshd_replay_reference):
    layout = Layout(pp=2, vp=2)
    results = run_workers(
        run_replay_layout, 2, layout, BSHD_DATA, Step(forward_only=True), BSHD_FORCED
    )
    _check_forced(results, BSHD_DATA, BSHD_FORCED)
    losses = full_token_losses(results, BSHD_DATA.num_tokens)
    torch.testing.assert_close(losses, bshd_replay_reference[0], rtol=0, atol=LOSS_ATOL)
