"""--moe-allgather-static-shapes: Megatron's allgather dispatcher with no shape set by the routes.

Over two expert ranks (gloo) the layouts must take the forced routes and give the single-rank run's losses
and gradients (and Megatron's dispatcher's, to the bit), including where every token goes to the other
rank's experts (one rank's experts get no row: all its rows are past the routed ones) and at odd lengths;
one dispatch must read nothing back to the host and hand the experts the same number of rows whatever the
routes. The flag gives every MoE layer of a GPTModel and of a HybridModel the static dispatcher. On 2 GPUs
(NCCL) a live step makes no host sync, with the unfused permutation and with TE's fused one.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron_r3.layers.static_allgather import StaticShapeAllGatherTokenDispatcher
from megatron_r3.layers.transformer_impl import transformer_engine_installed
from megatron_r3.rl.arguments import model_settings, parse_args
from tests.support.batches import make_sequences
from tests.support.harness import Step, full_grads, full_token_losses
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.replay_layouts import random_forced_routes, run_replay_layout
from tests.support.tiny_moe import TinyMoE
from tests.test_layouts import BSHD_DATA, MODEL
from tests.test_replay_layouts import assert_replay_matches, replay_reference

pytestmark = pytest.mark.slow

STATIC = Step(flags=("--moe-allgather-static-shapes",))
EP2 = Layout(ep=2, dp=2, dispatcher="allgather")
BSHD_FORCED = random_forced_routes(MODEL, BSHD_DATA.num_tokens, 31, 7)
# Odd lengths: 9 tokens a sequence, 18 a microbatch and rank (Megatron's allgather needs equal counts per rank).
ODD_DATA = make_sequences([9] * 8, MODEL.vocab_size, seed=3)
ODD_FORCED = random_forced_routes(MODEL, ODD_DATA.num_tokens, 32, 7)
# Every token to experts 2 and 3: rank 1's; rank 0's experts get no row.
SKEWED = {layer: torch.tensor([2, 3]).expand(BSHD_DATA.num_tokens, 2).clone() for layer in MODEL.moe_layers}


@pytest.mark.parametrize("data,forced", [(BSHD_DATA, BSHD_FORCED), (BSHD_DATA, SKEWED), (ODD_DATA, ODD_FORCED)],
                         ids=["random-routes", "all-to-rank-1", "odd-lengths"])
def test_static_shapes_replay_forced_routes_as_one_rank_does(data, forced):
    (reference,) = run_workers(run_replay_layout, 1, Layout(), data, Step(), forced)
    results = run_workers(run_replay_layout, 2, EP2, data, STATIC, forced)
    assert_replay_matches(replay_reference(reference, data, forced), results, data)
    # and the same losses and gradients as Megatron's dispatcher over the same two ranks, to the bit
    assert_same_bits(results, run_workers(run_replay_layout, 2, EP2, data, Step(), forced), data)


def assert_same_bits(results, megatron, data):
    """Two runs gave the same per-token losses and gradients, bit for bit."""
    assert torch.equal(full_token_losses(results, data.num_tokens), full_token_losses(megatron, data.num_tokens))
    ours, theirs = full_grads(results), full_grads(megatron)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)


# Other groups around the dispatch: the allgather spans TP x EP under TP with SP, a pipeline moves the
# activations between stages, and full recompute runs each MoE layer's forward again in the backward.
MORE_LAYOUTS = [
    Layout(tp=2, sp=True, ep=2, etp=1, dp=2, dispatcher="allgather"),
    Layout(pp=2, ep=2, dp=2, dispatcher="allgather"),
    Layout(ep=2, dp=2, dispatcher="allgather", recompute="full"),
]


@pytest.mark.parametrize("layout", MORE_LAYOUTS, ids=lambda layout: layout.name)
def test_static_shapes_give_megatrons_dispatchers_results_under_more_layouts(layout):
    results = run_workers(run_replay_layout, layout.world_size, layout, BSHD_DATA, STATIC, BSHD_FORCED)
    megatron = run_workers(run_replay_layout, layout.world_size, layout, BSHD_DATA, Step(), BSHD_FORCED)
    assert_same_bits(results, megatron, BSHD_DATA)


def _dispatcher_types_worker(model, flags):
    """The token dispatchers' class names of the launcher's model of ``model`` with ``flags`` at EP=2."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from tests.support.tiny_moe import build_gpt

    init_parallel(EP2)
    try:
        _, chunks = build_gpt(EP2, model, flags=flags)
        layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
        return [type(layer.token_dispatcher).__name__ for layer in layers]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("pattern", [None, "*-*E*-*E"], ids=["gpt", "hybrid"])
