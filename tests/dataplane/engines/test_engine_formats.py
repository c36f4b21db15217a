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
  sgl-project/sglang 0837e911 for the buffer, @ d4d0fc58 for ``get_routed_experts`` and the
  base64); the request's ``routed_experts_start_len`` (rows cover ``[start_len, T - 1)``, not
  echoed: ``GenerateReqInput`` in python/sglang/srt/managers/io_struct.py @ a6463a10); the
  compact dtype named by ``meta_info["routed_experts_dtype"]`` (int32, uint16, uint8; int32
  when absent: python/sglang/srt/state_capturer/routed_experts_wire.py @ a6463a10, sglang
  #31219); ``/v1/completions`` returns them in the response's ``sglext`` (``routed_experts``,
  ``routed_experts_dtype``), built from the first choice only, and per choice ``token_ids``,
  ``prompt_token_ids`` (``return_token_ids``) and ``logprobs.token_logprobs``
  (python/sglang/srt/entrypoints/openai/protocol.py ``SglExt``, ``CompletionResponse`` and
  serving_completions.py ``_build_completion_response`` @ a6463a10; sglang #17434).
* Megatron inference: ``DynamicInferenceRequest.routing_indices`` int32 ``[T - 1, num_moe_layers,
  topk]`` (megatron/core/inference/inference_request.py, contexts/routing_metadata.py @
  NVIDIA/Megatron-LM core_v0.19.0 = 5be96267), serialised as ``("ndarray", {"data", "dtype"})``;
  ``/v1/completions`` choices carry ``prompt_token_ids``, ``generation_token_ids``,
  ``generation_log_probs``, ``moe_topk_indices`` and ``prompt_moe_topk_indices``
  (text_generation_server/dynamic_text_gen_server/endpoints/completions.py @ core_v0.19.0).
"""

import base64
import json
import re

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
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.engines.engine_samples import megatron_sample, sglang_openai_sample, sglang_sample, vllm_samples
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


def wire_routes(truth, dtype, start_len=0):
    """SGLang's wire payload: base64 of the flat rows from ``start_len`` on, in ``dtype``."""
    rows = truth.engine_rows()[start_len:]
    return base64.b64encode(rows.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def sglang_compact(truth, dtype, start_len=0):
    """A /generate response; the request had ``routed_experts_start_len=start_len`` (not echoed)."""
    response = sglang_response(truth)
    meta = response["meta_info"]
    meta["routed_experts"] = wire_routes(truth, dtype, start_len)
    if dtype != "int32":  # a server without the compact wire format names no dtype
        meta["routed_experts_dtype"] = dtype
    return response


def sglang_openai_response(truth, dtype="int32", start_len=0, echo=False):
    """A /v1/completions response (return_routed_experts, return_token_ids, logprobs=0, n=1)."""
    p, g = len(truth.prompt), len(truth.completion)
    token_logprobs = truth.logprobs[p:].tolist()
    if echo:  # logprob_start_len=0: the prompt's entries first, the first one null
        token_logprobs = [None] + truth.logprobs[1:p].tolist() + token_logprobs
    choice = {"index": 0, "text": "...", "finish_reason": "length", "matched_stop": None,
              "logprobs": {"text_offset": [-1] * len(token_logprobs), "token_logprobs": token_logprobs,
                           "tokens": ["t"] * len(token_logprobs), "top_logprobs": []},
              "token_ids": list(truth.completion), "prompt_token_ids": list(truth.prompt)}
    return {"id": "cmpl-s9", "object": "text_completion", "created": 0, "model": "default", "choices": [choice],
            "usage": {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g},
            "sglext": {"routed_experts": wire_routes(truth, dtype, start_len), "routed_experts_dtype": dtype}}


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
    "sglang-uint8-start-len": lambda t: [sglang_sample(sglang_compact(t, "uint8", start_len=3), t.prompt, SPEC,
                                                       start_len=3)],
    "sglang-openai-int32": lambda t: [sglang_openai_sample(sglang_openai_response(t), None, SPEC)],
    "sglang-openai-uint8-start-len": lambda t: [sglang_openai_sample(sglang_openai_response(t, "uint8", 3), None,
                                                                     SPEC, start_len=3)],
    "megatron-choice": lambda t: [megatron_sample(megatron_choice(t), SPEC)],
    "megatron-serialised": lambda t: [megatron_sample(megatron_choice(t, wrapped=True), SPEC)],
}
FIRST_ROUTED = {"vllm-split-prompt-start": 3, "sglang-uint8-start-len": 3, "sglang-openai-uint8-start-len": 3}


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


def test_full_layer_split_arrays_are_told_by_their_layer_count():
    """A build that keeps every decoder layer in the split layout is read by the length of its layer axis, no flag."""
    truth = make_truth(np.random.default_rng(4), 6, 5)
    request = vllm_split_request(truth, np.int16)
    full = lambda moe: np.insert(np.insert(moe, 0, 0, axis=1), 2, 0, axis=1)  # dense layers 1 and 3 as zero rows
    request.prompt_routed_experts = full(request.prompt_routed_experts)
    request.outputs[0].routed_experts = full(request.outputs[0].routed_experts)
    (sample,) = vllm_samples(request, SPEC)
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], truth.routes)
    request.outputs[0].routed_experts = request.outputs[0].routed_experts[:, :3]
    with pytest.raises(RoutingValidationError, match="routed_experts has 3 layers, the model has 4 decoder layers, 2 "
                                                     "of them MoE: vLLM returns one row per MoE layer"):
        vllm_samples(request, SPEC)


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


