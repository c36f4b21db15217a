"""Routing replay through multi-token prediction on TransformerEngine's layers (one GPU, NCCL).

A GPTModel of Megatron's TE specs (``get_gpt_decoder_block_spec`` and ``get_gpt_mtp_block_spec``
with ``use_transformer_engine=True``, ``TEGroupedMLP`` experts, bf16) with one MTP depth whose
layer is MoE. The MTP layer is layer ``num_layers + 1`` of ``MoERouting``. A recording pass
routes live and records every MoE layer, the MTP one included; replaying that recording must
take exactly the recorded experts in every layer and give the recording pass's loss and
gradients, the MTP router's included. Forced random routes are taken as given, in the MTP layer
too, and move the experts' gradients.

Tolerance: the replayed pass runs the recording pass's kernels on the same inputs and experts,
so it differs only where a kernel is not deterministic; bf16 rounds each product to 8 mantissa
bits, so 1e-2 on losses of about ln(64) and 5% of a gradient's largest entry are far above that
and far below what other experts change (the forced-routes check).
"""

import pytest
import torch

from megatron_r3.layers.transformer_impl import transformer_engine_installed
from tests.support.launcher import run_workers
from tests.unit_tests.transformer.moe.moe_routing_utils import (
    NUM_EXPERTS,
    TOPK,
    VOCAB,
    as_routing_map,
    make_batch,
    random_routes,
    routing_maps,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not transformer_engine_installed(), reason="needs TransformerEngine (make install on a "
                       "CUDA machine installs it)"),
]

NUM_LAYERS = 2
SEQ, BATCH = 16, 2
LOSS_ATOL = 1e-2
GRAD_RTOL = 5e-2


def _model(device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=64, moe_layer_freq=[0, 1],
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=True, moe_enable_routing_replay=True, mtp_num_layers=1, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        transformer_impl="transformer_engine",
    )
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=True)
    model = GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ, mtp_block_spec=mtp).to(device)
    # Megatron's bf16 wrapper: GPTModel leaves some parameters (the learned position embedding, ...) in
    # fp32 for it to cast, and TE's layers refuse fp32 inputs to bf16 weights outside autocast.
    return Float16Module(config, model)


def _pass(model, batch, routing):
    """Loss (summed), the gradients, and the routing map each router took: one forward and backward."""
    tokens, position_ids, labels = batch
    model.zero_grad(set_to_none=True)
    with routing_maps(model) as seen:
        loss = model(tokens, position_ids, None, labels=labels, extra_block_kwargs={"moe_routing": routing}).sum()
        loss.backward()
    grads = {name.removeprefix("module."): p.grad.float().clone()  # the names of the GPTModel inside the wrapper
             for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, {layer: maps[0] for layer, maps in seen.items()}


def mtp_replay_worker():
    """One rank: record, replay the recording, force random routes; returns what the parent checks."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe.moe_routing import MoERouting

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    parallel_state.initialize_model_parallel()
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        torch.manual_seed(3)
        model = _model(device)
        batch = tuple(t.to(device) for t in make_batch(BATCH, SEQ, seed=5))
        layers = [NUM_LAYERS, NUM_LAYERS + 1]  # the decoder's MoE layer and the MTP depth's

        recording = MoERouting(layers, record=True)
        live = _pass(model, batch, recording)
        recorded = recording.recorded_expert_ids()
        replayed = _pass(model, batch, MoERouting(layers, expert_ids=recorded))
        forced_ids = random_routes(len(layers), BATCH * SEQ, seed=6)
        forced = _pass(model, batch, MoERouting(layers, expert_ids=forced_ids.to(device)))
        return {"layers": layers, "recorded": recorded.cpu(), "forced_ids": forced_ids,
                "live": _cpu(live), "replayed": _cpu(replayed), "forced": _cpu(forced)}
    finally:
        parallel_state.destroy_model_parallel()


def _cpu(result):
    loss, grads, taken = result
    return loss, {k: v.cpu() for k, v in grads.items()}, {k: v.cpu() for k, v in taken.items()}


def test_mtp_layers_replay_on_te_layers():
    (out,) = run_workers(mtp_replay_worker, 1, backend="nccl", timeout=300)
    live_loss, live_grads, live_taken = out["live"]
    loss, grads, taken = out["replayed"]
    assert sorted(live_taken) == out["layers"], "the MTP depth's MoE layer did not route"
    for row, layer in enumerate(out["layers"]):
        assert torch.equal(live_taken[layer], as_routing_map(out["recorded"][row])), f"layer {layer}: recorded != live"
        assert torch.equal(taken[layer], live_taken[layer]), f"layer {layer}: the replay took other experts"
    assert abs(loss - live_loss) <= LOSS_ATOL * BATCH * SEQ
    routers = [name for name in live_grads if "router" in name]
    assert any(name.startswith("mtp.") for name in routers), routers
    for name, grad in live_grads.items():
        scale = grad.abs().max().clamp(min=1e-12)
        assert (grads[name] - grad).abs().max() <= GRAD_RTOL * scale, name
    for name in routers:
        assert grads[name].abs().max() > 0, f"{name}: no gradient under replay"
    _, forced_grads, forced_taken = out["forced"]
    for row, layer in enumerate(out["layers"]):
        assert torch.equal(forced_taken[layer], as_routing_map(out["forced_ids"][row])), f"layer {layer}: not forced"
    # Other experts take the tokens, so the experts' gradients move far beyond the replay's tolerance.
    moved = [name for name, grad in live_grads.items() if ".experts." in name and (
        forced_grads.get(name, torch.zeros_like(grad)) - grad).abs().max() > GRAD_RTOL * grad.abs().max()]
    assert any(name.startswith("mtp.") for name in moved), f"forced routes moved only {moved}"
