"""``tools/dump_rollouts.py`` on one CPU core: every engine format, 100k tokens x 48 layers x top-8 (CPU only).

    taskset -c 0 python -m bench.dump_rollouts --out build/bench/dump-rollouts.md

Writes, for each route format the tool reads, a JSONL file of one rollout batch as the engine
returns it (25 samples of 4000 tokens: a 1024-token prompt, a 2976-token completion; 48 MoE
layers of 128 experts, top-8; random distinct experts, log-probs on the completion; SGLang
0.5.23's and TensorRT-LLM's files leave 8 tokens a sample without a route, their -1 rows),
then times ``dump_jsonl`` (the tool without its argument parsing: read, parse, decode, validate,
write the dump) on each, the files in the page cache, ``--repeats`` times. Rates are over the
least CPU seconds of the process (``time.process_time``): the work of one core, what the target
counts, and the figure least disturbed where other processes share the core (they evict its
caches and take its turns); the medians of CPU and wall seconds stand beside it. "Decoded MB" are the routes as the engine
encodes them, once out of their base64 or JSON: tokens x layers x top-k entries of the engine's
dtype (uint8 for vLLM 0.33 at 128 experts, int16 for TensorRT-LLM and vLLM's split layout,
int32 for SGLang, vLLM before 0.21 and Megatron's lists); "dump MB" the same routes as the dump
holds them, one byte per entry; "input MB" the JSONL read. The torch and numpy work the tool does is single-threaded; pin the process to one core
(``taskset -c 0``) so nothing else runs in parallel either.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from bench import publish_report
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.layers.moe_layers import model_moe_layers
from tools.dump_rollouts import dump_jsonl

TARGET_MB_S = 200.0


class Batch:
    """One rollout batch's truth: tokens, completion log-probs, routes, and the tokens without a route."""

    def __init__(self, args):
        rng = np.random.default_rng(0)
        self.prompt, self.completion = args.prompt_tokens, args.completion_tokens
        self.layers, self.experts, self.topk = args.num_layers, args.num_experts, args.moe_router_topk
        length = self.prompt + self.completion
        self.tokens = rng.integers(0, 150000, (args.samples, length))
        self.logprobs = -rng.random((args.samples, self.completion)) - 1e-3
        # Distinct experts per row: the top-k of a random permutation of a small pool per sample (fast to make).
        pool = np.argsort(rng.random((64, self.layers, self.experts)), axis=2)[:, :, :self.topk].astype(np.uint8)
        self.routes = [pool[rng.integers(0, 64, length - 1)] for _ in range(args.samples)]
        self.no_route = np.arange(8) * 97 + 5  # tokens an engine left without a route (SGLang, TensorRT-LLM)

    @property
    def num_tokens(self):
        return self.tokens.size

    def sample(self, i):
        tokens = self.tokens[i].tolist()
        return tokens[:self.prompt], tokens[self.prompt:], self.logprobs[i].tolist(), self.routes[i]


def _npy_base64(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _array_json(array):
    return {"dtype": array.dtype.name, "shape": list(array.shape),
            "base64": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}


def _vllm_positions(tokens, logprobs):
    return [{str(t): {"logprob": lp, "rank": 1}} for t, lp in zip(tokens, logprobs)]


def vllm_033(batch, i):
    prompt, completion, logprobs, routes = batch.sample(i)
    return {"request_id": f"r{i}", "prompt_token_ids": prompt, "prompt_logprobs": None, "outputs": [{
        "index": 0, "token_ids": completion, "logprobs": _vllm_positions(completion, logprobs),
        "routed_experts": _npy_base64(routes), "finish_reason": "length", "reward": 1.0}]}


def vllm_033_openai(batch, i):
    prompt, completion, logprobs, routes = batch.sample(i)
    return {"reward": [1.0], "response": {"id": f"cmpl-{i}", "object": "text_completion", "choices": [{
        "index": 0, "text": "", "token_ids": completion, "prompt_token_ids": prompt,
        "logprobs": {"token_logprobs": logprobs}, "routed_experts": _npy_base64(routes), "finish_reason": "length"}]}}


def vllm_int32(batch, i):
    line = vllm_033(batch, i)
    line["outputs"][0]["routed_experts"] = _array_json(batch.routes[i].astype("<i4"))
    return line


def vllm_split(batch, i):
    line = vllm_033(batch, i)
    routes = batch.routes[i].astype("<i2")
    line["prompt_routed_experts"] = _array_json(routes[:batch.prompt])
    line["outputs"][0]["routed_experts"] = _array_json(routes[batch.prompt:])
    return line


def _sglang_payload(batch, i):
    rows = batch.routes[i].astype("<i4")
    rows[batch.no_route] = -1  # sglang #36404: a padded token's MoE rows
    return base64.b64encode(rows.tobytes()).decode()


def sglang_0523(batch, i):
    prompt, completion, logprobs, _ = batch.sample(i)
    meta = {"id": f"s{i}", "prompt_tokens": len(prompt), "completion_tokens": len(completion),
            "routed_experts": _sglang_payload(batch, i), "finish_reason": {"type": "length"},
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(completion, logprobs)],
            "input_token_logprobs": [[None, prompt[-1], None]]}  # logprob_start_len: the last
    return {"input_ids": prompt, "reward": 1.0, "response": {"text": "", "output_ids": completion, "meta_info": meta}}


