"""GPU: a replayed training step with host split sizes makes no host sync (forward, backward,
full recompute), on one GPU and with EP=2 over NCCL; the same step without host split sizes does."""

from functools import partial

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_r3.layers.transformer_impl import te_grouped_gemm_problem, transformer_engine_installed
from megatron_r3.rl.profiling.host_syncs import counted_host_syncs
from megatron_r3.routing_replay import moe_routing_for_chunk
from tests.support.batches import layout_microbatches, make_sequences
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.replay_layouts import _counts, chunk_expert_ids, host_count_exchange, random_forced_routes
from tests.support.routes import router_token_index
from tests.support.schedule import loss_func
from tests.support.tiny_moe import TinyMoE, build_gpt

pytestmark = pytest.mark.gpu

MODEL = TinyMoE(num_experts=8)
DATA = make_sequences([16] * 8, MODEL.vocab_size, seed=5)
FORCED = random_forced_routes(MODEL, DATA.num_tokens, seed=6)


def prepared_forward_step(data_iterator, model):
    mb, expert_ids, host_counts = next(data_iterator)
    routing = moe_routing_for_chunk(model, expert_ids, every_token_routed=True, host_tokens_per_expert=host_counts)
    per_token_loss = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None,
                           labels=mb.labels, extra_block_kwargs={"moe_routing": routing})
    return per_token_loss, partial(loss_func, mb)


def run_step(chunk, prepared):
    get_forward_backward_func()(
        forward_step_func=prepared_forward_step,
        data_iterator=iter(prepared),
        model=[chunk],
        num_microbatches=len(prepared),
        seq_length=prepared[0][0].seq_length,
        micro_batch_size=prepared[0][0].tokens.size(0),
        forward_only=False,
    )


def step_worker(layout, host_counts, debug_mode):
    """One forward+backward of prepared microbatches under ``set_sync_debug_mode(debug_mode)``."""
    device = init_parallel(layout)
    try:
        # SequentialMLP (and, at EP=2, the all-to-all) need split sizes on the host.
        config, (chunk,) = build_gpt(layout, MODEL, seed=0, device=device,
                                     flags=["--moe-enable-routing-replay", "--no-moe-grouped-gemm"])
        exchange = host_count_exchange(config)["exchange"]
        prepared = []
        for mb in layout_microbatches(layout, DATA, 2, device):
            expert_ids = chunk_expert_ids(chunk, router_token_index(mb, layout.sp), FORCED)
            counts = None
            if host_counts:
                (counts,) = exchange.gather([_counts(expert_ids, MODEL.num_experts)], [len(expert_ids)])
            prepared.append((mb, expert_ids.to(device), counts))
        # A first step outside the check: one-time moves (the rotary inv_freq of a model built
        # on the CPU) and allocator warm-up are not per-step syncs.
        run_step(chunk, prepared)
        chunk.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        counts = {}
        with counted_host_syncs(counts):
            torch.cuda.set_sync_debug_mode(debug_mode)
            try:
                run_step(chunk, prepared)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        grad_norm = sum(float(p.grad.float().norm()) for p in chunk.parameters() if p.grad is not None)
        return {"waits": counts["waits"], "sync_warnings": counts["sync_debug"],
                "grad_norm": grad_norm}
    finally:
        parallel_state.destroy_model_parallel()


