"""Engine outputs -> rollout samples -> dump -> reader: tokens, loss mask, log-probs and routes survive.

Fixtures follow each engine's documented format and are built from known routes and
log-probs: fake vLLM ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` objects with
vLLM's attribute names, SGLang ``/generate`` response dicts, and JSONL files for the CLI.
"""

import base64
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from megatron_r3.dataplane.engines.engine_samples import sglang_sample, sglang_samples, vllm_samples
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.samples import RoutingSpec
from tools.dump_rollouts import main, request_output_to_json

ROOT = Path(__file__).resolve().parents[2]
# Dense-first: layers 1 and 3 are dense, 2 and 4 are MoE (--moe-layer-freq 0,1,0,1).
SPEC = RoutingSpec(num_layers=4, model_moe_layers=(2, 4), num_experts=16, topk=2)
MODEL_FLAGS = ["--num-layers", "4", "--moe-layer-freq", "0,1,0,1", "--num-experts", "16", "--moe-router-topk", "2"]


@dataclass
class Truth:
    """What a rollout really was: the expected sample."""

    prompt: list
    completion: list
    logprobs: np.ndarray  # [T], 0 for the first prompt token
    routes: np.ndarray  # [T - 1, MoE layers, topk]: the last token has none

    @property
    def tokens(self):
        return self.prompt + self.completion

    def engine_rows(self) -> np.ndarray:
        """np.int32 [T - 1, num_layers, topk], dense layers zero rows, as both engines return."""
        rows = np.zeros((len(self.tokens) - 1, SPEC.num_layers, SPEC.topk), np.int32)
        rows[:, np.asarray(SPEC.model_moe_layers) - 1] = self.routes
        return rows


def make_truth(rng, prompt_len, completion_len, prompt=None) -> Truth:
    prompt = list(rng.integers(0, 1000, prompt_len)) if prompt is None else prompt
    prompt = [int(t) for t in prompt]
    n = prompt_len + completion_len
    logprobs = -rng.random(n).astype(np.float32)
    logprobs[0] = 0.0
    routes = np.argsort(rng.random((n - 1, len(SPEC.model_moe_layers), SPEC.num_experts)), axis=2)[:, :, : SPEC.topk]
    return Truth(prompt, [int(t) for t in rng.integers(0, 1000, completion_len)], logprobs, routes)


# vLLM look-alikes: the attribute names of vllm.outputs and vllm.logprobs.
@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: Optional[float]
    logprobs: Optional[list]
    routed_experts: Optional[np.ndarray] = None
    finish_reason: Optional[str] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    prompt_logprobs: Optional[list]
    outputs: list = field(default_factory=list)
    finished: bool = True


def vllm_positions(tokens, logprobs):
    """Per position ``{token: Logprob}``: the chosen token and a more likely runner-up (top-2)."""
    return [{t: Logprob(float(lp), rank=2, decoded_token=f"t{t}"), t + 1000: Logprob(-0.01, rank=1)}
            for t, lp in zip(tokens, logprobs)]


def vllm_request(truths, request_id="r7", prompt_logprobs=True) -> RequestOutput:
    """A RequestOutput with one completion per truth (all share the first truth's prompt)."""
    first = truths[0]
    p = len(first.prompt)
    outputs = [
        CompletionOutput(index=i, text="", token_ids=list(t.completion), cumulative_logprob=float(t.logprobs[p:].sum()),
                         logprobs=vllm_positions(t.completion, t.logprobs[p:]), routed_experts=t.engine_rows(),
                         finish_reason="length")
        for i, t in enumerate(truths)
    ]
    prompt_lp = [None] + vllm_positions(first.prompt[1:], first.logprobs[1:p]) if prompt_logprobs else None
    return RequestOutput(request_id, None, list(first.prompt), prompt_lp, outputs)


def sglang_response(truth, rid="s3", logprob_start_len=0, return_prompt_token_ids=False) -> dict:
    """A /generate response dict (return_logprob=True, return_routed_experts=True)."""
    p = len(truth.prompt)
    start = logprob_start_len
    # The first returned input entry has no log-prob (SGLang pads it with None).
    input_lps = [[None if i == start else float(truth.logprobs[i]), truth.prompt[i], None] for i in range(start, p)]
    meta = {
        "id": rid, "prompt_tokens": p, "completion_tokens": len(truth.completion), "cached_tokens": 0,
        "finish_reason": {"type": "length", "length": len(truth.completion)},
        "routed_experts": base64.b64encode(truth.engine_rows().astype("<i4").tobytes()).decode(),
        "output_token_logprobs": [[float(lp), t, None] for t, lp in zip(truth.completion, truth.logprobs[p:])],
        "input_token_logprobs": input_lps,
    }
    response = {"text": "...", "output_ids": list(truth.completion), "meta_info": meta}
    if return_prompt_token_ids:
        response["prompt_token_ids"] = list(truth.prompt)
    return response


