"""The route formats of the engines of November 2026, from fixtures written to each engine's source.

What was read, and where (the stores hold snapshots of the engines' repositories, not their
release tags: no tag v0.33.0 of vLLM or v0.5.23 of SGLang could be resolved, so each reading
names the newest commit of each file the store holds, and what was not found there):

* vLLM 0.33 (``enable_return_routed_experts``, Model Runner V2):

  - ``CompletionResponseChoice.routed_experts`` in vllm/entrypoints/openai/completion/protocol.py
    @ vllm-project/vllm 002032ee: a base64 string of ``.npy`` bytes (``np.load(io.BytesIO(
    base64.b64decode(s)))``), shape ``(num_tokens - 1, num_layers, num_experts_per_tok)``, dtype
    ``uint8/uint16/int32``; the request's ``routed_experts_prompt_start`` ("skip the first N prompt
    tokens from returned routed-expert data"), passed to ``SamplingParams`` and not echoed; no
    ``prompt_routed_experts`` anywhere in the response.
  - the layer axis is ``hf_text_config.num_hidden_layers``, zero-initialised and written only by
    the MoE layers' routers (``RoutedExpertsCapturer.init_buffer`` / ``capture`` in
    vllm/model_executor/layers/fused_moe/routed_experts_capturer.py @ 42fa4c09; Model Runner V2
    binds every ``FusedMoE`` router to it by its ``layer_id``: vllm/v1/worker/gpu/routed_experts_utils.py
    @ 291e76df), so a dense layer is a row of zeros and an MTP layer (``layer_id >=
    num_hidden_layers``) is never captured.
  - the rule that picks the dtype, ``get_routed_experts_dtype_name`` (uint8 up to 256 experts,
    uint16 up to 65536, else int32), is stored only in a fork's snapshot of the capturer
    (aoshen02/vllm 4526213c, routed_experts_capturer.py, which also refuses MoE kernels that cannot
    capture at start-up); it agrees with the issue and the protocol comment's dtype list.

* SGLang 0.5.23: ``meta_info["routed_experts"]`` base64 of int32 over ``[seq_len - 1 -
  routed_experts_start_len, num_hidden_layers, topk]`` (python/sglang/srt/state_capturer/base.py
  ``get_topk`` @ sgl-project/sglang bec3dbc9; routed_experts.py ``extract_routed_experts_from_meta_info``
  and the DeepEP all-gather at capture @ 30dbb063); the buffers are zero-initialised and written per
  MoE layer, so dense layers are zero rows. sglang #36404 (merged 2026-08, issue store) masks the
  rows past ``num_token_non_padded`` to -1 at the capture site ("gives replay -1 on both" CUDA and
  ROCm): such a token's MoE rows are -1, its dense rows zero. The compact dtype (#31219) is in no
  release: int32 only.

* TensorRT-LLM (#18397, merged 2026-08; RFC #17778; issue store): ``CompletionOutput.routed_experts``,
  backed by ``additional_generation_outputs["routed_experts"]``, ``(seq_len - 1, num_moe_layers,
  top_k)``, pre-EPLB logical ids; ``LlmArgs.enable_return_routed_experts`` and
  ``SamplingParams.return_routed_experts``. Its ``RouteCapture`` module (code store, text id
  68348127803; the store names no repository path or commit for it) assembles int16 rows, one per
  MoE layer in layer order, ``-1`` for a missing position ("fail-closed"), keeps a position's first
  route (write-once), and refuses pipeline parallelism and speculative decoding/MTP at start-up.

Every earlier format keeps reading (tests/dataplane/engines/test_engine_formats.py); the layout is
told by the content: vLLM's split layout by its ``prompt_routed_experts`` field, vLLM 0.33 from vLLM
before 0.21 by the dtype (uint8/uint16 against int32), a layer axis over every hidden layer from one
over the MoE layers by its length.
"""

import base64
import io
import json
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest
import torch