def _vllm_rows(mutate):
    def run(truth):
        request = vllm_request([truth])
        request.outputs[0].routed_experts = mutate(request.outputs[0].routed_experts)
        return vllm_samples(request, SPEC)
    return run


def _sglang(dtype="int32", start_len=0, **meta):
    def run(truth):
        response = sglang_compact(truth, dtype)
        response["meta_info"].update(meta)
        return [sglang_sample(response, truth.prompt, SPEC, start_len=start_len)]
    return run


def _openai(mutate=None, rows=None, start_len=0, input_ids=None):
    """A /v1/completions response, changed by ``mutate(response)``, routes ``rows(engine_rows)`` when given."""
    def run(truth):
        response = sglang_openai_response(truth)
        if rows is not None:
            response["sglext"]["routed_experts"] = base64.b64encode(
                rows(truth.engine_rows()).astype("<i4").tobytes()).decode()
        if mutate is not None:
            mutate(response)
        return [sglang_openai_sample(response, input_ids, SPEC, start_len=start_len)]
    return run


def _choice(key, value):
    return lambda response: response["choices"][0].__setitem__(key, value)


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
     rf"request 'r7' sample 0: routed_experts: token 8, layer 2: repeated expert id in one token's row: \[0, 0\].*{REPEATED}"),
    ("vllm split: all-zero routes (FlashInfer monolithic)", _split(_zeroed, _zeroed),
     rf"request 'r7' sample 0: prompt_routed_experts: token 0, layer 2: repeated expert id.*\(20 bad rows in total\); {REPEATED}"),
    ("vllm split: no prompt routes", _split(mutate_prompt=lambda r: None),
     "request 'r7' sample 0: vLLM returned no prompt_routed_experts for a prompt of 6 tokens"),
    ("vllm split: no completion routes", _split(mutate_completion=lambda r: None),
     "request 'r7' sample 0: vLLM returned no routed_experts for this completion"),
    ("vllm split: completion rows short", _split(mutate_completion=lambda r: r[:-1]),
     r"request 'r7' sample 0: vLLM routed_experts covers 3 tokens; it must cover 4 \(every generated token but"),
    ("vllm split: top-k", _split(mutate_completion=lambda r: r[:, :, :1]),
     "request 'r7' sample 0: vLLM routed_experts has top-k 1, the model routes to top-2"),
    ("vllm split: expert out of range", _split(mutate_prompt=lambda r: _with(r, (1, 1, 0), 16)),
     r"request 'r7' sample 0: prompt_routed_experts: token 1, layer 4: expert id outside \[0, 16\)"),
    ("vllm split: float ids", _split(mutate_prompt=lambda r: r.astype(np.float32)),
     "sample 0: prompt_routed_experts: expert ids must be integers, got dtype float32"),
    ("vllm split: prompt start beyond the prompt", _split(prompt_start=7),
     r"sample 0: routed_experts_prompt_start 7 is outside the prompt \[0, 6\]"),
    ("sglang: unknown dtype", _sglang(routed_experts_dtype="int8"),
     r"sample 0: SGLang meta_info\['routed_experts'\]: routed_experts_dtype 'int8' is not one of"),
    ("sglang: dtype that does not fit the payload", _sglang("int32", routed_experts_dtype="uint16"),
     r"holds 80 uint16 values; this sample needs \[tokens - 1, layers, topk\] = \[10, 4, 2\] = 80|"
     r"holds 160 uint16 values"),
    ("sglang: start_len the payload does not have", _sglang(start_len=2),
     r"holds 80 int32 values; this sample needs \[tokens - 1 - start_len, layers, topk\] = \[8, 4, 2\] = 64"),
    ("sglang: negative start_len", _sglang(start_len=-1),
     "routed_experts_start_len = -1 is not a count"),
    ("sglang: start_len beyond the sample", _sglang(start_len=11),
     "routed_experts_start_len 11 is beyond the 10 routed tokens of a 11-token sample"),
    ("sglang: every row zero", _sglang_rows(lambda r: r * 0),
     rf"sample 0: SGLang meta_info\['routed_experts'\]: token 0, layer 2: every SGLang route row is all zeros \(10 tokens\).*{REPEATED}"),
    ("sglang: repeated expert", _sglang_rows(lambda r: _with(r, (4, 1), 5)),
     rf"request 's3' sample 0: SGLang meta_info\['routed_experts'\]: token 4, layer 2: repeated expert id in one token's row: \[5, 5\].*{REPEATED}"),
    ("vllm original: repeated expert", _vllm_rows(lambda r: _with(r, (3, 1), 5)),
     rf"request 'r7' sample 0: routed_experts: token 3, layer 2: repeated expert id in one token's row: \[5, 5\].*{REPEATED}"),
    ("vllm original: every row zero", _vllm_rows(lambda r: r * 0),
     rf"request 'r7' sample 0: routed_experts: token 0, layer 2: every vLLM route row is all zeros.*{REPEATED}"),
    ("sglang openai: no sglext", _openai(lambda r: r.pop("sglext")),
     "request 'cmpl-s9' sample 0: the SGLang /v1/completions response has no sglext object"),
    ("sglang openai: unknown dtype", _openai(lambda r: r["sglext"].__setitem__("routed_experts_dtype", "int8")),
     r"sample 0: SGLang response sglext\['routed_experts'\]: routed_experts_dtype 'int8' is not one of"),
    ("sglang openai: dtype that does not fit the payload",
     _openai(lambda r: r["sglext"].__setitem__("routed_experts_dtype", "uint8")),
     r"sglext\['routed_experts'\] holds 320 uint8 values; this sample needs .* = 80"),
    ("sglang openai: bad base64", _openai(lambda r: r["sglext"].__setitem__("routed_experts", "@@@@")),
     r"sample 0: SGLang response sglext\['routed_experts'\] is not base64 of int32 values"),
    ("sglang openai: start_len the payload does not have", _openai(start_len=2),
     r"holds 80 int32 values; this sample needs \[tokens - 1 - start_len, layers, topk\] = \[8, 4, 2\] = 64"),
    ("sglang openai: payload from a start_len not passed", _openai(rows=lambda r: r[3:]),
     r"holds 56 int32 values; this sample needs \[tokens - 1, layers, topk\] = \[10, 4, 2\] = 80"),
    ("sglang openai: n=2", _openai(lambda r: r["choices"].append(dict(r["choices"][0], index=1))),
     "has 2 choices but sglext holds the routes of the first only"),
    ("sglang openai: no token_ids", _openai(_choice("token_ids", None)),
     r"request 'cmpl-s9' sample 0: the SGLang choice has no token_ids \(request return_token_ids=True\)"),
    ("sglang openai: no prompt ids", _openai(_choice("prompt_token_ids", None)),
     "request 'cmpl-s9' sample 0: the prompt ids are unknown"),
    ("sglang openai: prompt ids that disagree", _openai(input_ids=[1, 2, 3]),
     r"input_ids \(3 tokens\) are not the choice's prompt_token_ids \(6 tokens\)"),
    ("sglang openai: no log-probs", _openai(_choice("logprobs", None)),
     "request 'cmpl-s9' sample 0: the SGLang choice has no logprobs.token_logprobs"),
    ("sglang openai: log-probs short", _openai(lambda r: r["choices"][0]["logprobs"]["token_logprobs"].pop()),
     r"logprobs.token_logprobs has 4 entries for 5 completion tokens \(11 with echo\)"),
    ("sglang openai: repeated expert", _openai(rows=lambda r: _with(r, (7, 3), 9)),
     rf"request 'cmpl-s9' sample 0: SGLang response sglext\['routed_experts'\]: token 7, layer 4: repeated expert id in one token's row: \[9, 9\].*{REPEATED}"),
    ("sglang openai: every row zero", _openai(rows=lambda r: r * 0),
     rf"request 'cmpl-s9' sample 0: SGLang response sglext\['routed_experts'\]: token 0, layer 2: every SGLang route row is all zeros.*{REPEATED}"),
    ("megatron: zero-filled row", _megatron(moe_topk_indices=_megatron_rows(5, 0), prompt_moe_topk_indices=None),
     rf"request 'm1' sample 0: moe_topk_indices: token 5, layer 2: repeated expert id in one token's row: \[0, 0\].*{REPEATED}"),
    ("megatron: rows for every token", _megatron(moe_topk_indices=lambda r: r + r[-1:], prompt_moe_topk_indices=None),
     "request 'm1' sample 0: moe_topk_indices: Megatron routes cover 11 tokens; a sample of 11 tokens must have 10"),
    ("megatron: full layer axis", _megatron(moe_topk_indices=lambda r: [[row[0]] + row for row in r],
                                            prompt_moe_topk_indices=None),
     r"moe_topk_indices has 3 layers, the model has 4 decoder layers, 2 of them MoE: Megatron returns one row per "
     r"MoE layer \(2\)"),
    ("megatron: prompt rows that disagree", _megatron(prompt_moe_topk_indices=lambda r: r[1:] + r[:1]),
     "prompt_moe_topk_indices .* is not the first 6 rows of moe_topk_indices"),
    ("megatron: no routes", _megatron(moe_topk_indices=None, routing_indices=None),
     "request 'm1' sample 0: Megatron returned no routing_indices / moe_topk_indices"),
    ("megatron: no log-probs", _megatron(generation_log_probs=None),
     "request 'm1' sample 0: Megatron returned no generation_log_probs"),
    ("megatron: no prompt tokens", _megatron(prompt_token_ids=None),
     "request 'm1' sample 0: Megatron returned no prompt tokens"),
    ("megatron: bad base64", _megatron(moe_topk_indices={"dtype": "int32", "shape": [10, 2, 2], "base64": "@@"}),
     r"sample 0: moe_topk_indices must be an integer array.*\(Error: "),
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