def sglang_openai(batch, i):
    prompt, completion, logprobs, _ = batch.sample(i)
    return {"reward": 1.0, "response": {"id": f"cmpl-s{i}", "object": "text_completion", "choices": [{
        "index": 0, "text": "", "token_ids": completion, "prompt_token_ids": prompt,
        "logprobs": {"token_logprobs": logprobs}, "finish_reason": "length"}],
        "sglext": {"routed_experts": _sglang_payload(batch, i), "routed_experts_dtype": "int32"}}}


def trtllm(batch, i):
    prompt, completion, logprobs, routes = batch.sample(i)
    rows = routes.astype("<i2")
    rows[batch.no_route] = -1
    return {"request_id": i, "prompt_token_ids": prompt, "outputs": [{
        "index": 0, "token_ids": completion, "logprobs": logprobs, "routed_experts": _array_json(rows),
        "finish_reason": "length", "reward": 1.0}]}


def megatron(batch, i):
    prompt, completion, logprobs, routes = batch.sample(i)
    return {"reward": [1.0], "response": {"id": f"m{i}", "choices": [{
        "index": 0, "prompt_token_ids": prompt, "generation_token_ids": completion, "generation_log_probs": logprobs,
        "moe_topk_indices": routes.tolist(), "finish_reason": "length"}]}}