LAYOUTS = [Layout(), Layout(recompute="full"), Layout(ep=2, dp=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_replayed_step_with_host_splits_makes_no_host_sync(layout):
    if torch.cuda.device_count() < layout.world_size:
        pytest.skip(f"needs {layout.world_size} GPUs")
    for result in run_workers(step_worker, layout.world_size, layout, True, "error", backend="nccl"):
        assert result["waits"] == 0 and result["sync_warnings"] == 0
        assert result["grad_norm"] > 0
    # The same step without host split sizes syncs: the check above can fail.
    for result in run_workers(step_worker, layout.world_size, layout, False, "warn", backend="nccl"):
        assert result["waits"] + result["sync_warnings"] > 0


def launcher_update_pass_worker(argv, fillers):
    """The launcher's R3 update pass (embedded default, rollout-shaped samples from its engine)
    under ``set_sync_debug_mode("error")`` with filler routes, or counted without them."""
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.model.passes import run_pass
    from megatron_r3.rl.run import setup
    from megatron_r3.rl.trainer.policy_trainer import PolicyLoss

    settings = run_settings(parse_args(argv))
    device = initialize(settings)
    try:
        run = setup(settings, device)
        batch = run.source.batch(1)  # the engine's samples: no route for each final token
        trainer = run.trainer

        def update_pass():
            microbatches = trainer.pipeline.prepare(batch.samples, batch.advantages, rollout_routes=True,
                                                    fillers=fillers)
            return run_pass(trainer.chunks, microbatches, PolicyLoss(trainer.settings), forward_only=False)

        update_pass()  # one-time moves (rotary inv_freq to the GPU) and allocator warm-up
        torch.cuda.synchronize()
        counts = {}
        with counted_host_syncs(counts):
            torch.cuda.set_sync_debug_mode("error" if fillers else "warn")
            try:
                result = update_pass()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        run.source.close()
        experts = [layer.experts for layer in trainer.chunks[0].modules() if isinstance(layer, MoELayer)]
        return {"syncs": counts["sync_debug"] + counts["waits"], "host_split": result.host_split_microbatches,
                "microbatches": len(result.items),
                "device_counts": all(getattr(e, "takes_device_tokens_per_expert", False) for e in experts),
                "te_grouped_by_default": transformer_engine_installed() and te_grouped_gemm_problem() is None}
    finally:
        parallel_state.destroy_model_parallel()


# Experts flags, and whether those experts take their token counts on the device: torch's grouped
# experts (GroupedGemmExperts) do; SequentialMLP and TE's TEGroupedMLP wait for them on the host.
# The launcher's default grouped experts (None) are TEGroupedMLP where TE runs its grouped GEMM as one
# GEMM on the node, else torch's (te_grouped_gemm_problem). TE's fused permutation (one expert rank
# here) takes host counts and leaves device counts on the device as the unfused one does.
LAUNCHER_EXPERTS = {
    "grouped": ((), None),
    "te-grouped": (("--moe-grouped-gemm-impl", "transformer_engine"), False),
    "torch-grouped": (("--moe-grouped-gemm-impl", "torch"), True),
    "torch-grouped-permute-fusion": (("--moe-grouped-gemm-impl", "torch", "--moe-permute-fusion"), True),
    "sequential": (("--no-moe-grouped-gemm",), False),
}
NEEDS_TE = {"te-grouped", "torch-grouped-permute-fusion"}


@pytest.mark.parametrize("experts", [
    pytest.param(name, marks=pytest.mark.skipif(name in NEEDS_TE and not transformer_engine_installed(),
                                                reason="TEGroupedMLP and TE's fused permutation need TE"))
    for name in sorted(LAUNCHER_EXPERTS)])
def test_the_launchers_replayed_update_pass_makes_no_host_sync(experts):
    flags, device_counts = LAUNCHER_EXPERTS[experts]
    argv = ["--moe-enable-routing-replay", "--train-iters", "1", *flags]
    (result,) = run_workers(launcher_update_pass_worker, 1, argv, True, backend="nccl")
    assert result["syncs"] == 0 and result["host_split"] == result["microbatches"] > 0
    # Without fillers the final tokens route live, so no host split sizes: Megatron's device path,
    # where only experts that take device counts run without a sync.
    (result,) = run_workers(launcher_update_pass_worker, 1, argv, False, backend="nccl")
    assert result["host_split"] == 0
    if device_counts is None:
        device_counts = not result["te_grouped_by_default"]
    assert result["device_counts"] == device_counts
    assert result["syncs"] == 0 if device_counts else result["syncs"] > 0


def test_routes_given_in_another_layer_order_are_selected_without_a_host_sync():
    """A caller may hold the routes' layers in another order than the chunk builds them (or more
    layers, of other pipeline stages): the rows are taken by Python indices (a blocking
    host-to-device copy of an index tensor waited for the stream)."""
    from tests.support.replay import NUM_EXPERTS, TOPK, init_single_rank, make_config, make_model

    init_single_rank()
    model = make_model(make_config()).cuda()  # MoE layers 2, 3, 4
    gen = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOPK] for _ in range(12)])
                       for _ in range(3)]).cuda()  # rows for layers 4, 2, 3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routing = moe_routing_for_chunk(model, ids, layer_numbers=[4, 2, 3], every_token_routed=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert routing.layer_numbers == [2, 3, 4]
    assert torch.equal(routing.expert_ids, ids[[1, 2, 0]])