def test_sglang_openai_response_reads_sglext_and_echoed_logprobs():
    truth = make_truth(np.random.default_rng(5), 6, 5)
    response = sglang_openai_response(truth, "uint16", start_len=2, echo=True)
    routes = from_sglang_openai(response, SPEC, num_tokens=11, sample=0, start_len=2)
    np.testing.assert_array_equal(routes.to_int64()[2:-1], truth.routes[2:])
    assert routes.valid.tolist() == [False] * 2 + [True] * 8 + [False]
    sample = sglang_openai_sample(response, truth.prompt, SPEC, start_len=2, reward=1.0)
    np.testing.assert_allclose(sample.logprobs, truth.logprobs)  # echo: the prompt's log-probs too
    assert sample.meta == {"engine": "sglang", "request_id": "cmpl-s9", "completion_index": 0,
                           "finish_reason": "length", "reward": 1.0}
    without_echo = sglang_openai_sample(sglang_openai_response(truth), None, SPEC)
    assert (without_echo.logprobs[:6] == 0).all()
    np.testing.assert_allclose(without_echo.logprobs[6:], truth.logprobs[6:])


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
    with pytest.raises(RoutingValidationError, match="sample 2: moe_topk_indices: Megatron routes cover 9 tokens"):
        from_megatron_inference(truth.routes[:-1], SPEC, num_tokens=11, sample=2)