def assert_sample(sample, truth, logprobs=None):
    t = len(truth.tokens)
    np.testing.assert_array_equal(sample.token_ids, truth.tokens)
    assert sample.loss_mask.tolist() == [False] * len(truth.prompt) + [True] * len(truth.completion)
    np.testing.assert_array_equal(sample.logprobs, truth.logprobs if logprobs is None else logprobs)
    routes = sample.routes
    assert routes.layer_numbers == SPEC.model_moe_layers  # dense-layer rows dropped
    assert routes.valid.tolist() == [True] * (t - 1) + [False]  # the last sampled token has no route
    ids = routes.to_int64()
    np.testing.assert_array_equal(ids[:-1], truth.routes)
    assert (ids[-1] == -1).all()


def round_trip(samples, tmp_path):
    path = tmp_path / "rollouts.r3dump"
    with RolloutDumpWriter(path, num_experts=SPEC.num_experts, topk=SPEC.topk,
                           layer_numbers=SPEC.model_moe_layers) as writer:
        for sample in samples:
            writer.write(sample)
    with RolloutDumpReader(path) as reader:
        return list(reader)


def test_vllm_n_completions_round_trip_through_the_dump(tmp_path):
    rng = np.random.default_rng(0)
    first = make_truth(rng, 6, 5)
    truths = [first, make_truth(rng, 6, 9, prompt=first.prompt)]
    truths[1].logprobs[:6] = first.logprobs[:6]  # one prompt, one set of prompt log-probs
    samples = vllm_samples(vllm_request(truths), SPEC, rewards=[1.0, None])
    back = round_trip(samples, tmp_path)
    assert len(back) == 2
    for sample, truth in zip(back, truths):
        assert_sample(sample, truth)
    assert back[0].meta == {"engine": "vllm", "request_id": "r7", "completion_index": 0, "finish_reason": "length",
                            "reward": 1.0}
    assert back[1].meta["completion_index"] == 1 and "reward" not in back[1].meta


def test_vllm_without_prompt_logprobs_gives_zero_prompt_logprobs():
    truth = make_truth(np.random.default_rng(1), 4, 3)
    (sample,) = vllm_samples(vllm_request([truth], prompt_logprobs=False), SPEC)
    expected = truth.logprobs.copy()
    expected[:4] = 0
    assert_sample(sample, truth, logprobs=expected)


def _rows(mutate):
    def apply(request):
        completion = request.outputs[1]
        completion.routed_experts = mutate(completion.routed_experts)
    return apply


def _set_logprobs_none(request):
    request.outputs[1].logprobs = None


def _drop_chosen_logprob(request):
    del request.outputs[1].logprobs[2][request.outputs[1].token_ids[2]]


@pytest.mark.parametrize("mutate, message", [
    (_rows(lambda r: r[:, :3]), "request 'r7' sample 1: routed_experts has 3 layers, the model has 4 decoder layers"),
    (_rows(lambda r: np.concatenate([r, r[:, :, :1] + 5], axis=2)),
     "request 'r7' sample 1: routed_experts: vLLM routes have top-k 3, the model routes to top-2"),
    (_rows(lambda r: r[:-1]), "request 'r7' sample 1: routed_experts: vLLM routes cover 10 tokens; a sample of 12 tokens must have 11"),
    (_rows(lambda r: None), "request 'r7' sample 1: vLLM returned no routed_experts"),
    (_rows(lambda r: _with(r, (3, 0, 1), 7)), "request 'r7' sample 1: routed_experts: token 3, layer 1: dense layer holds routes"),
    (_set_logprobs_none, "request 'r7' sample 1: vLLM returned no logprobs"),
    (_drop_chosen_logprob, "request 'r7' sample 1: logprobs\\[2\\] has no entry for token"),
])
def test_vllm_bad_completion_is_refused_naming_the_request(mutate, message):
    rng = np.random.default_rng(2)
    first = make_truth(rng, 5, 4)
    request = vllm_request([first, make_truth(rng, 5, 7, prompt=first.prompt)])
    mutate(request)
    with pytest.raises(RoutingValidationError, match=message):
        vllm_samples(request, SPEC)