# (name, --engine, line maker, bytes per entry of the routes as the engine encodes them); every layer of the
# model is MoE, as in the target.
FORMATS = [
    ("vLLM 0.33 RequestOutput, base64 .npy uint8", "vllm", vllm_033, 1),
    ("vLLM 0.33 /v1/completions, base64 .npy uint8", "vllm", vllm_033_openai, 1),
    ("vLLM before 0.21, int32", "vllm", vllm_int32, 4),
    ("vLLM 0.21-0.32 split, int16", "vllm", vllm_split, 2),
    ("SGLang 0.5.23 /generate, base64 int32, -1 rows", "sglang", sglang_0523, 4),
    ("SGLang /v1/completions sglext, base64 int32", "sglang", sglang_openai, 4),
    ("TensorRT-LLM, int16, -1 rows", "trtllm", trtllm, 2),
    ("Megatron /v1/completions, nested JSON lists (int32)", "megatron", megatron, 4),
]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.dump_rollouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=25)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=2976)
    parser.add_argument("--num-layers", type=int, default=48, help="decoder layers, every one MoE")
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--moe-router-topk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=None, help="names' first words to run (default: all)")
    parser.add_argument("--out", default=None, help="markdown report path")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core: the tool's torch work (none on this path) stays on it too
    batch = Batch(args)
    spec = RoutingSpec(num_layers=args.num_layers, model_moe_layers=model_moe_layers(args.num_layers, 1),
                       num_experts=args.num_experts, topk=args.moe_router_topk)
    dump_mb = batch.num_tokens * args.num_layers * args.moe_router_topk / 1e6
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    lines = [
        f"# `tools/dump_rollouts.py` conversion speed (`bench/dump_rollouts.py`, {datetime.date.today()})",
        "",
        f"Command: `{' '.join(['python -m bench.dump_rollouts'] + [shlex.quote(a) for a in (argv or sys.argv[1:])])}`;"
        f" {platform.processor() or platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}, "
        f"CPUs allowed {affinity}. {args.samples} samples x {args.prompt_tokens + args.completion_tokens} tokens = "
        f"{batch.num_tokens} tokens, {args.num_layers} MoE layers, {args.num_experts} experts, top-{args.moe_router_topk}: "
        f"{dump_mb:.1f} MB of routes in the dump (uint8). {args.repeats} conversions each; rates are over the "
        f"least CPU seconds; "
        f"target >= {TARGET_MB_S:.0f} MB/s of decoded routes. Load average at the start "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min).",
        "",
        "| format | input MB | decoded MB | wall s (median) | CPU s (median) | CPU s (least) | decoded MB/s | dump MB/s | "
        "input MB/s | >= 200 MB/s decoded |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    libraries = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, engine, make_line, entry_bytes in FORMATS:
            if args.formats and not any(name.startswith(f) for f in args.formats):
                continue
            source = os.path.join(workdir, "in.jsonl")
            with open(source, "w") as f:
                for i in range(args.samples):
                    f.write(json.dumps(make_line(batch, i)) + "\n")
            input_mb = os.path.getsize(source) / 1e6
            out = os.path.join(workdir, "out.r3dump")
            wall, cpu = [], []
            for _ in range(args.repeats):
                start, start_cpu = time.perf_counter(), time.process_time()
                counts = dump_jsonl(source, out, engine, spec, overwrite=True, log_interval=0, log=sys.stderr)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            assert counts["samples"] == args.samples and counts["tokens"] == batch.num_tokens
            seconds = min(cpu)
            decoded = dump_mb * entry_bytes
            rate = decoded / seconds
            lines.append(f"| {name} | {input_mb:.1f} | {decoded:.1f} | {statistics.median(wall):.3f} | "
                         f"{statistics.median(cpu):.3f} | {seconds:.3f} | "
                         f"{rate:.0f} | {dump_mb / seconds:.0f} | {input_mb / seconds:.0f} | "
                         f"{'met' if rate >= TARGET_MB_S else 'missed'} |")
            print(lines[-1], file=sys.stderr, flush=True)
            if engine != "megatron":  # its lines are all JSON numbers: the conversion above is their parse
                libraries += _libraries(name, engine, source, args.repeats)
    lines += ["", "The standard library against the libraries the tool uses, on the same lines in the same run "
              "(least CPU seconds for the whole file): each file's JSON parse, and the strict base64 decode of the "
              "SGLang file's routes:", "", "| file | step | standard library | tool | speed-up |", "|---|---|---:|---:|---:|"]
    lines += [f"| {name} | {step} | {old:.3f} | {new:.3f} | {old / new:.1f}x |" for name, step, old, new in libraries]
    publish_report("\n".join(lines) + "\n", args.out)


def _libraries(name, engine, source, repeats):
    """(file, step, standard library seconds, tool seconds): the JSON parse (``json`` / orjson) of the lines and,
    for SGLang's ``/generate`` file, the strict base64 decode (``binascii`` / pybase64) of their routes."""
    import binascii

    import orjson
    import pybase64

    with open(source, "rb") as f:
        raw = f.readlines()

    def least_seconds(work):
        seconds = []
        for _ in range(repeats):
            start = time.process_time()
            for item in work[1]:
                work[0](item)
            seconds.append(time.process_time() - start)
        return min(seconds)

    steps = [("JSON parse", (json.loads, raw), (orjson.loads, raw))]
    if engine == "sglang" and "generate" in name:
        payloads = [orjson.loads(line)["response"]["meta_info"]["routed_experts"] for line in raw]
        steps.append(("strict base64 decode", (lambda p: binascii.a2b_base64(p, strict_mode=True), payloads),
                      (lambda p: pybase64.b64decode(p, validate=True), payloads)))
    return [(name, step, least_seconds(old), least_seconds(new)) for step, old, new in steps]


if __name__ == "__main__":
    main()