def megatron_request(truth):
    """A finished DynamicInferenceRequest as serialised: routing_indices as ("ndarray", {"data", "dtype"})."""
    p = len(truth.prompt)
    return {"request_id": "m2", "prompt_tokens": truth.prompt, "generated_tokens": truth.completion,
            "generated_log_probs": truth.logprobs[p:].tolist(),
            "routing_indices": ["ndarray", {"data": truth.routes.astype(np.int32).tolist(), "dtype": "int32"}]}


def vllm_split_line(truth, dtype, prompt_start=0):
    record = request_output_to_json(vllm_split_request(truth, dtype, prompt_start=prompt_start))
    record["routed_experts_prompt_start"] = prompt_start
    return record


# Every format a line of the dump tool takes: (engine, line from the truth, first routed token, request id).
DUMP_LINES = {
    "vllm original int32": ("vllm", lambda t: request_output_to_json(vllm_request([t])), 0, "'r7'"),
    "vllm split int16": ("vllm", lambda t: vllm_split_line(t, np.int16), 0, "'r7'"),
    "vllm split uint8 prompt start": ("vllm", lambda t: vllm_split_line(t, np.uint8, prompt_start=3), 3, "'r7'"),
    "sglang meta_info int32": ("sglang", lambda t: {"input_ids": t.prompt, "response": sglang_compact(t, "int32")},
                               0, "'s3'"),
    "sglang meta_info uint16": ("sglang", lambda t: {"input_ids": t.prompt, "response": sglang_compact(t, "uint16")},
                                0, "'s3'"),
    "sglang meta_info uint8 start_len": ("sglang", lambda t: {"input_ids": t.prompt, "routed_experts_start_len": 3,
                                                              "response": sglang_compact(t, "uint8", start_len=3)},
                                         3, "'s3'"),
    "sglang openai int32": ("sglang", lambda t: {"response": sglang_openai_response(t)}, 0, "'cmpl-s9'"),
    "sglang openai uint8 start_len": ("sglang", lambda t: {"routed_experts_start_len": 2,
                                                           "response": sglang_openai_response(t, "uint8", 2)},
                                      2, "'cmpl-s9'"),
    "megatron moe_topk_indices": ("megatron", lambda t: {"response": {"id": "cmpl-1", "choices": [megatron_choice(t)]},
                                                         "reward": [1.0]}, 0, "'cmpl-1'"),
    "megatron serialised moe_topk_indices": ("megatron", lambda t: {"response": megatron_choice(t, wrapped=True)},
                                             0, "None"),
    "megatron routing_indices": ("megatron", lambda t: {"response": megatron_request(t)}, 0, "'m2'"),
}


