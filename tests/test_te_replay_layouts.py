"""Routing replay through TransformerEngine's layers (Megatron's TE specs), on GPUs over NCCL.

The replay layout matrix of ``tests/test_replay_layouts.py`` with ``--transformer-impl
transformer_engine`` in bf16: TE attention (THD rows and context parallelism), TE's fused
norm and linear layers, ``TEGroupedMLP`` experts. Every token gets a random forced route,
so a misplaced row (SP slice, CP zigzag, THD padding, PP/VP offset, EP dispatch) sends
tokens to the wrong experts. Each layout must take exactly the forced experts, record them
(R2) and give the single-GPU run's per-token losses (the logits' cross entropy) and
gradients within bf16 tolerance, with the dispatcher's split sizes on the device and from
host counts.

Tolerance: the layouts split sums differently (TP, SP, CP reduce partial results in
another order), and bf16 rounds each of the ~10 matrix products and norms of a layer to 8
mantissa bits (relative step 2**-8 = 3.9e-3). Over 4 layers that gives per-token loss
differences of a few 1e-3 to 1e-2 on losses of about ln(64) = 4.2, and gradient
differences of a few percent of a tensor's largest entry. ``LOSS_ATOL`` and ``GRAD_RTOL``
sit above that; the negative control shows that one token's route moved by one position
under CP THD is far outside them.
"""

import pytest
import torch

from megatron_r3.layers.transformer_impl import transformer_engine_installed
from tests.support.batches import make_sequences
from tests.support.harness import Step, assert_grads_match, full_grads, full_token_losses
from tests.support.launcher import run_workers
from tests.support.parallel import Layout
from tests.support.replay_layouts import random_forced_routes, run_replay_layout, taken_and_recorded
from tests.support.tiny_moe import TinyMoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not transformer_engine_installed(), reason="needs TransformerEngine (make install on a "
                       "CUDA machine installs it)"),
]

# Head dimension 16 and widths that are multiples of 16: what TE's fused kernels expect.
MODEL = TinyMoE(hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=64, num_attention_heads=4,
                num_query_groups=2)
TE_FLAGS = ("--transformer-impl", "transformer_engine", "--bf16")
BSHD_DATA = make_sequences([16] * 8, MODEL.vocab_size, seed=1)
# Odd lengths: every sequence is padded for CP=2 (multiples of 4) and TP with SP.
THD_DATA = make_sequences([5, 9, 7, 11, 3, 13, 15, 1], MODEL.vocab_size, seed=2)
BSHD_FORCED = random_forced_routes(MODEL, BSHD_DATA.num_tokens, 21)
THD_FORCED = random_forced_routes(MODEL, THD_DATA.num_tokens, 22)
LOSS_ATOL = 5e-2
GRAD_RTOL = 5e-2


def _step(*flags, micro_batch_size=2):
    # The unfused rotary embedding unless a layout asks for TE's fused one: the references are unfused.
    rope = () if "--apply-rope-fusion" in flags else ("--no-rope-fusion",)
    return Step(model=MODEL, micro_batch_size=micro_batch_size, flags=(*TE_FLAGS, *rope, *flags))


def _run(layout, data, step, forced, host_counts=False):
    if torch.cuda.device_count() < layout.world_size:
        pytest.skip(f"{layout.name} needs {layout.world_size} GPUs, {torch.cuda.device_count()} visible")
    return run_workers(run_replay_layout, layout.world_size, layout, data, step, forced, host_counts,
                       backend="nccl", timeout=300)


def _result(results, data, forced):
    """Losses and gradients of a run, after checking that every token took its forced experts."""
    taken = taken_and_recorded(results, data.num_tokens, MODEL.topk)
    assert sorted(taken) == sorted(forced)
    for layer, experts in forced.items():
        assert torch.equal(taken[layer], experts.sort(dim=-1).values), f"layer {layer}: forced experts not taken"
    grads = full_grads(results)
    routers = [name for name in grads if "router" in name]
    assert routers and all(grads[name].abs().max() > 0 for name in routers), "replayed routers got no gradient"
    return full_token_losses(results, data.num_tokens), grads


