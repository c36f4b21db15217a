"""Every engine's route format, from a fixture written to that engine's source, into a dump and the replay input.

Fixtures, each written from the engine's source at the named commit (read, not copied):

* vLLM, original layout: ``CompletionOutput.routed_experts`` int32 ``[T - 1, num_hidden_layers, topk]``,
  dense layers zero (vllm/outputs.py @ vllm-project/vllm 003d3ee2; the int32 ``[tokens,
  num_hidden_layers, num_experts_per_tok]`` buffer in
  vllm/model_executor/layers/fused_moe/routed_experts_capturer.py @ 00bd1493).
* vLLM, split layout: ``RequestOutput.prompt_routed_experts`` ``[P - routed_experts_prompt_start,
  moe_layers, topk]`` and per completion ``routed_experts`` ``[G - 1, moe_layers, topk]``, int16 or
  uint8 (``AuxOutputConfig.enable_return_routed_experts``, vllm/config/aux_output.py @ 09155aec;
  rows emitted up to ``num_tokens - 1`` from ``max(routed_experts_prompt_start, ...)``,
  vllm/distributed/aux_output_connector/connector.py @ 09155aec; the dtype is the capturer's
  ``output_dtype_name``, aux_output_connector/worker.py @ 0a0b7380).
* SGLang: ``meta_info["routed_experts"]`` base64 of flat int32 ``[T - 1, num_hidden_layers,
  num_experts_per_tok]`` (python/sglang/srt/layers/moe/routed_experts_capturer.py @
  sgl-project/sglang 0837e911); ``routed_experts_start_len`` (rows cover ``[start_len, T - 1)``,
  GenerateReqInput in io_struct.py); the compact dtype named by ``routed_experts_dtype`` (int32,
  uint16, uint8: sglang #31219, open); the OpenAI endpoints' choice ``sgl_ext`` (sglang #17434).
* Megatron inference: ``DynamicInferenceRequest.routing_indices`` int32 ``[T - 1, num_moe_layers,
  topk]`` (megatron/core/inference/inference_request.py, contexts/routing_metadata.py @
  NVIDIA/Megatron-LM core_v0.19.0 = 5be96267), serialised as ``("ndarray", {"data", "dtype"})``;
  ``/v1/completions`` choices carry ``prompt_token_ids``, ``generation_token_ids``,
  ``generation_log_probs``, ``moe_topk_indices`` and ``prompt_moe_topk_indices``
  (text_generation_server/dynamic_text_gen_server/endpoints/completions.py @ core_v0.19.0).
"""

import base64
import json

import numpy as np
import pytest
import torch

from megatron_r3.dataplane.device.packing import gather_routes
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.engines.adapters import (
    from_megatron_inference,
    from_sglang,
    from_sglang_openai,
    from_vllm_split,
)
from megatron_r3.dataplane.engines.engine_samples import megatron_sample, sglang_sample, vllm_samples
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.routes import concat_routes
from tests.dataplane.test_dump_rollouts import (
    MODEL_FLAGS, SPEC, RequestOutput, make_truth, round_trip, sglang_response, vllm_request,
)
from tools.dump_rollouts import main, request_output_to_json