from megatron_r3.dataplane.engines.adapters import from_sglang, from_trtllm, from_vllm, route_array
from megatron_r3.dataplane.engines.engine_samples import (
    sglang_sample,
    trtllm_samples,
    vllm_openai_samples,
    vllm_samples,
)
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.samples import RoutingSpec
from tests.dataplane.engines.test_engine_formats import DUMP_LINES as EARLIER_DUMP_LINES, replay_input
from tests.dataplane.test_dump_rollouts import (
    MODEL_FLAGS, SPEC, CompletionOutput, make_truth, round_trip, sglang_response, vllm_request,
)
from tools.dump_rollouts import main, request_output_to_json


def npy_base64(array: np.ndarray) -> str:
    """vLLM's OpenAI form: base64 of the array's ``.npy`` file."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def vllm033_rows(truth, prompt_start=0, dtype=np.uint8):
    """``[T - 1 - prompt_start, num_hidden_layers, topk]``, dense layers zero, in vLLM 0.33's dtype."""
    return truth.engine_rows()[prompt_start:].astype(dtype)


def vllm033_request(truth, prompt_start=0):
    """An in-process ``RequestOutput`` of vLLM 0.33: no ``prompt_routed_experts`` attribute."""
    request = vllm_request([truth])
    request.outputs[0].routed_experts = vllm033_rows(truth, prompt_start)
    return request


