"""MTP routes: an engine's MTP rows replay into our MTP numbering; without them the MTP layers route live, counted.

Megatron's inference engine keeps one ``RouterReplay`` per MoE router, the MTP block's after
the decoder's (router_replay.py, contexts/routing_metadata.py @ NVIDIA/Megatron-LM
core_v0.19.0), so its ``routing_indices`` may hold one more row group; the adapters map that
group by position to our MTP numbering (``num_layers + k``), whatever layer number the
engine's MTP router carried (NeMo-RL #4057: they alias decoder layers). vLLM's capturer skips
layers past ``num_hidden_layers`` and SGLang opts its draft model out of capture
(state_capturer/draft_guard.py @ sgl-project/sglang 4e7fe09c): their routes cover the decoder only.

The model here is a CPU GPTModel of four layers (MoE at 2 and 4) and one MTP depth built from
the last layer's spec, so the MTP layer is MoE and numbered 5.
"""

import base64
import io
import json

import numpy as np
import pytest
import torch

from megatron_r3.dataplane.device.packing import gather_routes
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.engines.adapters import from_megatron_inference, from_vllm
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.layers.moe_layers import mtp_moe_layers
from tools.dump_rollouts import main

NUM_LAYERS, MOE_LAYERS, MTP_LAYER, EXPERTS, TOPK = 4, (2, 4), 5, 8, 2
SPEC = RoutingSpec(num_layers=NUM_LAYERS, model_moe_layers=MOE_LAYERS, num_experts=EXPERTS, topk=TOPK,
                   mtp_moe_layers=(MTP_LAYER,))
FLAGS = ["--num-layers", "4", "--moe-layer-freq", "0,1,0,1", "--num-experts", "8", "--moe-router-topk", "2"]
PROMPT, COMPLETION = 7, 5
T = PROMPT + COMPLETION


def engine_routes(seed, groups):
    """[T - 1, groups, TOPK] int32: distinct random experts per token and layer."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((T - 1, groups, EXPERTS)), axis=2)[:, :, :TOPK].astype(np.int32)


def test_the_mtp_layers_of_a_model_are_numbered_after_its_decoder():
    assert mtp_moe_layers(4, (2, 4), 2) == (5, 6)
    assert mtp_moe_layers(4, (1, 3), 2) == ()  # the last decoder layer is dense: so are the MTP depths
    assert mtp_moe_layers(4, (2, 4), None) == ()
    assert mtp_moe_layers(4, (2, 4), hybrid_layer_pattern="*E*E/*E/*E") == (6, 8)
    assert SPEC.routed_layers == (2, 4, 5)
    with pytest.raises(ValueError, match=r"MTP MoE layers \(4,\) must be increasing and numbered after the 4"):
        RoutingSpec(num_layers=4, model_moe_layers=(2, 4), num_experts=8, topk=2, mtp_moe_layers=(4,))


def _gpt_with_mtp():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 0, 1], moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_enable_routing_replay=True, use_cpu_initialization=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=1,
    )
    assert RoutingSpec.from_config(config) == SPEC
    torch.manual_seed(5)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
    return GPTModel(config, block, vocab_size=64, max_sequence_length=T, mtp_block_spec=mtp)


def _routes_taken(model, tokens, expert_ids, layer_numbers):
    """{layer: [tokens, EXPERTS] routing map} each router took in one forward of one sample (b = 1)."""
    from megatron.core.transformer.moe.moe_routing import MoERouting
    from tests.unit_tests.transformer.moe.moe_routing_utils import routing_maps

    model.eval()  # the MTP layer runs; its training-only loss logging (CUDA-only) does not
    position_ids = torch.arange(T).unsqueeze(0)
    with torch.no_grad(), routing_maps(model) as seen:
        model(tokens, position_ids, None, extra_block_kwargs={"moe_routing": MoERouting(list(layer_numbers),
                                                                                        expert_ids=expert_ids)})
    return {layer: maps[0] for layer, maps in seen.items()}


def _replay_input(sample):
    """The trainer's replay input of one sample on one rank: int64 [layers, T, TOPK], -1 rows for no route."""
    routes = sample.routes
    plan = RoutingPlan.build(RankLayout(), [routes.num_tokens], source_layer_numbers=routes.layer_numbers,
                             layer_numbers=routes.layer_numbers, qkv_format="thd")
    return gather_routes(torch.from_numpy(routes.ids), torch.from_numpy(routes.valid),
                         torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index))


def _as_map(ids):
    return torch.zeros(ids.shape[0], EXPERTS, dtype=torch.bool).scatter(1, torch.as_tensor(ids).long(), True)


def _megatron_line(rows):
    tokens = list(range(3, 3 + T))
    return {"response": {"id": "cmpl-mtp", "choices": [{
        "index": 0, "prompt_token_ids": tokens[:PROMPT], "generation_token_ids": tokens[PROMPT:],
        "generation_log_probs": [-0.5] * COMPLETION, "moe_topk_indices": rows.tolist(), "finish_reason": "length"}]}}