class SplitRequestOutput(RequestOutput):
    """vLLM's RequestOutput with the split layout's request-level field."""

    def __init__(self, *args, prompt_routed_experts=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_routed_experts = prompt_routed_experts


def vllm_split_request(truth, dtype, prompt_start=0, final_row=False):
    base = vllm_request([truth])
    p = len(truth.prompt)
    completion = truth.routes[p:].astype(dtype)  # G - 1 rows, MoE layers only
    if final_row:  # a build that also returns the never-run final token's row
        completion = np.concatenate([completion, completion[-1:]])
    base.outputs[0].routed_experts = completion
    return SplitRequestOutput(base.request_id, base.prompt, base.prompt_token_ids, base.prompt_logprobs,
                              base.outputs, prompt_routed_experts=truth.routes[prompt_start:p].astype(dtype))


def sglang_compact(truth, dtype, start_len=0):
    response = sglang_response(truth)
    rows = truth.engine_rows()[start_len:]
    meta = response["meta_info"]
    meta["routed_experts"] = base64.b64encode(rows.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode()
    if dtype != "int32":
        meta["routed_experts_dtype"] = dtype
    if start_len:
        meta["routed_experts_start_len"] = start_len
    return response


def megatron_choice(truth, wrapped=False):
    p = len(truth.prompt)
    routing = truth.routes.astype(np.int32)  # one row per MoE layer (RouterReplay instance)
    as_json = {"data": routing.tolist(), "dtype": "int32"}
    return {
        "index": 0, "prompt_token_ids": truth.prompt, "generation_token_ids": truth.completion,
        "generation_log_probs": truth.logprobs[p:].tolist(), "finish_reason": "length",
        "moe_topk_indices": ["ndarray", as_json] if wrapped else routing.tolist(),
        # core_v0.19.0 slices the serialised pair, so the prompt field repeats it whole
        "prompt_moe_topk_indices": ["ndarray", as_json] if wrapped else routing[:p].tolist(),
    }


def replay_input(samples):
    """What the trainer's routers replay for ``samples`` (one rank, all MoE layers): [L, tokens, topk]."""
    ids, valid = (torch.from_numpy(a) for a in concat_routes([s.routes for s in samples]))
    plan = RoutingPlan.build(RankLayout(), [s.routes.num_tokens for s in samples],
                             source_layer_numbers=SPEC.model_moe_layers, layer_numbers=SPEC.model_moe_layers,
                             qkv_format="thd")
    return gather_routes(ids, valid, torch.from_numpy(plan.token_index), torch.from_numpy(plan.layer_index))


FORMATS = {
    "vllm-original-int32": lambda t: vllm_samples(vllm_request([t]), SPEC),
    "vllm-split-int16": lambda t: vllm_samples(vllm_split_request(t, np.int16), SPEC),
    "vllm-split-uint8": lambda t: vllm_samples(vllm_split_request(t, np.uint8), SPEC),
    "vllm-split-uint8-final-row": lambda t: vllm_samples(vllm_split_request(t, np.uint8, final_row=True), SPEC),
    "vllm-split-prompt-start": lambda t: vllm_samples(vllm_split_request(t, np.int16, prompt_start=3), SPEC,
                                                      prompt_start=3),
    "sglang-int32": lambda t: [sglang_sample(sglang_compact(t, "int32"), t.prompt, SPEC)],
    "sglang-uint16": lambda t: [sglang_sample(sglang_compact(t, "uint16"), t.prompt, SPEC)],
    "sglang-uint8-start-len": lambda t: [sglang_sample(sglang_compact(t, "uint8", start_len=3), t.prompt, SPEC)],
    "megatron-choice": lambda t: [megatron_sample(megatron_choice(t), SPEC)],
    "megatron-serialised": lambda t: [megatron_sample(megatron_choice(t, wrapped=True), SPEC)],
}
FIRST_ROUTED = {"vllm-split-prompt-start": 3, "sglang-uint8-start-len": 3}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_round_trips_into_a_dump_and_the_replay_input(name, tmp_path):
    truth = make_truth(np.random.default_rng(len(name)), 6, 5)
    (sample,) = round_trip(FORMATS[name](truth), tmp_path)
    first = FIRST_ROUTED.get(name, 0)
    t = len(truth.tokens)
    np.testing.assert_array_equal(sample.token_ids, truth.tokens)
    assert sample.loss_mask.tolist() == [False] * 6 + [True] * 5
    assert sample.routes.valid.tolist() == [False] * first + [True] * (t - 1 - first) + [False]
    ids = sample.routes.to_int64()
    np.testing.assert_array_equal(ids[first:-1], truth.routes[first:])
    assert (ids[:first] == -1).all() and (ids[-1] == -1).all()  # no route: the live router decides
    replayed = replay_input([sample])  # [MoE layers, tokens, topk], -1 where nothing is replayed
    np.testing.assert_array_equal(replayed.permute(1, 0, 2).numpy(), ids)


def test_the_vllm_layout_is_told_by_the_field_not_the_shape():
    """An all-MoE model: both layouts have as many layer rows; only the field says which it is."""
    spec = type(SPEC)(num_layers=2, model_moe_layers=(1, 2), num_experts=16, topk=2)
    rows = np.tile(np.array([[[1, 2], [3, 4]]], np.int16), (6, 1, 1))
    split = from_vllm_split(rows[:3], rows[3:5], spec, prompt_len=3, completion_len=3, sample=0)
    assert split.valid.tolist() == [True] * 5 + [False]
    request = vllm_split_request(make_truth(np.random.default_rng(3), 6, 5), np.int16)
    request.prompt_routed_experts = request.prompt_routed_experts[:4]  # a short prompt part is not re-read as old
    with pytest.raises(RoutingValidationError, match="request 'r7' sample 0: vLLM prompt_routed_experts covers 4 "
                                                     "tokens; it must cover 6"):
        vllm_samples(request, SPEC)


def test_full_layer_split_arrays_need_layers_full():
    truth = make_truth(np.random.default_rng(4), 6, 5)
    request = vllm_split_request(truth, np.int16)
    full = lambda moe: np.insert(np.insert(moe, 0, 0, axis=1), 2, 0, axis=1)  # dense layers 1 and 3 as zero rows
    request.prompt_routed_experts = full(request.prompt_routed_experts)
    request.outputs[0].routed_experts = full(request.outputs[0].routed_experts)
    with pytest.raises(RoutingValidationError, match="4 layers, the model has 2 MoE layers .*layers='full'"):
        vllm_samples(request, SPEC)
    (sample,) = vllm_samples(request, SPEC, route_layers="full")
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], truth.routes)