def vllm033_openai(truths, prompt_start=0):
    """A ``/v1/completions`` response (``return_token_ids``, ``logprobs=0``), one choice per truth."""
    p = len(truths[0].prompt)
    choices = [{"index": i, "text": "...", "finish_reason": "length", "stop_reason": None,
                "logprobs": {"text_offset": [], "token_logprobs": t.logprobs[p:].tolist(), "tokens": [],
                             "top_logprobs": []},
                "token_ids": list(t.completion), "prompt_token_ids": list(t.prompt), "prompt_logprobs": None,
                "routed_experts": npy_base64(vllm033_rows(t, prompt_start))}
               for i, t in enumerate(truths)]
    return {"id": "cmpl-v33", "object": "text_completion", "created": 0, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": p, "completion_tokens": len(truths[0].completion)}}


def sglang_padded(truth, padded_tokens=(4, 5)):
    """SGLang 0.5.23 ``/generate``: int32, the padded tokens' MoE rows -1 (sglang #36404), dense rows zero."""
    response = sglang_response(truth)
    rows = truth.engine_rows()
    moe = np.asarray(SPEC.model_moe_layers) - 1
    for token in padded_tokens:
        rows[token, moe] = -1
    response["meta_info"]["routed_experts"] = base64.b64encode(rows.astype("<i4").tobytes()).decode()
    return response


@dataclass
class TrtCompletionOutput:
    """tensorrt_llm's ``CompletionOutput``: routes on ``additional_generation_outputs`` (and ``routed_experts``)."""

    index: int
    text: str
    token_ids: list
    logprobs: Optional[list]
    finish_reason: Optional[str] = None
    additional_generation_outputs: dict = field(default_factory=dict)


@dataclass
class GenerationResult:
    request_id: int
    prompt_token_ids: list
    outputs: list


def trtllm_result(truth, missing=(), property_field=True):
    """A finished ``GenerationResult``: int16 ``[T - 1, MoE layers, topk]``, -1 rows at ``missing`` tokens."""
    p = len(truth.prompt)
    routes = torch.from_numpy(truth.routes.astype(np.int16))
    for token in missing:
        routes[token] = -1
    completion = TrtCompletionOutput(0, "...", list(truth.completion), truth.logprobs[p:].tolist(), "length",
                                     {"routed_experts": routes})
    if property_field:  # the property #18397 adds, backed by additional_generation_outputs
        completion.routed_experts = routes
    return GenerationResult(11, list(truth.prompt), [completion])


FORMATS = {
    "vllm 0.33 in process": (lambda t: vllm_samples(vllm033_request(t), SPEC), 0, ()),
    "vllm 0.33 prompt start": (lambda t: vllm_samples(vllm033_request(t, 4), SPEC, prompt_start=4), 4, ()),
    "vllm 0.33 openai": (lambda t: vllm_openai_samples(vllm033_openai([t]), None, SPEC), 0, ()),
    "vllm 0.33 openai prompt start": (lambda t: vllm_openai_samples(vllm033_openai([t], 3), t.prompt, SPEC,
                                                                    prompt_start=3), 3, ()),
    "sglang 0.5.23 padded rows": (lambda t: [sglang_sample(sglang_padded(t), t.prompt, SPEC)], 0, (4, 5)),
    "trtllm routed_experts": (lambda t: trtllm_samples(trtllm_result(t), SPEC), 0, ()),
    "trtllm additional outputs, missing rows": (
        lambda t: trtllm_samples(trtllm_result(t, missing=(2,), property_field=False), SPEC), 0, (2,)),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_round_trips_into_a_dump_and_the_replay_input(name, tmp_path):
    build, first, no_route = FORMATS[name]
    truth = make_truth(np.random.default_rng(len(name)), 6, 5)
    (sample,) = round_trip(build(truth), tmp_path)
    np.testing.assert_array_equal(sample.token_ids, truth.tokens)
    np.testing.assert_allclose(sample.logprobs[6:], truth.logprobs[6:])
    assert sample.loss_mask.tolist() == [False] * 6 + [True] * 5
    routed = [first <= t < 10 and t not in no_route for t in range(11)]
    assert sample.routes.valid.tolist() == routed
    ids = sample.routes.to_int64()
    np.testing.assert_array_equal(ids[routed], np.concatenate([truth.routes, truth.routes[:1]])[routed])
    assert (ids[~np.asarray(routed)] == -1).all()  # no route: the live router decides, never expert 0
    replayed = replay_input([sample])
    np.testing.assert_array_equal(replayed.permute(1, 0, 2).numpy(), ids)


def test_vllm_openai_gives_one_sample_per_choice_with_its_own_routes():
    rng = np.random.default_rng(3)
    first = make_truth(rng, 6, 5)
    second = make_truth(rng, 6, 5, prompt=first.prompt)
    samples = vllm_openai_samples(vllm033_openai([first, second]), None, SPEC, rewards=[1.0, 0.0])
    for sample, truth, reward in zip(samples, (first, second), (1.0, 0.0)):
        np.testing.assert_array_equal(sample.routes.to_int64()[:-1], truth.routes)
        assert sample.meta["reward"] == reward and sample.meta["engine"] == "vllm"
    assert [s.meta["completion_index"] for s in samples] == [0, 1]


def test_vllm_layouts_are_told_apart_by_content():
    """The same rollout as vLLM 0.33 (uint8), before 0.21 (int32) and 0.21-0.32 (split) reads the same routes;
    0.33 stores routes per KV block and refuses kernels that cannot capture, so its zero row is refused, while
    before 0.21 a zero row was a capture gap (a prefix-cached token) and leaves that token to the live router."""
    truth = make_truth(np.random.default_rng(4), 6, 5)
    new = from_vllm(vllm033_rows(truth), SPEC, num_tokens=11, sample=0)
    old = from_vllm(truth.engine_rows(), SPEC, num_tokens=11, sample=0)
    np.testing.assert_array_equal(new.to_int64(), old.to_int64())
    gap = truth.engine_rows()
    gap[3] = 0
    assert from_vllm(gap, SPEC, num_tokens=11, sample=0).valid.tolist() == [True] * 3 + [False] + [True] * 6 + [False]
    with pytest.raises(RoutingValidationError, match=r"sample 0: routed_experts: token 3, layer 2: repeated expert id "
                                                     r"in one token's row: \[0, 0\]"):
        from_vllm(gap.astype(np.uint8), SPEC, num_tokens=11, sample=0)


def test_vllm_uint16_above_256_experts():
    spec = RoutingSpec(num_layers=2, model_moe_layers=(2,), num_experts=300, topk=2)
    rows = np.zeros((4, 2, 2), np.uint16)
    rows[:, 1] = [[299, 7], [256, 1], [3, 4], [5, 6]]
    routes = from_vllm(npy_base64(rows), spec, num_tokens=5, sample=0)
    np.testing.assert_array_equal(routes.to_int64()[:-1, 0], rows[:, 1])
    with pytest.raises(RoutingValidationError, match="routed_experts has dtype uint8; vLLM returns uint16 for a "
                                                     "model of 300 experts"):
        from_vllm(rows.astype(np.uint8), spec, num_tokens=5, sample=0)


def test_sglang_partly_padded_token_is_refused():
    """-1 at one MoE layer of a token but routes at the other cannot be a padded row: refused, not replayed."""
    truth = make_truth(np.random.default_rng(5), 6, 5)
    rows = truth.engine_rows()
    rows[6, 1] = -1  # MoE layer 2 of token 6 only
    payload = base64.b64encode(rows.astype("<i4").tobytes()).decode()
    with pytest.raises(RoutingValidationError, match=r"sample 0: token 6, layer 2: no route \(a row of -1\) at this "
                                                     r"layer but routes at others"):
        from_sglang(payload, SPEC, num_tokens=11, sample=0)


def test_trtllm_routes_of_a_list_of_attachments():
    """``additional_generation_outputs["routed_experts"]`` is a list the engine appends to; one attachment is read."""
    truth = make_truth(np.random.default_rng(6), 6, 5)
    result = trtllm_result(truth, property_field=False)
    result.outputs[0].additional_generation_outputs["routed_experts"] = [
        result.outputs[0].additional_generation_outputs["routed_experts"]]
    (sample,) = trtllm_samples(result, SPEC)
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], truth.routes)
    two = [torch.from_numpy(truth.routes.astype(np.int16))] * 2
    with pytest.raises(RoutingValidationError, match="sample 0: routed_experts holds 2 arrays"):
        from_trtllm(two, SPEC, num_tokens=11, sample=0)