def _with(array, index, value):
    array = array.copy()
    array[index] = value
    return array


def test_sglang_response_round_trip_and_prompt_sources(tmp_path):
    rng = np.random.default_rng(3)
    truth = make_truth(rng, 7, 6)
    response = sglang_response(truth)
    by_caller = sglang_sample(response, truth.prompt, SPEC, reward=0.5)
    from_logprobs = sglang_sample(response, None, SPEC)  # logprob_start_len=0: the entries name every prompt id
    from_ids = sglang_sample(sglang_response(truth, logprob_start_len=7, return_prompt_token_ids=True), None, SPEC)
    back = round_trip([by_caller, from_logprobs, from_ids], tmp_path)
    assert_sample(back[0], truth)
    assert_sample(back[1], truth)
    assert back[0].meta == {"engine": "sglang", "request_id": "s3", "completion_index": 0,
                            "finish_reason": {"type": "length", "length": 6}, "reward": 0.5}
    no_prompt_logprobs = truth.logprobs.copy()
    no_prompt_logprobs[:7] = 0
    assert_sample(back[2], truth, logprobs=no_prompt_logprobs)


def test_sglang_partial_input_logprobs_fill_the_end_of_the_prompt():
    truth = make_truth(np.random.default_rng(4), 8, 3)
    sample = sglang_sample(sglang_response(truth, logprob_start_len=5), truth.prompt, SPEC)
    expected = truth.logprobs.copy()
    expected[:6] = 0  # before logprob_start_len, and the first returned entry (None)
    assert_sample(sample, truth, logprobs=expected)


def test_sglang_n_responses_of_one_prompt():
    rng = np.random.default_rng(5)
    first = make_truth(rng, 5, 4)
    second = make_truth(rng, 5, 8, prompt=first.prompt)
    second.logprobs[:5] = first.logprobs[:5]
    samples = sglang_samples([sglang_response(first, "a"), sglang_response(second, "b")], first.prompt, SPEC,
                             rewards=[0.0, 1.0])
    assert [s.meta["completion_index"] for s in samples] == [0, 1]
    assert [s.meta["request_id"] for s in samples] == ["a", "b"]
    assert_sample(samples[0], first)
    assert_sample(samples[1], second)


def _meta(key, value):
    def apply(response, truth):
        if value is None:
            del response["meta_info"][key]
        else:
            response["meta_info"][key] = value(truth) if callable(value) else value
        return truth.prompt
    return apply


def _routes(rows):
    return lambda truth: base64.b64encode(rows(truth.engine_rows()).astype("<i4").tobytes()).decode()


@pytest.mark.parametrize("mutate, message", [
    (_meta("routed_experts", None), "request 's3' sample 0: SGLang meta_info has no routed_experts"),
    (_meta("routed_experts", _routes(lambda r: r[:-2])), r"SGLang meta_info\['routed_experts'\] holds 56 int32 values; "
     r"this sample needs \[tokens - 1, layers, topk\] = \[9, 4, 2\] = 72"),
    (_meta("routed_experts", _routes(lambda r: r[:, :, :1])), r"routed_experts'\] holds 36 int32 values; .* = 72"),
    (_meta("completion_tokens", 5), "request 's3' sample 0: 4 output_ids, but meta_info\\['completion_tokens'\\] = 5"),
    (_meta("output_token_logprobs", None), "request 's3' sample 0: .*no output_token_logprobs"),
    (lambda response, truth: truth.prompt[:-1], "request 's3' sample 0: 5 prompt ids, but meta_info\\['prompt_tokens'\\]"),
    (lambda response, truth: [t + 1 for t in truth.prompt], "input_token_logprobs\\[0\\] is for token"),
    (lambda response, truth: response["meta_info"]["input_token_logprobs"].pop(0) and None,
     "request 's3' sample 0: the prompt ids are unknown: pass the request's input_ids"),
])
def test_sglang_bad_response_is_refused_naming_the_request(mutate, message):
    truth = make_truth(np.random.default_rng(6), 6, 4)
    response = sglang_response(truth)
    input_ids = mutate(response, truth)
    with pytest.raises(RoutingValidationError, match=message):
        sglang_sample(response, input_ids, SPEC)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_cli_vllm_jsonl_as_a_subprocess(tmp_path):
    rng = np.random.default_rng(7)
    requests = []
    for i in range(3):
        first = make_truth(rng, 4 + i, 3)
        second = make_truth(rng, 4 + i, 5, prompt=first.prompt)
        requests.append(vllm_request([first, second], request_id=f"q{i}"))
    records = [request_output_to_json(r, rewards=[1.0, 0.0]) for r in requests]
    records[1]["outputs"][0]["routed_experts"] = requests[1].outputs[0].routed_experts.tolist()  # nested-list form
    out = tmp_path / "out.r3dump"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "dump_rollouts.py"), "--engine", "vllm",
         "--input", str(write_jsonl(tmp_path / "in.jsonl", records)), "--out", str(out), "--log-interval", "2",
         *MODEL_FLAGS],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "6 samples from 3 requests" in proc.stdout
    assert "dump_rollouts: 2 samples from 1 requests" in proc.stderr  # progress
    with RolloutDumpReader(out) as reader:
        back = list(reader)
    expected = [s for r in requests for s in vllm_samples(r, SPEC, rewards=[1.0, 0.0])]
    assert len(back) == len(expected) == 6
    for got, want in zip(back, expected):
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.routes.to_int64(), want.routes.to_int64())
        assert got.meta == want.meta