def _loss_error(result, reference) -> float:
    return (result[0] - reference[0]).abs().max().item()


def _assert_close(result, reference):
    errors = (result[0] - reference[0]).abs()
    far = (errors > LOSS_ATOL).nonzero().flatten()
    assert far.numel() == 0, (f"per-token loss error {errors.max().item():.3g}; {far.numel()} of {errors.numel()} "
                              f"tokens beyond {LOSS_ATOL}, the first: {far[:16].tolist()}")
    assert_grads_match(result[1], reference[1], GRAD_RTOL)


@pytest.fixture(scope="module")
def bshd_reference():
    return _result(_run(Layout(), BSHD_DATA, _step(), BSHD_FORCED), BSHD_DATA, BSHD_FORCED)


@pytest.fixture(scope="module")
def thd_reference():
    layout = Layout(packed=True)
    return _result(_run(layout, THD_DATA, _step(micro_batch_size=1), THD_FORCED), THD_DATA, THD_FORCED)


STATIC_ALLGATHER = ("--moe-allgather-static-shapes", "--moe-grouped-gemm-impl", "torch")
BSHD_LAYOUTS = {
    "tp2-sp": (Layout(tp=2, sp=True), ()),
    "ep2-alltoall": (Layout(ep=2, dp=2, dispatcher="alltoall"), ()),
    "ep2-allgather": (Layout(ep=2, dp=2, dispatcher="allgather"), ()),
    "pp2": (Layout(pp=2), ()),
    "pp2-first1-recompute-full": (Layout(pp=2, first_stage_layers=1, recompute="full"), ()),
    "pp2-last1": (Layout(pp=2, last_stage_layers=1), ()),
    "pp2-vp2": (Layout(pp=2, vp=2), ()),
    "cp2-p2p": (Layout(cp=2), ("--cp-comm-type", "p2p")),
    "cp2-a2a": (Layout(cp=2), ("--cp-comm-type", "a2a")),
    "tp2-sp-recompute-selective": (Layout(tp=2, sp=True, recompute="selective"), ()),
    "tp2-sp-ep2-etp1": (Layout(tp=2, sp=True, ep=2, etp=1, dp=1), ()),
    # TE's fusions: replayed tokens take the unfused top-k under --moe-router-fusion (the series' router-fusion patch), and
    # the fused permutation moves the replayed routes' tokens.
    "ep2-router-fusion": (Layout(ep=2, dp=2, dispatcher="alltoall"), ("--moe-router-fusion",)),
    "ep2-permute-fusion": (Layout(ep=2, dp=2, dispatcher="alltoall"), ("--moe-permute-fusion",)),
    # The allgather dispatcher with static shapes: rows past the routed ones, unfused or through TE's fused
    # permutation, never reach a token.
    "ep2-allgather-static": (Layout(ep=2, dp=2, dispatcher="allgather"), STATIC_ALLGATHER),
    "ep2-allgather-static-permute-fusion": (Layout(ep=2, dp=2, dispatcher="allgather"),
                                            (*STATIC_ALLGATHER, "--moe-permute-fusion")),
}
THD_LAYOUTS = {
    "cp2-thd-p2p": (Layout(cp=2, packed=True), ("--cp-comm-type", "p2p")),
    "cp2-thd-a2a": (Layout(cp=2, packed=True), ("--cp-comm-type", "a2a")),
    "tp2-sp-thd": (Layout(tp=2, sp=True, packed=True), ()),
    # TE's fused rotary embedding on packed rows, against the unfused reference: the same positions (each sequence
    # from 0; under CP each rank's two chunks of it).
    "thd-rope-fusion": (Layout(packed=True), ("--apply-rope-fusion",)),
    "cp2-thd-p2p-rope-fusion": (Layout(cp=2, packed=True), ("--cp-comm-type", "p2p", "--apply-rope-fusion")),
}