# ---- the dump tool: every format as a JSON line, and its bad variants named by file, line and field ----

def trtllm_line(truth):
    result = trtllm_result(truth)
    p = len(truth.prompt)
    routes = result.outputs[0].routed_experts.numpy()
    return {"request_id": 11, "prompt_token_ids": truth.prompt,
            "outputs": [{"index": 0, "token_ids": truth.completion, "logprobs": truth.logprobs[p:].tolist(),
                         "routed_experts": {"dtype": "int16", "shape": list(routes.shape),
                                            "base64": base64.b64encode(routes.astype("<i2").tobytes()).decode()},
                         "finish_reason": "length"}]}


def vllm033_line(truth, prompt_start=0):
    record = request_output_to_json(vllm033_request(truth, prompt_start))
    record["outputs"][0]["routed_experts"] = npy_base64(vllm033_rows(truth, prompt_start))  # as the server sends it
    if prompt_start:
        record["routed_experts_prompt_start"] = prompt_start
    return record


def sglang_line(truth):
    return {"input_ids": truth.prompt, "response": sglang_padded(truth, padded_tokens=())}


DUMP_LINES = {
    "vllm 0.33": ("vllm", vllm033_line, "'r7'"),
    "vllm 0.33 openai": ("vllm", lambda t: {"response": vllm033_openai([t])}, "'cmpl-v33'"),
    "sglang 0.5.23": ("sglang", sglang_line, "'s3'"),
    "trtllm": ("trtllm", trtllm_line, "11"),
}


@pytest.mark.parametrize("name", sorted(DUMP_LINES))
def test_dump_tool_takes_every_new_format(name, tmp_path):
    engine, line, _ = DUMP_LINES[name]
    truth = make_truth(np.random.default_rng(7), 6, 5)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.r3dump"
    source.write_text(json.dumps(line(truth)) + "\n")
    assert main(["--engine", engine, "--input", str(source), "--out", str(out), *MODEL_FLAGS,
                 "--log-interval", "0"]) == 0
    with RolloutDumpReader(out) as reader:
        (sample,) = list(reader)
    np.testing.assert_array_equal(sample.token_ids, truth.tokens)
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], truth.routes)
    assert sample.meta["engine"] == engine


