"""The converted dump of each format of November 2026, through the launcher's dump path, into the trainer's replay.

Lines of vLLM 0.33 (base64 .npy, uint8 over every hidden layer), SGLang 0.5.23 (int32, a padded
token's MoE rows -1) and TensorRT-LLM (int16 over the MoE layers, a missing route -1), written as
in tests/dataplane/engines/test_engine_formats_2026_11.py for the launcher tests' small model
(4 layers, MoE at 2 and 4, 4 experts, top-2), go through ``tools/dump_rollouts.py`` into a dump;
the launcher trains one step on it (``--rollout-dump``, replay on, one gloo rank). Every route the
update pass replays is one the engine returned, for every routed token of every sample (the same
rows per layer, counted with multiplicity), the routers take exactly those, and tokens the
engine gave no route route live or get a filler where no loss sees them.
"""

import base64
import io
import json
from collections import Counter

import numpy as np
import pytest

from tests.support.launcher import run_workers
from tests.test_launch import DUMP_FLAGS, EXPERTS, TOPK, VOCAB, mismatched_rows, passes_worker, update_pass
from tools.dump_rollouts import main

MODEL = ["--num-layers", "4", "--moe-layer-freq", "0,1,0,1", "--num-experts", str(EXPERTS),
         "--moe-router-topk", str(TOPK), "--vocab-size", str(VOCAB)]
MOE = np.asarray([2, 4])
LENGTHS = [(9, 6), (12, 9), (7, 14), (10, 5)]  # (prompt, completion) per sample
NO_ROUTE = {"sglang": (3, 4), "trtllm": (5,)}  # tokens the engine left without a route, per sample


def _sample(rng, prompt, completion):
    tokens = [int(t) for t in rng.integers(0, VOCAB, prompt + completion)]
    logprobs = (-rng.random(completion) - 0.05).tolist()
    routes = np.argsort(rng.random((prompt + completion - 1, len(MOE), EXPERTS)), axis=2)[:, :, :TOPK]
    return tokens, logprobs, routes


def _every_layer(routes, dtype):
    rows = np.zeros((routes.shape[0], 4, TOPK), dtype)
    rows[:, MOE - 1] = routes
    return rows


def vllm_line(i, tokens, prompt, logprobs, routes):
    buffer = io.BytesIO()
    np.save(buffer, _every_layer(routes, np.uint8))
    return {"request_id": f"v{i}", "prompt_token_ids": tokens[:prompt], "prompt_logprobs": None, "outputs": [{
        "index": 0, "token_ids": tokens[prompt:], "finish_reason": "length", "reward": float(i % 2),
        "logprobs": [{str(t): {"logprob": lp}} for t, lp in zip(tokens[prompt:], logprobs)],
        "routed_experts": base64.b64encode(buffer.getvalue()).decode()}]}


def sglang_line(i, tokens, prompt, logprobs, routes):
    rows = _every_layer(routes, np.int32)
    for token in NO_ROUTE["sglang"]:
        rows[token, MOE - 1] = -1
    meta = {"id": f"s{i}", "prompt_tokens": prompt, "completion_tokens": len(tokens) - prompt,
            "routed_experts": base64.b64encode(rows.astype("<i4").tobytes()).decode(),
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(tokens[prompt:], logprobs)],
            "input_token_logprobs": [[None, tokens[0], None]] + [[-1.0, t, None] for t in tokens[1:prompt]],
            "finish_reason": {"type": "length"}}
    return {"input_ids": tokens[:prompt], "reward": float(i % 2),
            "response": {"text": "", "output_ids": tokens[prompt:], "meta_info": meta}}


def trtllm_line(i, tokens, prompt, logprobs, routes):
    rows = routes.astype("<i2")
    for token in NO_ROUTE["trtllm"]:
        rows[token] = -1
    return {"request_id": i, "prompt_token_ids": tokens[:prompt], "outputs": [{
        "index": 0, "token_ids": tokens[prompt:], "logprobs": logprobs, "finish_reason": "length",
        "reward": float(i % 2),
        "routed_experts": {"dtype": "int16", "shape": list(rows.shape), "base64": base64.b64encode(rows.tobytes()).decode()}}]}


LINES = {"vllm": vllm_line, "sglang": sglang_line, "trtllm": trtllm_line}


@pytest.mark.parametrize("engine", sorted(LINES))
def test_the_converted_dump_replays_the_engine_routes_in_the_trainer(engine, tmp_path):
    rng = np.random.default_rng(sorted(LINES).index(engine))
    expected = {layer: Counter() for layer in range(len(MOE))}
    lines = []
    for i, (prompt, completion) in enumerate(LENGTHS):
        tokens, logprobs, routes = _sample(rng, prompt, completion)
        lines.append(json.dumps(LINES[engine](i, tokens, prompt, logprobs, routes)))
        routed = np.setdiff1d(np.arange(len(routes)), NO_ROUTE.get(engine, ()))
        for layer in expected:
            expected[layer].update(map(tuple, routes[routed, layer].tolist()))
    source, dump = tmp_path / f"{engine}.jsonl", tmp_path / f"{engine}.r3dump"
    source.write_text("\n".join(lines) + "\n")
    assert main(["--engine", engine, "--input", str(source), "--out", str(dump), *MODEL, "--log-interval", "0"]) == 0

    argv = DUMP_FLAGS + ["--rollout-dump", str(dump), "--train-iters", "1", "--global-batch-size", str(len(LENGTHS)),
                         "--moe-enable-routing-replay"]
    (result,) = run_workers(passes_worker, 1, argv, backend="gloo")
    update = update_pass(result["passes"])
    given = {layer: Counter() for layer in expected}
    for per_chunk, fillers in zip(update["given"], update["fillers"]):
        for ids, filler in zip(per_chunk, fillers):
            replayed = (ids[..., 0] >= 0).numpy()
            if filler is not None:
                replayed &= ~filler
            for layer in given:
                given[layer].update(map(tuple, ids[layer][replayed[layer]].tolist()))
    assert given == expected  # every engine route, once per routed token, and nothing else
    bad, rows = mismatched_rows(update["given"], update["taken"])
    assert bad == 0 and rows >= sum(sum(c.values()) for c in expected.values())
    history = result["history"][0]
    no_route = len(LENGTHS) * len(NO_ROUTE.get(engine, ()))
    assert history["routing/replayed_tokens"] == sum(p + c - 1 for p, c in LENGTHS) - no_route
    assert history["routing/live_tokens"] == no_route  # mid-sample tokens without a route: a loss sees them
