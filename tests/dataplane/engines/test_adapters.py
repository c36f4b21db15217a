"""Adapters on fixtures built to each engine's documented format, and host validation errors."""

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_r3.dataplane.device.packing import gather_routes
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.engines.adapters import from_array, from_megatron_recorded, from_sglang, from_vllm
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.routes import RolloutRoutes, concat_routes
from megatron_r3.dataplane.samples import RoutingSpec

# A dense-first model: 6 decoder layers, layer 1 dense, MoE layers 2..6 except 4.
SPEC = RoutingSpec(num_layers=6, model_moe_layers=(2, 3, 5, 6), num_experts=64, topk=4)


def engine_rows(rng, num_tokens, spec=SPEC):
    """What vLLM / SGLang return: int32 [num_tokens - 1, num_layers, topk], dense layers zero."""
    rows = np.zeros((num_tokens - 1, spec.num_layers, spec.topk), np.int32)
    for n in spec.model_moe_layers:
        rows[:, n - 1] = np.argsort(rng.random((num_tokens - 1, spec.num_experts)), axis=1)[:, : spec.topk]
    return rows


def test_spec_from_megatron_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=6, hidden_size=64, num_attention_heads=4, num_moe_experts=64,
                               moe_router_topk=4, moe_layer_freq=[0, 1, 1, 0, 1, 1], moe_ffn_hidden_size=32)
    assert RoutingSpec.from_config(config) == SPEC


def test_vllm_completion_output():
    rng = np.random.default_rng(0)
    rows = engine_rows(rng, 11)
    routes = from_vllm(SimpleNamespace(routed_experts=rows, token_ids=[1, 2, 3]), SPEC, num_tokens=11)
    assert routes.ids.dtype == np.uint8 and routes.ids.shape == (11, 4, 4)
    assert routes.layer_numbers == (2, 3, 5, 6)
    assert routes.valid.tolist() == [True] * 10 + [False]  # the final sampled token: no route
    np.testing.assert_array_equal(routes.to_int64()[:10], rows[:, [1, 2, 4, 5]])


def test_vllm_capture_gap_leaves_the_whole_token_to_the_live_router():
    rng = np.random.default_rng(9)
    rows = engine_rows(rng, 8)
    rows[5, 2] = 0  # a capture gap on MoE layer 3 only (topk >= 2: zeros cannot be a route)
    routes = from_vllm(rows, SPEC, sample=0)
    assert routes.valid.tolist() == [True] * 5 + [False, True, False]
    assert (routes.to_int64()[5] == -1).all()  # not replayed at layers 2, 5, 6 either
    np.testing.assert_array_equal(routes.to_int64()[[0, 1, 2, 3, 4, 6]], rows[[0, 1, 2, 3, 4, 6]][:, [1, 2, 4, 5]])
    # With top-1 a zero row is expert 0, a route like any other.
    top1 = RoutingSpec(num_layers=6, model_moe_layers=(2, 3, 5, 6), num_experts=64, topk=1)
    rows = engine_rows(rng, 8, top1)
    rows[5, 2] = 0
    assert from_vllm(rows, top1).valid.tolist() == [True] * 7 + [False]


def test_vllm_wrong_token_count_and_missing_output():
    rows = engine_rows(np.random.default_rng(1), 11)
    with pytest.raises(RoutingValidationError, match="sample 5: routed_experts: vLLM routes cover 10 tokens; a sample of 12"):
        from_vllm(rows, SPEC, num_tokens=12, sample=5)
    with pytest.raises(RoutingValidationError, match="enable_return_routed_experts"):
        from_vllm(SimpleNamespace(routed_experts=None), SPEC, sample=0)


def test_vllm_dense_layer_with_routes_is_a_layout_error():
    rows = engine_rows(np.random.default_rng(2), 7)
    rows[4, 3, 0] = 9  # layer 4 is dense in the trainer's model
    with pytest.raises(RoutingValidationError, match="sample 2: routed_experts: token 4, layer 4: dense layer holds routes"):
        from_vllm(rows, SPEC, sample=2)


def test_vllm_layer_count_mismatch():
    rows = engine_rows(np.random.default_rng(3), 7)[:, :5]
    with pytest.raises(RoutingValidationError, match="5 layers, the model has 6 decoder layers"):
        from_vllm(rows, SPEC)


def test_sglang_meta_info():
    rng = np.random.default_rng(4)
    rows = engine_rows(rng, 9)
    meta = {"prompt_tokens": 5, "completion_tokens": 4,
            "routed_experts": base64.b64encode(rows.astype("<i4").tobytes()).decode()}
    routes = from_sglang(meta, SPEC)
    assert routes.num_tokens == 9 and not routes.valid[8].any() and routes.valid[:8].all()
    np.testing.assert_array_equal(routes.to_int64()[:8], rows[:, [1, 2, 4, 5]])
    decoded = from_sglang(rows.reshape(-1), SPEC)  # a payload someone already decoded
    np.testing.assert_array_equal(decoded.to_int64(), routes.to_int64())
    meta["completion_tokens"] = 5
    with pytest.raises(RoutingValidationError, match=r"holds 192 int32 values; this sample needs \[tokens - 1, "
                                                     r"layers, topk\] = \[9, 6, 4\] = 216"):
        from_sglang(meta, SPEC, sample=1)
    with pytest.raises(RoutingValidationError, match="not a whole number"):
        from_sglang(base64.b64encode(b"\0" * 20), SPEC)
    with pytest.raises(RoutingValidationError, match="--enable-return-routed-experts"):
        from_sglang({"prompt_tokens": 3}, SPEC)