def test_dump_tool_vllm_prompt_start_from_the_line(tmp_path):
    truth = make_truth(np.random.default_rng(8), 6, 5)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.r3dump"
    source.write_text(json.dumps(vllm033_line(truth, prompt_start=5)) + "\n")
    assert main(["--engine", "vllm", "--input", str(source), "--out", str(out), *MODEL_FLAGS]) == 0
    with RolloutDumpReader(out) as reader:
        (sample,) = list(reader)
    assert sample.routes.valid.tolist() == [False] * 5 + [True] * 5 + [False]
    np.testing.assert_array_equal(sample.routes.to_int64()[5:-1], truth.routes[5:])


def _vllm_rows(change):
    """A vLLM 0.33 line whose routes are ``change(uint8 rows)`` (sent as .npy base64)."""
    def line(truth):
        record = vllm033_line(truth)
        record["outputs"][0]["routed_experts"] = npy_base64(change(vllm033_rows(truth)))
        return record
    return line


def _sglang_rows(change):
    def line(truth):
        record = sglang_line(truth)
        rows = change(truth.engine_rows())
        record["response"]["meta_info"]["routed_experts"] = base64.b64encode(rows.astype("<i4").tobytes()).decode()
        return record
    return line


def _trtllm_rows(change):
    def line(truth):
        record = trtllm_line(truth)
        rows = change(truth.routes.astype(np.int16))
        record["outputs"][0]["routed_experts"] = {"dtype": rows.dtype.name, "shape": list(rows.shape),
                                                  "base64": base64.b64encode(rows.tobytes()).decode()}
        return record
    return line


def _set(index, value):
    def change(rows):
        rows = rows.copy()
        rows[index] = value
        return rows
    return change


VLLM_FIELD = r"request 'r7' sample 0: .*routed_experts"
SGLANG_FIELD = r"request 's3' sample 0: .*SGLang meta_info\['routed_experts'\]"
TRT_FIELD = r"request 11 sample 0: .*routed_experts"
BAD_LINES = [
    ("vllm: wrong shape (a token short)", "vllm", _vllm_rows(lambda r: r[:-1]),
     rf"{VLLM_FIELD}: vLLM routes cover 9 tokens; a sample of 11 tokens must have 10"),
    ("vllm: wrong shape (2-D)", "vllm", _vllm_rows(lambda r: r[:, :, 0]),
     rf"{VLLM_FIELD} must be 3-D \[tokens, layers, topk\], got shape \(10, 4\)"),
    ("vllm: wrong dtype", "vllm", _vllm_rows(lambda r: r.astype(np.uint16)),
     rf"{VLLM_FIELD} has dtype uint16; vLLM returns uint8 for a model of 16 experts"),
    ("vllm: float dtype", "vllm", _vllm_rows(lambda r: r.astype(np.float32)),
     rf"vLLM request 'r7' outputs\[0\]\.routed_experts: expert ids must be integers, got dtype float32"),
    ("vllm: id >= num_experts", "vllm", _vllm_rows(_set((2, 3, 1), 16)),
     rf"{VLLM_FIELD}: token 2, layer 4: expert id outside \[0, 16\)"),
    ("vllm: wrong layer count", "vllm", _vllm_rows(lambda r: r[:, :3]),
     rf"{VLLM_FIELD} has 3 layers, the model has 4 decoder layers, 2 of them MoE"),
    ("vllm: non-zero dense row", "vllm", _vllm_rows(_set((5, 0), [3, 4])),
     rf"{VLLM_FIELD}: token 5, layer 1: dense layer holds routes \[3, 4\]"),
    ("sglang: wrong shape", "sglang", _sglang_rows(lambda r: r[:-1]),
     rf"{SGLANG_FIELD} holds 72 int32 values; this sample needs \[tokens - 1, layers, topk\] = \[10, 4, 2\] = 80"),
    ("sglang: id >= num_experts", "sglang", _sglang_rows(_set((1, 1, 0), 40)),
     rf"{SGLANG_FIELD}: token 1, layer 2: expert id outside \[0, 16\)"),
    ("sglang: non-zero dense row", "sglang", _sglang_rows(_set((7, 2), [1, 2])),
     rf"{SGLANG_FIELD}: token 7, layer 3: dense layer holds routes \[1, 2\]"),
    ("sglang: -1 in a dense row", "sglang", _sglang_rows(_set((7, 2), -1)),
     rf"{SGLANG_FIELD}: token 7, layer 3: dense layer holds routes \[-1, -1\]"),
    ("trtllm: wrong shape", "trtllm", _trtllm_rows(lambda r: r[:, :, :1]),
     rf"{TRT_FIELD}: TensorRT-LLM routes have top-k 1, the model routes to top-2"),
    ("trtllm: wrong dtype", "trtllm", _trtllm_rows(lambda r: r.astype(np.int32)),
     rf"{TRT_FIELD} has dtype int32; TensorRT-LLM returns int16"),
    ("trtllm: id >= num_experts", "trtllm", _trtllm_rows(_set((9, 0, 1), 16)),
     rf"{TRT_FIELD}: token 9, layer 2: expert id outside \[0, 16\)"),
    ("trtllm: wrong layer count (every decoder layer)", "trtllm",
     _trtllm_rows(lambda r: np.concatenate([r, r], axis=1)),
     rf"{TRT_FIELD} has 4 layers, the model has 4 decoder layers, 2 of them MoE.*TensorRT-LLM returns one row per "
     rf"MoE layer \(2\)"),
]