def test_cli_sglang_jsonl_and_errors_naming_line_and_request(tmp_path, capsys):
    rng = np.random.default_rng(8)
    first = make_truth(rng, 5, 4)
    second = make_truth(rng, 5, 6, prompt=first.prompt)
    second.logprobs[:5] = first.logprobs[:5]
    lone = make_truth(rng, 3, 3)
    records = [
        {"input_ids": first.prompt, "response": [sglang_response(first, "a"), sglang_response(second, "b")],
         "reward": [1.0, 0.0]},
        {"response": sglang_response(lone, "c", return_prompt_token_ids=True)},
    ]
    out = tmp_path / "sglang.r3dump"
    assert main(["--engine", "sglang", "--input", str(write_jsonl(tmp_path / "in.jsonl", records)),
                 "--out", str(out), *MODEL_FLAGS]) == 0
    with RolloutDumpReader(out) as reader:
        back = list(reader)
    for sample, truth in zip(back, [first, second, lone]):
        assert_sample(sample, truth)
    assert [s.meta.get("reward") for s in back] == [1.0, 0.0, None]

    broken = sglang_response(lone, "d")
    broken["meta_info"]["routed_experts"] = _routes(lambda r: r[:-1])(lone)
    bad = tmp_path / "bad.r3dump"
    lines = write_jsonl(tmp_path / "bad.jsonl", [records[1], {"input_ids": lone.prompt, "response": broken}])
    assert main(["--engine", "sglang", "--input", str(lines), "--out", str(bad), *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert ("bad.jsonl line 2: request 'd' sample 0: SGLang meta_info['routed_experts'] holds 32 int32 values; "
            "this sample needs [tokens - 1, layers, topk] = [5, 4, 2] = 40") in err
    assert not bad.exists() and not Path(f"{bad}.partial").exists()  # nothing half-written

    (tmp_path / "junk.jsonl").write_text('{"response": {}}\nnot json\n')
    assert main(["--engine", "sglang", "--input", str(tmp_path / "junk.jsonl"), "--out", str(bad), *MODEL_FLAGS]) == 1
    assert "junk.jsonl line 1: SGLang response has no meta_info" in capsys.readouterr().err


def test_trtllm_json_with_vllm_style_logprobs(tmp_path):
    """TensorRT-LLM's per-position ``{"<token id>": {"logprob": ...}}`` log-probs, as documented, from JSON."""
    from tools.dump_rollouts import dump_jsonl

    rng = np.random.default_rng(3)
    routes = np.stack([np.argsort(rng.random((2, 16)), axis=1)[:, :2] for _ in range(4)]).astype("<i2")
    line = {"request_id": 1, "prompt_token_ids": [1, 2], "outputs": [{
        "index": 0, "token_ids": [3, 4, 5], "logprobs": [{"3": {"logprob": -0.5}}, {"4": {"logprob": -0.25}},
                                                         {"9": {"logprob": -2.0}, "5": {"logprob": -1.0}}],
        "routed_experts": {"dtype": "int16", "shape": [4, 2, 2], "base64": base64.b64encode(routes.tobytes()).decode()}}]}
    write_jsonl(tmp_path / "in.jsonl", [line])
    dump_jsonl(str(tmp_path / "in.jsonl"), str(tmp_path / "out.r3dump"), "trtllm", SPEC, log_interval=0)
    with open(tmp_path / "out.r3dump", "rb") as f:
        sample = RolloutDumpReader(f).read(0)
    np.testing.assert_array_equal(sample.logprobs, np.array([0, 0, -0.5, -0.25, -1.0], np.float32))