@pytest.mark.parametrize("name", sorted(DUMP_LINES))
def test_dump_tool_takes_every_format(name, tmp_path):
    engine, line, first, _ = DUMP_LINES[name]
    truth = make_truth(np.random.default_rng(7), 6, 5)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.r3dump"
    source.write_text(json.dumps(line(truth)) + "\n")
    assert main(["--engine", engine, "--input", str(source), "--out", str(out), *MODEL_FLAGS,
                 "--log-interval", "0"]) == 0
    with RolloutDumpReader(out) as reader:
        (sample,) = list(reader)
    np.testing.assert_array_equal(sample.token_ids, truth.tokens)
    np.testing.assert_allclose(sample.logprobs[6:], truth.logprobs[6:])
    assert sample.routes.valid.tolist() == [False] * first + [True] * (10 - first) + [False]
    np.testing.assert_array_equal(sample.routes.to_int64()[first:-1], truth.routes[first:])
    assert sample.meta["engine"] == engine


@pytest.mark.parametrize("name", sorted(DUMP_LINES))
def test_dump_tool_refuses_a_repeated_expert_in_every_format(name, tmp_path, capsys):
    """Token 7, MoE layer 4 routes to [5, 5]: every format names line, request, sample, token, layer and cause."""
    engine, line, _, request = DUMP_LINES[name]
    truth = make_truth(np.random.default_rng(8), 6, 5)
    truth.routes[7, 1] = 5
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(line(truth)) + "\n")
    assert main(["--engine", engine, "--input", str(source), "--out", str(tmp_path / "o.r3dump"),
                 *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"dump_rollouts: error: {re.escape(str(source))} line 1: request {re.escape(request)} sample 0: "
                     rf"[^:]*routed_experts[^:]*: token 7, layer 4: repeated expert id in one token's row: \[5, 5\]|"
                     rf"dump_rollouts: error: {re.escape(str(source))} line 1: request {re.escape(request)} sample 0: "
                     rf"moe_topk_indices: token 7, layer 4: repeated expert id in one token's row: \[5, 5\]", err), err
    assert "FlashInfer's monolithic MoE returned all-zero routes, vllm #54730" in err
    assert not (tmp_path / "o.r3dump").exists()


BAD_LINES = [
    ("split prompt part not base64", "vllm split int16",
     lambda r: r["prompt_routed_experts"].__setitem__("base64", "@@"),
     r"line 1: prompt_routed_experts must be an integer array, nested lists, base64 of a \.npy array, "
     r"\{\"dtype\", \"shape\", \"base64\"\} or \{\"data\", \"dtype\"\} \(Error: "),
    ("split prompt part of float dtype", "vllm split int16",
     lambda r: r.__setitem__("prompt_routed_experts", {"dtype": "float32", "shape": [6, 2, 2],
                                                       "base64": base64.b64encode(bytes(96)).decode()}),
     "line 1: prompt_routed_experts: expert ids must be integers, got dtype float32"),
    ("openai start_len a string", "sglang openai uint8 start_len",
     lambda r: r.__setitem__("routed_experts_start_len", "2"),
     "line 1: SGLang line: 'routed_experts_start_len' must be an integer, got a string"),
    ("openai start_len left out", "sglang openai uint8 start_len", lambda r: r.pop("routed_experts_start_len"),
     r"line 1: request 'cmpl-s9' sample 0: SGLang response sglext\['routed_experts'\] holds 64 uint8 values; this "
     r"sample needs \[tokens - 1, layers, topk\] = \[10, 4, 2\] = 80"),
    ("openai wrong dtype name", "sglang openai int32",
     lambda r: r["response"]["sglext"].__setitem__("routed_experts_dtype", "int64"),
     r"line 1: request 'cmpl-s9' sample 0: SGLang response sglext\['routed_experts'\]: routed_experts_dtype "
     r"'int64' is not one of \['int32', 'uint16', 'uint8'\]"),
]


@pytest.mark.parametrize("name, mutate, message", [b[1:] for b in BAD_LINES], ids=[b[0] for b in BAD_LINES])
def test_dump_tool_names_a_malformed_line(name, mutate, message, tmp_path, capsys):
    record = DUMP_LINES[name][1](make_truth(np.random.default_rng(9), 6, 5))
    mutate(record)
    source, out = tmp_path / "in.jsonl", tmp_path / "o.r3dump"
    source.write_text(json.dumps(record) + "\n")
    assert main(["--engine", DUMP_LINES[name][0], "--input", str(source), "--out", str(out), *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dump_rollouts: error: {source} ")
    assert re.search(message, err), err
    assert not out.exists()