def test_raw_arrays_moe_and_full_layouts():
    rng = np.random.default_rng(5)
    full = engine_rows(rng, 6).astype(np.int64)
    full[:, 0] = -1  # dense rows as -1
    full[2] = -1  # no route for token 2
    a = from_array(torch.from_numpy(full), SPEC, layers="full")
    b = from_array(full[:, [1, 2, 4, 5]], SPEC)
    np.testing.assert_array_equal(a.to_int64(), b.to_int64())
    assert a.valid.tolist() == [True, True, False, True, True]
    big = RoutingSpec(num_layers=2, model_moe_layers=(1, 2), num_experts=300, topk=2)
    assert from_array(np.array([[[299, 0], [1, 2]]]), big).ids.dtype == np.int16


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x: x.astype(np.float32), "must be integers"),
        (lambda x: x[:, :3], "3 layers, the model has 4 MoE layers"),
        (lambda x: x[:, :, :3], "top-k 3, the model routes to top-4"),
        (lambda x: _set(x, (4, 2, 1), 64), "sample 7: token 4, layer 5: expert id outside \\[0, 64\\)"),
        (lambda x: _set(x, (1, 3, 0), -3), "sample 7: token 1, layer 6: expert id outside"),
        (lambda x: _set(x, (6, 0, 2), x[6, 0, 0]), "sample 7: token 6, layer 2: repeated expert id"),
    ],
)
def test_validation_names_sample_token_layer(mutate, message):
    rng = np.random.default_rng(6)
    ids = engine_rows(rng, 9)[:, [1, 2, 4, 5]].astype(np.int64)
    with pytest.raises(RoutingValidationError, match=message):
        from_array(mutate(ids), SPEC, sample=7)
    with pytest.raises(RoutingValidationError, match="cover 8 tokens, the sample has 9"):
        from_array(ids, SPEC, num_tokens=9)


def _set(x, index, value):
    x = x.copy()
    x[index] = value
    return x


def test_tokens_without_route_are_not_validated_or_replayed():
    ids = np.array([[[-1, -1]], [[5, 5]], [[1, 2]]])  # token 1 repeats an id but has no route
    spec = RoutingSpec(num_layers=1, model_moe_layers=(1,), num_experts=8, topk=2)
    routes = from_array(ids, spec, valid=np.array([False, False, True]))
    assert routes.to_int64().tolist() == [[[-1, -1]], [[-1, -1]], [[1, 2]]]


def recorded_parts(samples, tp=2, cp=2):
    """What every (TP rank, CP rank, chunk) records when replaying ``samples``: ``[(plan, expert_ids)]``."""
    ids, valid = (torch.from_numpy(a) for a in concat_routes(samples))
    lens = [s.num_tokens for s in samples]
    parts = []
    for tp_rank in range(tp):
        for cp_rank in range(cp):
            for chunk in ((2, 3), (5, 6)):
                rank = RankLayout(tp_size=tp, tp_rank=tp_rank, sequence_parallel=True, cp_size=cp, cp_rank=cp_rank)
                plan = RoutingPlan.build(rank, lens, source_layer_numbers=SPEC.model_moe_layers,
                                         layer_numbers=chunk, qkv_format="thd")
                recorded = gather_routes(ids, valid, torch.from_numpy(plan.token_index),
                                         torch.from_numpy(plan.layer_index))
                parts.append((plan, recorded))
    return parts


def test_megatron_recorded_routes_round_trip():
    rng = np.random.default_rng(8)
    samples = [from_vllm(engine_rows(rng, n), SPEC, sample=i) for i, n in enumerate([7, 12, 3])]
    lens = [s.num_tokens for s in samples]
    back = from_megatron_recorded(recorded_parts(samples), lens, SPEC)
    for a, b in zip(samples, back):
        assert b.valid.tolist() == [True] * (a.num_tokens - 1) + [False]  # recorded nowhere: no route
        np.testing.assert_array_equal(a.to_int64(), b.to_int64())


def test_megatron_recorded_token_missing_some_layers_is_an_error():
    rng = np.random.default_rng(10)
    samples = [from_vllm(engine_rows(rng, n), SPEC, sample=i) for i, n in enumerate([7, 12, 3])]
    lens = [s.num_tokens for s in samples]
    # One router row lost: global token 9 (sample 1, token 2) at layer 5, the first of chunk (5, 6).
    parts = recorded_parts(samples, tp=1, cp=1)
    plan, expert_ids = parts[1]
    assert plan.layer_numbers == (5, 6)
    expert_ids[0, list(plan.token_index).index(9)] = -1
    with pytest.raises(RoutingValidationError, match=r"sample 1: token 2, layer 5: not recorded at this layer but "
                       r"at others \(a part is missing\); a token replays at every MoE layer or at none"):
        from_megatron_recorded(parts, lens, SPEC)
    # A whole part lost: that rank's tokens have layers 2 and 3 but not 5 and 6.
    parts = recorded_parts(samples)
    del parts[3]
    with pytest.raises(RoutingValidationError, match=r"token \d+, layer 5: not recorded at this layer"):
        from_megatron_recorded(parts, lens, SPEC)


def test_container_bytes_and_empty():
    routes = RolloutRoutes.empty(32768, num_experts=256, topk=8, layer_numbers=range(1, 49))
    assert routes.ids.nbytes == 32768 * 48 * 8  # 12.6 MB: one byte per routing entry
    assert routes.valid.shape == (32768,) and not routes.valid.any()
    assert routes.nbytes == routes.ids.nbytes + routes.num_tokens  # plus one validity byte per token
    assert routes.nbytes / routes.ids.size == pytest.approx(1 + 1 / (48 * 8))  # 1.003 bytes per entry