def _split(mutate_prompt=None, mutate_completion=None, **kwargs):
    def run(truth):
        request = vllm_split_request(truth, np.int16)
        if mutate_prompt:
            request.prompt_routed_experts = mutate_prompt(request.prompt_routed_experts)
        if mutate_completion:
            request.outputs[0].routed_experts = mutate_completion(request.outputs[0].routed_experts)
        return vllm_samples(request, SPEC, **kwargs)
    return run


def _zeroed(rows, token=None):
    rows = rows.copy()
    rows[slice(None) if token is None else token] = 0
    return rows


def _sglang(dtype="int32", **meta):
    def run(truth):
        response = sglang_compact(truth, dtype)
        response["meta_info"].update(meta)
        return [sglang_sample(response, truth.prompt, SPEC)]
    return run


def _sglang_rows(mutate):
    def run(truth):
        response = sglang_compact(truth, "int32")
        rows = mutate(truth.engine_rows())
        response["meta_info"]["routed_experts"] = base64.b64encode(rows.astype("<i4").tobytes()).decode()
        return [sglang_sample(response, truth.prompt, SPEC)]
    return run


def _megatron(**change):
    def run(truth):
        choice = {**megatron_choice(truth), "request_id": "m1"}
        for key, value in change.items():
            choice[key] = value(choice[key]) if callable(value) else value
        return [megatron_sample(choice, SPEC)]
    return run


def _megatron_rows(row, value):
    def change(routes):
        routes = np.array(routes)
        routes[row] = value
        return routes.tolist()
    return change


