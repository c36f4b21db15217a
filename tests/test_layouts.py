"""Every parallel layout of the tiny MoE GPT matches a single-rank run of the same weights.

For each layout, the per-token losses (the negative log-probabilities of the
labels) and the gradient of every parameter, assembled from all ranks into
full single-rank tensors, must equal a single-rank run's within fp32 tolerance.
No routing replay here: these tests prove the harness the replay tests use.

Routing with a live router is discontinuous: a token whose k-th and (k+1)-th
router logits are nearly tied can pick a different expert when a layout changes
the summation order by one ulp, and then its loss legitimately differs. Rather
than loosen the tolerance, the setup keeps every decision far from a tie: the
router weights are scaled so logits spread over about N(0, 2^2)
(``TinyMoE.router_logit_std``), and the reference run measures the top-k margin
of every routing decision it makes and asserts it is at least ``MIN_MARGIN``,
three orders of magnitude above the ~1e-6 differences between layouts. With a
margin that large no layout can flip a choice, so any mismatch is a real bug;
each layout's routing, mapped back to global token ids, must also equal the
reference's exactly (which checks the router-row-to-token mapping too).
"""

import pytest
import torch

from tests.support.batches import make_sequences
from tests.support.harness import (
    Step,
    assert_losses_and_grads_match,
    full_grads,
    full_token_losses,
    router_margins,
    routes,
    run_layout,
)
from tests.support.launcher import run_workers
from tests.support.parallel import Layout
from tests.support.tiny_moe import TinyMoE

pytestmark = pytest.mark.slow

MODEL = TinyMoE()
# 8 sequences of 16 tokens: 2 microbatches of 2 per DP rank at DP=2, 4 at DP=1.
BSHD_DATA = make_sequences([16] * 8, MODEL.vocab_size, seed=1)
# Odd lengths: every sequence needs padding for CP=2 (multiples of 4).
THD_DATA = make_sequences([5, 9, 7, 11, 3, 13, 15, 1], MODEL.vocab_size, seed=2)
MIN_MARGIN = 1e-3
# Max |difference| relative to the largest reference value of the tensor.
GRAD_RTOL = 2e-5
LOSS_ATOL = 2e-5

BSHD_LAYOUTS = [
    Layout(tp=2, sp=True),
    Layout(ep=2, dp=2, dispatcher="alltoall"),
    Layout(ep=2, dp=2, dispatcher="allgather"),
    Layout(pp=2),
    Layout(pp=2, first_stage_layers=1, recompute="full"),
    Layout(pp=2, last_stage_layers=1),
    Layout(pp=2, vp=2),
    Layout(cp=2),
    Layout(tp=2, sp=True, ep=2, etp=1, dp=2),
    # Expert-TP 2 (Megatron's default under TP 2): experts split over the expert-TP
    # group, whose ranks all-gather uneven token counts (padded on gloo).
    Layout(tp=2, sp=True, ep=2, etp=2, dp=2),
    Layout(pp=2, cp=2),
    Layout(pp=2, ep=2, dp=2),
]
THD_LAYOUTS = [
    Layout(packed=True),
    Layout(cp=2, packed=True),
    Layout(tp=2, sp=True, packed=True, recompute="selective"),
    # Sequences padded to a multiple of 2 * cp * tp.
    Layout(tp=2, sp=True, cp=2, packed=True),
]


# Linear biases: sharded with column-parallel weights, replicated (and reduced
# across TP under SP) with row-parallel ones, per expert in MoE layers. Megatron
# only supports MoE biases with expert-TP 1 (TransformerConfig asserts it).
BIAS_STEP = Step(model=TinyMoE(add_bias_linear=True))
BIAS_LAYOUTS = [
    Layout(ep=2, dp=2),
    Layout(tp=2, sp=True, ep=2, etp=1, dp=2),
]


@pytest.fixture(scope="module")
def bshd_reference():
    (result,) = run_workers(run_layout, 1, Layout(), BSHD_DATA, Step())
    return _checked_reference(result, BSHD_DATA)


@pytest.fixture(scope="module")
def bias_reference():
    (result,) = run_workers(run_layout, 1, Layout(), BSHD_DATA, BIAS_STEP)
    return _checked_reference(result, BSHD_DATA)


@pytest.fixture(scope="module")
def thd_reference():
    # Each sequence on its own, unpadded: independent of packing and of the
    # THD code path of the attention module.
    (result,) = run_workers(run_layout, 1, Layout(), THD_DATA, Step(micro_batch_size=1))
    return _checked_reference(result, THD_DATA)


def _checked_reference(result, data):
    margins = router_margins([result])
    assert sorted(margins) == MODEL.moe_layers
    for layer, margin in margins.items():
        assert margin >= MIN_MARGIN, f"layer {layer}: a routing decision is {margin:.2g} from a tie"
    grads = full_grads([result])
    for name, grad in grads.items():
        assert grad.abs().max() > 0, f"{name} has no gradient in the reference: a vacuous check"
    ref_routes = routes([result], data.num_tokens, MODEL.topk)
    assert all((r >= 0).all() for r in ref_routes.values())
    return full_token_losses([result], data.num_tokens), grads, ref_routes


def _assert_matches(reference, results, data):
    ref_losses, ref_grads, ref_routes = reference
    got_routes = routes(results, data.num_tokens, MODEL.topk)
    assert got_routes.keys() == ref_routes.keys()
    for layer, experts in ref_routes.items():
        assert torch.equal(got_routes[layer], experts), f"layer {layer}: routing differs"
    assert_losses_and_grads_match(
        results, ref_losses, ref_grads, data.num_tokens, LOSS_ATOL, GRAD_RTOL
    )


@pytest.mark.parametrize("layout", BSHD_LAYOUTS, ids=lambda layout: layout.name)
def test_bshd_layout_matches_single_rank(layout, bshd_reference):
    results = run_workers(run_layout, layout.world_size, layout, BSHD_DATA, Step())
    _assert_matches(bshd_reference, results, BSHD_DATA)


@pytest.mark.parametrize("layout", BIAS_LAYOUTS, ids=lambda layout: layout.name)
def test_layout_with_biases_matches_single_rank(layout, bias_reference):
    assert any(name.endswith("linear_fc2.bias") for name in bias_reference[1])
    results = run_workers(run_layout, layout.world_size, layout, BSHD_DATA, BIAS_STEP)
    _assert_matches(bias_reference, results, BSHD_DATA)


@pytest.mark.parametrize("layout", THD_LAYOUTS, ids=lambda layout: layout.name)
def test_packed_layout_matches_single_rank(layout, thd_reference):
    results = run_workers(run_layout, layout.world_size, layout, THD_DATA, Step(micro_batch_size=2))
    _assert_matches(thd_reference, results, THD_DATA)


def test_forward_only_matches_training_losses(bshd_reference):
    """Forward-only passes through the interleaved schedule give the same losses."""
    layout = Layout(pp=2, vp=2)
    results = run_workers(run_layout, 2, layout, BSHD_DATA, Step(forward_only=True))
    assert all("grads" not in r for r in results)
    losses = full_token_losses(results, BSHD_DATA.num_tokens)
    torch.testing.assert_close(losses, bshd_reference[0], rtol=0, atol=LOSS_ATOL)