@pytest.mark.parametrize("name", sorted(BSHD_LAYOUTS))
def test_te_bshd_layout_replays_forced_routes(name, bshd_reference):
    layout, flags = BSHD_LAYOUTS[name]
    result = _result(_run(layout, BSHD_DATA, _step(*flags), BSHD_FORCED), BSHD_DATA, BSHD_FORCED)
    _assert_close(result, bshd_reference)


@pytest.mark.parametrize("name", sorted(THD_LAYOUTS))
def test_te_packed_layout_replays_forced_routes(name, thd_reference):
    layout, flags = THD_LAYOUTS[name]
    result = _result(_run(layout, THD_DATA, _step(*flags), THD_FORCED), THD_DATA, THD_FORCED)
    _assert_close(result, thd_reference)


@pytest.mark.parametrize("layout, flags", [
    (Layout(), ()),
    (Layout(ep=2, dp=2, dispatcher="alltoall"), ()),
    # TE's fused sort by local expert reads the split sizes on the device: copied there from the host counts.
    (Layout(ep=2, dp=2, dispatcher="alltoall"), ("--moe-permute-fusion",)),
], ids=["single", "ep2-dp2-alltoall", "ep2-dp2-alltoall-permute-fusion"])
def test_te_host_split_sizes_replay_forced_routes(layout, flags, bshd_reference):
    """The alltoall dispatcher's sync-free path (split sizes from host token counts) under TE's layers."""
    result = _result(_run(layout, BSHD_DATA, _step(*flags), BSHD_FORCED, host_counts=True), BSHD_DATA, BSHD_FORCED)
    _assert_close(result, bshd_reference)


@pytest.mark.parametrize("layout", [Layout(ep=4, dp=4, dispatcher="alltoall"), Layout(tp=2, sp=True, ep=2, etp=1, dp=2)],
                         ids=lambda layout: layout.name)
def test_te_four_gpu_host_split_sizes_replay_forced_routes(layout, bshd_reference):
    result = _result(_run(layout, BSHD_DATA, _step(), BSHD_FORCED, host_counts=True), BSHD_DATA, BSHD_FORCED)
    _assert_close(result, bshd_reference)


def test_a_route_moved_by_one_token_under_cp_thd_is_seen(thd_reference):
    """Negative control: the same CP THD run with one sequence's routes moved by one token
    (rows shifted within sequence 3) takes other experts and misses the reference's losses."""
    lengths = [len(t) for t in THD_DATA.tokens]
    start = sum(lengths[:3])
    shifted = {layer: experts.clone() for layer, experts in THD_FORCED.items()}
    for experts in shifted.values():
        experts[start:start + lengths[3]] = experts[start:start + lengths[3]].roll(1, dims=0)
    layout = Layout(cp=2, packed=True)
    result = _result(_run(layout, THD_DATA, _step(), shifted), THD_DATA, shifted)
    assert _loss_error(result, thd_reference) > 4 * LOSS_ATOL, (
        f"moving routes by one token changed the losses by only {_loss_error(result, thd_reference):.3g}"
    )


@pytest.mark.parametrize("host_counts", [False, True], ids=["device-splits", "host-splits"])
def test_te_layers_with_torchs_grouped_experts_replay_forced_routes(host_counts):
    """--moe-grouped-gemm-impl torch: TE's layers with GroupedGemmExperts (device group offsets) at EP=2
    give the single GPU's losses and gradients, its routes replayed and recorded."""
    step = _step("--moe-grouped-gemm-impl", "torch")
    reference = _result(_run(Layout(), BSHD_DATA, step, BSHD_FORCED), BSHD_DATA, BSHD_FORCED)
    assert any("local_experts" in name for name in reference[1])  # GroupedGemmExperts' parameters
    layout = Layout(ep=2, dp=2, dispatcher="alltoall")
    result = _result(_run(layout, BSHD_DATA, step, BSHD_FORCED, host_counts=host_counts), BSHD_DATA, BSHD_FORCED)
    _assert_close(result, reference)