def test_the_flag_gives_every_moe_layer_the_static_dispatcher(pattern):
    model = TinyMoE(hybrid_layer_pattern=pattern) if pattern else MODEL
    for types in run_workers(_dispatcher_types_worker, 2, model, list(STATIC.flags)):
        assert types == ["StaticShapeAllGatherTokenDispatcher"] * 2
    for types in run_workers(_dispatcher_types_worker, 2, model, []):
        assert types == ["MoEAllGatherTokenDispatcher"] * 2


def test_a_hybrid_models_moe_layers_take_the_static_dispatcher_too():
    hybrid = TinyMoE(hybrid_layer_pattern="*-*E*-*E")
    forced = random_forced_routes(hybrid, BSHD_DATA.num_tokens, 33, 7)
    results = run_workers(run_replay_layout, 2, EP2, BSHD_DATA, Step(model=hybrid, flags=STATIC.flags), forced)
    assert_same_bits(results, run_workers(run_replay_layout, 2, EP2, BSHD_DATA, Step(model=hybrid), forced), BSHD_DATA)


@contextlib.contextmanager
def _reading_back_refused(refuse: bool):
    """``Tensor.item``, ``.tolist`` and ``.cpu`` raise inside (where ``refuse``): what reads a value back."""
    originals = {method: getattr(torch.Tensor, method) for method in ("item", "tolist", "cpu")} if refuse else {}

    def refused(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host during the static dispatch")

    for method in originals:
        setattr(torch.Tensor, method, refused)
    try:
        yield
    finally:
        for method, original in originals.items():
            setattr(torch.Tensor, method, original)


def _dispatch_worker(seed):
    """One dispatch and combine of the static dispatcher over 2 ranks (2 local experts each, top-2), with
    ``.item()``, ``.tolist()`` and ``.cpu()`` refused in its own steps: the expert-side rows and counts and the
    combined output, with what Megatron's dispatcher computes from the same input."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_parallel(EP2)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
                                   moe_router_topk=2, moe_token_dispatcher_type="allgather",
                                   use_cpu_initialization=True, add_bias_linear=False)
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(seed * 2 + rank)
        ids = torch.rand(7, 4, generator=gen).topk(2, dim=-1).indices  # 7 tokens: odd
        routing_map = torch.zeros(7, 4, dtype=torch.bool).scatter(1, ids, True)
        probs = torch.rand(7, 4, generator=gen) * routing_map
        tokens = torch.randn(7, 8, generator=gen)
        results = {}
        for name, cls in (("static", StaticShapeAllGatherTokenDispatcher), ("megatron", MoEAllGatherTokenDispatcher)):
            dispatcher = cls(2, [rank * 2, rank * 2 + 1], config, moe_utils.get_default_pg_collection())
            hidden, dispatched_probs = dispatcher.dispatch_preprocess(tokens, routing_map, probs)
            hidden, dispatched_probs = dispatcher.token_dispatch(hidden, dispatched_probs)
            with _reading_back_refused(name == "static"):
                rows, counts, row_probs = dispatcher.dispatch_postprocess(hidden, dispatched_probs)
            # the experts: rows past the routed ones hold garbage, as torch's grouped GEMM leaves them
            expert_out = rows * 2 + 1
            expert_out[int(counts.sum()):] = float("nan")
            with _reading_back_refused(name == "static"):
                unpermuted = dispatcher.combine_preprocess(expert_out)
            out = dispatcher.combine_postprocess(dispatcher.token_combine(unpermuted))
            results[name] = rows, counts, row_probs, out
        return results
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("seed", [0, 1])
def test_one_dispatch_reads_nothing_back_and_hands_the_experts_a_fixed_number_of_rows(seed):
    for results in run_workers(_dispatch_worker, 2, seed):
        rows, counts, row_probs, out = results["static"]
        m_rows, m_counts, m_probs, m_out = results["megatron"]
        assert rows.shape[0] == 14 * 2  # 14 gathered tokens x min(top-2, 2 local experts), whatever the routes
        routed = int(m_counts.sum())
        assert torch.equal(counts, m_counts.to(counts.dtype))
        assert torch.equal(rows[:routed], m_rows) and torch.equal(row_probs[:routed], m_probs)
        assert (rows[routed:] == 0).all() and (row_probs[routed:] == 0).all()
        assert torch.equal(out, m_out)  # the NaN rows past the routed ones counted for nothing


def test_the_flag_is_refused_without_the_allgather_dispatcher():
    with pytest.raises(ValueError, match="needs --moe-token-dispatcher-type allgather"):
        model_settings(parse_args(["--moe-allgather-static-shapes"]))


def _sequential_experts_worker():
    from tests.support.tiny_moe import build_gpt

    init_parallel(EP2)
    try:
        build_gpt(EP2, MODEL, flags=["--moe-allgather-static-shapes", "--no-moe-grouped-gemm"])
    except ValueError as err:
        return str(err)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def test_experts_that_read_host_counts_are_refused():
    for error in run_workers(_sequential_experts_worker, 2):
        assert error is not None and "needs experts that take their token counts on the device" in error
        assert "SequentialMLP" in error


def _live_step_syncs_worker(flags):
    """Host syncs (waits and sync-debug warnings) of one forward and backward of two microbatches routed live,
    over 2 GPUs at EP=2 with the allgather dispatcher and ``flags``, after one step outside the count."""
    from megatron.core import parallel_state

    from megatron_r3.rl.profiling.host_syncs import counted_host_syncs
    from tests.support.batches import layout_microbatches
    from tests.support.tiny_moe import build_gpt

    device = init_parallel(EP2)
    try:
        _, (chunk,) = build_gpt(EP2, MODEL, device=device, flags=["--bf16", *flags])
        microbatches = layout_microbatches(EP2, BSHD_DATA, 2, device)

        def step():
            for mb in microbatches:
                loss = chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None, labels=mb.labels)
                loss.float().sum().backward()

        step()  # one-time moves (the rotary inv_freq of a model built on the CPU) and allocator warm-up
        torch.cuda.synchronize()
        counts = {}
        with counted_host_syncs(counts):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return counts["waits"] + counts["sync_debug"]
    finally:
        parallel_state.destroy_model_parallel()


TE_PERMUTE_FUSION = ("--transformer-impl", "transformer_engine", "--moe-grouped-gemm-impl", "torch",
                     "--moe-permute-fusion")


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [
    pytest.param((), id="local"),
    # TE's layers, as the other TE tests, where `make install` installed TE (R3_WITHOUT_TE opts out)
    pytest.param(TE_PERMUTE_FUSION, id="te-permute-fusion",
                 marks=pytest.mark.skipif(not transformer_engine_installed(), reason="TE's layers need TE")),
])
def test_a_live_step_at_ep2_makes_no_host_sync_with_static_shapes_only(flags):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert run_workers(_live_step_syncs_worker, 2, [*flags, *STATIC.flags], backend="nccl") == [0, 0]
    # Megatron's dispatcher reads its counts back in every MoE layer: the count above can fail
    assert all(syncs > 0 for syncs in run_workers(_live_step_syncs_worker, 2, list(flags), backend="nccl"))