def _vllm_line(rows):
    """vLLM 0.33: uint8 over every hidden layer (dense zero), sent as base64 .npy; no MTP rows."""
    full = np.zeros((T - 1, NUM_LAYERS, TOPK), np.uint8)
    full[:, np.asarray(MOE_LAYERS) - 1] = rows
    buffer = io.BytesIO()
    np.save(buffer, full)
    tokens = list(range(3, 3 + T))
    return {"request_id": "v-mtp", "prompt_token_ids": tokens[:PROMPT], "prompt_logprobs": None, "outputs": [{
        "index": 0, "token_ids": tokens[PROMPT:], "logprobs": [{str(t): {"logprob": -0.5}} for t in tokens[PROMPT:]],
        "routed_experts": base64.b64encode(buffer.getvalue()).decode(), "finish_reason": "length"}]}


def test_megatron_mtp_routes_replay_into_the_mtp_layer_through_a_dump(tmp_path):
    from tests.unit_tests.test_utilities import Utils

    rows = engine_routes(0, 3)  # decoder MoE layers 2 and 4, then the MTP router
    source, out = tmp_path / "in.jsonl", tmp_path / "mtp.r3dump"
    source.write_text(json.dumps(_megatron_line(rows)) + "\n")
    assert main(["--engine", "megatron", "--input", str(source), "--out", str(out), *FLAGS,
                 "--mtp-num-layers", "1"]) == 0
    with RolloutDumpReader(out) as reader:
        assert reader.layer_numbers == (2, 4, 5)
        (sample,) = list(reader)
    assert SPEC.mtp_live_tokens(sample.routes) == 1  # the final sampled token only
    expert_ids = _replay_input(sample)
    np.testing.assert_array_equal(expert_ids[:, :-1].permute(1, 0, 2).numpy(), rows)
    Utils.initialize_model_parallel(1, 1)
    try:
        model = _gpt_with_mtp()
        tokens = torch.from_numpy(sample.token_ids).long().unsqueeze(0) % 64
        taken = _routes_taken(model, tokens, expert_ids, sample.routes.layer_numbers)
        live = _routes_taken(model, tokens, expert_ids[:2], MOE_LAYERS)
    finally:
        Utils.destroy_model_parallel()
    for row, layer in enumerate((2, 4, MTP_LAYER)):
        assert torch.equal(taken[layer][:-1], _as_map(rows[:, row])), layer
    # Without the MTP rows the MTP router decides for itself, and not as the engine did.
    assert torch.equal(live[2][:-1], _as_map(rows[:, 0]))
    assert not torch.equal(live[MTP_LAYER][:-1], _as_map(rows[:, 2]))


def test_routes_without_mtp_rows_leave_the_mtp_layers_live_and_the_tool_counts_them(tmp_path, capsys):
    rows = engine_routes(1, 2)
    every_layer = np.insert(np.insert(rows.astype(np.uint8), 0, 0, axis=1), 2, 0, axis=1)  # dense 1 and 3 zero
    routes = from_vllm(every_layer, SPEC, num_tokens=T, sample=0)
    assert routes.layer_numbers == MOE_LAYERS and SPEC.mtp_live_tokens(routes) == T
    source, out = tmp_path / "in.jsonl", tmp_path / "decoder.r3dump"
    source.write_text(json.dumps(_vllm_line(rows)) + "\n" + json.dumps(_vllm_line(engine_routes(2, 2))) + "\n")
    assert main(["--engine", "vllm", "--input", str(source), "--out", str(out), *FLAGS, "--mtp-num-layers", "1"]) == 0
    assert capsys.readouterr().out == (f"wrote {out}: 2 samples from 2 requests, 24 tokens, routed fraction 0.9167, "
                                       f"24 tokens route live at the MTP MoE layers\n")
    with RolloutDumpReader(out) as reader:
        assert reader.layer_numbers == MOE_LAYERS


def test_a_dump_takes_one_set_of_layers(tmp_path, capsys):
    """MTP routes on the first line, none on the second: one dump cannot hold both; the line is named."""
    source, out = tmp_path / "in.jsonl", tmp_path / "o.r3dump"
    source.write_text(json.dumps(_megatron_line(engine_routes(3, 3))) + "\n"
                      + json.dumps(_megatron_line(engine_routes(4, 2))) + "\n")
    assert main(["--engine", "megatron", "--input", str(source), "--out", str(out), *FLAGS,
                 "--mtp-num-layers", "1"]) == 1
    err = capsys.readouterr().err
    assert (f"{source} line 2: request 'cmpl-mtp' sample 0: routes cover MoE layers [2, 4], earlier lines' "
            f"[2, 4, 5]: a dump holds one set") in err
    assert not out.exists()


@pytest.mark.parametrize("groups, spec, message", [
    (4, SPEC, r"moe_topk_indices has 4 layers, the model has 4 decoder layers, 2 of them MoE, and 1 MTP MoE layers: "
              r"Megatron returns one row per MoE layer \(2\), then one per MTP MoE layer \(1\)"),
    (3, RoutingSpec(num_layers=4, model_moe_layers=(2, 4), num_experts=8, topk=2),
     r"moe_topk_indices has 3 layers, the model has 4 decoder layers, 2 of them MoE: Megatron returns one row per "
     r"MoE layer \(2\); routes for another model\?"),
])
def test_mtp_row_groups_that_do_not_fit_the_model_are_refused(groups, spec, message):
    with pytest.raises(RoutingValidationError, match=rf"sample 0: {message}"):
        from_megatron_inference(engine_routes(5, groups), spec, num_tokens=T, sample=0)