REPEATED = "a top-k never repeats an expert.*FlashInfer's monolithic MoE.*vllm #54730"
MALFORMED = [
    ("vllm split: zero-filled completion row", _split(mutate_completion=lambda r: _zeroed(r, 2)),
     rf"request 'r7' sample 0: token 8, layer 2: repeated expert id in one token's row: \[0, 0\].*{REPEATED}"),
    ("vllm split: all-zero routes (FlashInfer monolithic)", _split(_zeroed, _zeroed),
     rf"request 'r7' sample 0: token 0, layer 2: repeated expert id.*\(20 bad rows in total\); {REPEATED}"),
    ("vllm split: no prompt routes", _split(mutate_prompt=lambda r: None),
     "request 'r7' sample 0: vLLM returned no prompt_routed_experts for a prompt of 6 tokens"),
    ("vllm split: no completion routes", _split(mutate_completion=lambda r: None),
     "request 'r7' sample 0: vLLM returned no routed_experts for this completion"),
    ("vllm split: completion rows short", _split(mutate_completion=lambda r: r[:-1]),
     r"request 'r7' sample 0: vLLM routed_experts covers 3 tokens; it must cover 4 \(every generated token but"),
    ("vllm split: top-k", _split(mutate_completion=lambda r: r[:, :, :1]),
     "request 'r7' sample 0: vLLM routed_experts has top-k 1, the model routes to top-2"),
    ("vllm split: expert out of range", _split(mutate_prompt=lambda r: _with(r, (1, 1, 0), 16)),
     r"request 'r7' sample 0: token 1, layer 4: expert id outside \[0, 16\)"),
    ("vllm split: float ids", _split(mutate_prompt=lambda r: r.astype(np.float32)),
     "sample 0: expert ids must be integers, got dtype float32"),
    ("vllm split: prompt start beyond the prompt", _split(prompt_start=7),
     r"sample 0: routed_experts_prompt_start 7 is outside the prompt \[0, 6\]"),
    ("sglang: unknown dtype", _sglang(routed_experts_dtype="int8"),
     r"sample 0: SGLang meta_info\['routed_experts'\]: routed_experts_dtype 'int8' is not one of"),
    ("sglang: dtype that does not fit the payload", _sglang("int32", routed_experts_dtype="uint16"),
     r"holds 80 uint16 values; this sample needs \[tokens - 1, layers, topk\] = \[10, 4, 2\] = 80|"
     r"holds 160 uint16 values"),
    ("sglang: start_len the payload does not have", _sglang(routed_experts_start_len=2),
     r"holds 80 int32 values; this sample needs \[tokens - 1 - start_len, layers, topk\] = \[8, 4, 2\] = 64"),
    ("sglang: negative start_len", _sglang(routed_experts_start_len=-1),
     "routed_experts_start_len = -1 is not a count"),
    ("sglang: every row zero", _sglang_rows(lambda r: r * 0),
     rf"sample 0: token 0, layer 2: every SGLang route row is all zeros \(10 tokens\).*{REPEATED}"),
    ("sglang: repeated expert", _sglang_rows(lambda r: _with(r, (4, 1), 5)),
     rf"request 's3' sample 0: token 4, layer 2: repeated expert id in one token's row: \[5, 5\].*{REPEATED}"),
    ("megatron: zero-filled row", _megatron(moe_topk_indices=_megatron_rows(5, 0), prompt_moe_topk_indices=None),
     rf"request 'm1' sample 0: token 5, layer 2: repeated expert id in one token's row: \[0, 0\].*{REPEATED}"),
    ("megatron: rows for every token", _megatron(moe_topk_indices=lambda r: r + r[-1:], prompt_moe_topk_indices=None),
     "request 'm1' sample 0: Megatron routes cover 11 tokens; a sample of 11 tokens must have 10"),
    ("megatron: full layer axis", _megatron(moe_topk_indices=lambda r: [[row[0]] + row for row in r]),
     r"Megatron routes have shape \(10, 3, 2\); the model needs \[tokens - 1, MoE layers, topk\] = \[10, 2, 2\]"),
    ("megatron: prompt rows that disagree", _megatron(prompt_moe_topk_indices=lambda r: r[1:] + r[:1]),
     "prompt_moe_topk_indices .* is not the first 6 rows of moe_topk_indices"),
    ("megatron: no routes", _megatron(moe_topk_indices=None, routing_indices=None),
     "request 'm1' sample 0: Megatron returned no routing_indices / moe_topk_indices"),
    ("megatron: no log-probs", _megatron(generation_log_probs=None),
     "request 'm1' sample 0: Megatron returned no generation_log_probs"),
    ("megatron: serialised with a bad dtype", _megatron(moe_topk_indices=["ndarray", {"data": [[1]], "dtype": "q1"}]),
     "sample 0: moe_topk_indices must be an integer array"),
]


def _with(x, index, value):
    x = np.array(x).copy()
    x[index] = value
    return x