@pytest.mark.parametrize("engine, line, message", [b[1:] for b in BAD_LINES], ids=[b[0] for b in BAD_LINES])
def test_dump_tool_refuses_a_bad_variant_in_one_line(engine, line, message, tmp_path, capsys):
    truth = make_truth(np.random.default_rng(9), 6, 5)
    source, out = tmp_path / "in.jsonl", tmp_path / "o.r3dump"
    source.write_text(json.dumps(line(truth)) + "\n")
    assert main(["--engine", engine, "--input", str(source), "--out", str(out), *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dump_rollouts: error: {source} line 1: "), err
    assert re.search(message, err), err
    assert not out.exists()


# ---- the earlier formats' bad variants, through the tool: one line naming file, line, request, sample, field ----

def _json_array(array):
    return {"dtype": array.dtype.name, "shape": list(array.shape), "base64": base64.b64encode(array.tobytes()).decode()}


def _sglext_get(line):
    flat = np.frombuffer(base64.b64decode(line["response"]["sglext"]["routed_experts"]), "<i4")
    return flat.reshape(-1, SPEC.num_layers, SPEC.topk).copy()


def _sglext_put(line, rows):
    line["response"]["sglext"]["routed_experts"] = base64.b64encode(rows.astype("<i4").tobytes()).decode()
    line["response"]["sglext"]["routed_experts_dtype"] = "int32" if rows.dtype.kind == "i" else rows.dtype.name


def _megatron_put(line, rows):
    choice = line["response"]["choices"][0]
    choice["moe_topk_indices"] = rows.tolist()
    choice.pop("prompt_moe_topk_indices")


EARLIER = {  # format of tests/dataplane/engines/test_engine_formats.py: (route field's getter, setter, field named)
    "vllm original int32": (lambda l: route_array(l["outputs"][0]["routed_experts"], "x").copy(),
                            lambda l, r: l["outputs"][0].__setitem__("routed_experts", _json_array(r)),
                            r"request 'r7' sample 0: .*routed_experts"),
    "vllm split int16": (lambda l: route_array(l["prompt_routed_experts"], "x").copy(),
                         lambda l, r: l.__setitem__("prompt_routed_experts", _json_array(r)),
                         r"request 'r7' sample 0: .*prompt_routed_experts"),
    "sglang openai int32": (_sglext_get, _sglext_put,
                            r"request 'cmpl-s9' sample 0: SGLang response sglext\['routed_experts'\]"),
    "megatron moe_topk_indices": (lambda l: np.asarray(l["response"]["choices"][0]["moe_topk_indices"]),
                                  _megatron_put, r"request 'cmpl-1' sample 0: moe_topk_indices"),
}
EARLIER_BAD = [  # (format, variant, change of the route array, what the message says after the field)
    ("vllm original int32", "wrong shape", lambda r: r[:-1], r": vLLM routes cover 9 tokens; a sample of 11"),
    ("vllm original int32", "wrong dtype", lambda r: r.astype(np.int16),
     r" has dtype int16; vLLM returns uint8 for a model of 16 experts \(0\.33\) or int32 \(before 0\.21\)"),
    ("vllm original int32", "id >= num_experts", _set((4, 1, 0), 16), r": token 4, layer 2: expert id outside"),
    ("vllm original int32", "layer count", lambda r: r[:, 1:], r" has 3 layers, the model has 4 decoder layers"),
    ("vllm original int32", "non-zero dense row", _set((2, 2), [6, 7]),
     r": token 2, layer 3: dense layer holds routes \[6, 7\]"),
    ("vllm split int16", "wrong shape", lambda r: r[:-1], r" covers 5 tokens; it must cover 6"),
    ("vllm split int16", "wrong dtype", lambda r: r.astype(np.int32),
     r" has dtype int32; vLLM's split layout returns int16 or uint8"),
    ("vllm split int16", "id >= num_experts", _set((1, 0, 1), 17), r": token 1, layer 2: expert id outside"),
    ("vllm split int16", "layer count", lambda r: r[:, :1], r" has 1 layers, the model has 4 decoder layers"),
    ("vllm split int16", "non-zero dense row",
     lambda r: np.insert(np.insert(r, 0, [[3, 4]], axis=1), 2, 0, axis=1),
     r": token 0, layer 1: dense layer holds routes \[3, 4\]"),
    ("sglang openai int32", "wrong shape", lambda r: r[:, :, :1],
     r" holds 40 int32 values; this sample needs \[tokens - 1, layers, topk\] = \[10, 4, 2\] = 80"),
    ("sglang openai int32", "wrong dtype", lambda r: r.astype(np.float32),
     r": routed_experts_dtype 'float32' is not one of \['int32', 'uint16', 'uint8'\]"),
    ("sglang openai int32", "id >= num_experts", _set((6, 3, 1), 99), r": token 6, layer 4: expert id outside"),
    ("sglang openai int32", "layer count", lambda r: r.reshape(-1, 2, 2)[:-1],
     r" holds 76 int32 values; this sample needs \[tokens - 1, layers, topk\] = \[10, 4, 2\] = 80"),
    ("sglang openai int32", "non-zero dense row", _set((8, 0), [1, 2]),
     r": token 8, layer 1: dense layer holds routes \[1, 2\]"),
    ("megatron moe_topk_indices", "wrong shape", lambda r: r[1:], r": Megatron routes cover 9 tokens"),
    ("megatron moe_topk_indices", "wrong dtype", lambda r: r + 0.5, r": expert ids must be integers, got dtype float64"),
    ("megatron moe_topk_indices", "id >= num_experts", _set((3, 1, 1), 16), r": token 3, layer 4: expert id outside"),
    ("megatron moe_topk_indices", "layer count", lambda r: r[:, :1],
     r" has 1 layers, the model has 4 decoder layers, 2 of them MoE: Megatron returns one row per MoE layer"),
]


@pytest.mark.parametrize("name, change, message", [(b[0], b[2], b[3]) for b in EARLIER_BAD],
                         ids=[f"{b[0]}: {b[1]}" for b in EARLIER_BAD])
def test_dump_tool_refuses_a_bad_variant_of_an_earlier_format(name, change, message, tmp_path, capsys):
    engine, line, _, _ = EARLIER_DUMP_LINES[name]
    get, put, field_named = EARLIER[name]
    record = line(make_truth(np.random.default_rng(10), 6, 5))
    put(record, change(get(record)))
    source, out = tmp_path / "in.jsonl", tmp_path / "o.r3dump"
    source.write_text(json.dumps(record) + "\n")
    assert main(["--engine", engine, "--input", str(source), "--out", str(out), *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dump_rollouts: error: {source} line 1: "), err
    assert re.search(field_named + message, err), err
    assert not out.exists()