@pytest.mark.parametrize("build, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_variants_are_refused_by_name(build, message):
    truth = make_truth(np.random.default_rng(11), 6, 5)
    with pytest.raises(RoutingValidationError, match=message):
        build(truth)


def test_sglang_openai_choice_reads_sgl_ext():
    truth = make_truth(np.random.default_rng(5), 6, 5)
    meta = sglang_compact(truth, "uint8", start_len=2)["meta_info"]
    choice = {"index": 0, "sgl_ext": {k: meta[k] for k in
                                      ("routed_experts", "routed_experts_dtype", "routed_experts_start_len")}}
    routes = from_sglang_openai(choice, SPEC, num_tokens=11, sample=0)
    np.testing.assert_array_equal(routes.to_int64()[2:-1], truth.routes[2:])
    assert routes.valid.tolist() == [False] * 2 + [True] * 8 + [False]
    with pytest.raises(RoutingValidationError, match="has no sgl_ext object"):
        from_sglang_openai({"index": 0}, SPEC, num_tokens=11, sample=0)
    with pytest.raises(RoutingValidationError, match="SGLang choice sgl_ext has no routed_experts"):
        from_sglang_openai({"sgl_ext": {}}, SPEC, num_tokens=11, sample=0)
    # The request's start_len when the response does not echo it.
    del choice["sgl_ext"]["routed_experts_start_len"]
    assert from_sglang_openai(choice, SPEC, num_tokens=11, start_len=2).valid.sum() == 8


def test_megatron_in_process_request():
    """A finished DynamicInferenceRequest: tensors for tokens, an int32 ndarray for routing_indices."""
    truth = make_truth(np.random.default_rng(6), 6, 5)

    class Request:
        request_id = 4
        prompt_tokens = torch.tensor(truth.prompt)
        generated_tokens = list(truth.completion)
        generated_log_probs = truth.logprobs[6:].tolist()
        prompt_log_probs = truth.logprobs[1:6].tolist()  # one per prompt token but the first
        routing_indices = truth.routes.astype(np.int32)

    sample = megatron_sample(Request(), SPEC, reward=0.5)
    np.testing.assert_allclose(sample.logprobs, truth.logprobs)
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], truth.routes)
    assert sample.meta == {"engine": "megatron", "request_id": 4, "completion_index": 0, "finish_reason": None,
                           "reward": 0.5}
    with pytest.raises(RoutingValidationError, match="sample 2: Megatron routes cover 9 tokens"):
        from_megatron_inference(truth.routes[:-1], SPEC, num_tokens=11, sample=2)


def test_dump_tool_takes_every_engine(tmp_path):
    truth = make_truth(np.random.default_rng(7), 6, 5)
    lines = {
        "vllm": [request_output_to_json(vllm_request([truth])),
                 request_output_to_json(vllm_split_request(truth, np.uint8))],
        "sglang": [{"input_ids": truth.prompt, "response": sglang_compact(truth, "uint16")},
                   {"input_ids": truth.prompt, "response": sglang_compact(truth, "uint8", start_len=3)}],
        "megatron": [{"response": {"id": "cmpl-1", "choices": [megatron_choice(truth)]}, "reward": [1.0]},
                     {"response": megatron_choice(truth, wrapped=True), "reward": 0.0}],
    }
    assert "prompt_routed_experts" in lines["vllm"][1] and "prompt_routed_experts" not in lines["vllm"][0]
    for engine, records in lines.items():
        source, out = tmp_path / f"{engine}.jsonl", tmp_path / f"{engine}.r3dump"
        source.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert main(["--engine", engine, "--input", str(source), "--out", str(out), *MODEL_FLAGS,
                     "--log-interval", "0"]) == 0
        from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
        with RolloutDumpReader(out) as reader:
            samples = list(reader)
        assert len(samples) == 2
        for sample in samples:
            np.testing.assert_array_equal(sample.token_ids, truth.tokens)
            routed = sample.routes.valid
            np.testing.assert_array_equal(sample.routes.to_int64()[routed], truth.routes[routed[:-1]])
        assert samples[0].meta["engine"] == engine
    assert samples[0].meta["request_id"] == "cmpl-1" and samples[0].meta["reward"] == 1.0


def test_dump_tool_names_a_bad_split_line(tmp_path, capsys):
    truth = make_truth(np.random.default_rng(8), 6, 5)
    record = request_output_to_json(vllm_split_request(truth, np.int16))
    record["outputs"][0]["routed_experts"] = {"dtype": "int16", "shape": [4, 2, 2],
                                              "base64": base64.b64encode(bytes(32)).decode()}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(record) + "\n")
    assert main(["--engine", "vllm", "--input", str(source), "--out", str(tmp_path / "o.r3dump"),
                 *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert f"dump_rollouts: error: {source} line 1: request 'r7' sample 0: token 6, layer 2: repeated expert id" in err
    assert "vllm #54730" in err
    assert not (tmp_path / "o.r3dump").exists()
