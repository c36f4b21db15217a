"""Turn saved vLLM, SGLang, TensorRT-LLM or Megatron-inference rollouts (JSONL) into a megatron-r3 rollout dump.

    python tools/dump_rollouts.py --engine vllm --input rollouts.jsonl --out rollouts.r3dump \\
        --num-layers 48 --moe-layer-freq 1 --num-experts 128 --moe-router-topk 8

The dump is what ``launch/pretrain_gpt_r3.py --rollout-dump`` trains on with
routing replay. The model flags describe the trainer's model, as the launcher's
flags do (``--moe-layer-freq``: an int N, or one 0/1 per layer); every route is
checked against them. One sample per completion: the prompt and the completion's
tokens, loss mask 1 on the completion, the engine's log-prob of every token (0
where it gave none), the engine's routes (validated by
:mod:`megatron_r3.dataplane.engines.adapters`: the final sampled token and capture gaps have no
route, dense-layer rows are dropped) and ``meta`` ``{"engine", "request_id",
"completion_index", "finish_reason", "reward"}``. An RL loop that runs the engine
in-process uses :mod:`megatron_r3.dataplane.engines.engine_samples` directly, on the engine's own
objects; this tool reads the same fields from JSON.

Input, one JSON object per line:

``--engine vllm``: a ``RequestOutput`` (``LLM(..., enable_return_routed_experts=True)``,
``SamplingParams(logprobs=0)`` or more) as a dict of the same field names::

    {"request_id": "r0",
     "prompt_token_ids": [151644, 872, ...],
     "prompt_logprobs": null,
     "outputs": [{"index": 0,
                  "token_ids": [9707, 11, ...],
                  "logprobs": [{"9707": {"logprob": -0.31, "rank": 1, "decoded_token": "Hello"}}, ...],
                  "routed_experts": {"dtype": "int32", "shape": [T - 1, 48, 8], "base64": "..."},
                  "finish_reason": "stop",
                  "reward": 1.0}]}

* a ``Logprob`` is ``{"logprob": float, "rank": int, "decoded_token": str}`` (only
  ``logprob`` is read), keyed by the token id as a string (JSON keys are strings);
  ``logprobs`` holds one such dict per generated token, ``prompt_logprobs`` is null
  or ``[null, {...}, ...]`` with one entry per prompt token;
* ``routed_experts`` (``np.int32 [T - 1, num_hidden_layers, topk]``, T = prompt +
  completion tokens) is ``{"dtype", "shape", "base64"}`` (the array's little-endian
  bytes, base64) or nested lists; null when the engine returned none (refused);
* ``reward`` (per completion) is optional; any other field is ignored.

* ``routed_experts`` may also be base64 of the array's ``.npy`` bytes (vLLM's OpenAI form).
  vLLM 0.33 returns ``[T - 1 - start, num_hidden_layers, topk]`` in uint8 (up to 256 experts),
  uint16 (up to 65536) or int32, starting at the request's ``routed_experts_prompt_start``
  (``start``; give it as the line's ``"routed_experts_prompt_start"``, default 0: vLLM does
  not echo it); vLLM before 0.21 returns int32 from token 0. The dtype tells which.

vLLM's split layout (0.21-0.32, ``AuxOutputConfig(enable_return_routed_experts=True)``): the
request also has ``"prompt_routed_experts"`` (``[prompt_len - start, num_moe_layers,
topk]``, int16 or uint8, same array forms; the key present, even null, selects this
layout) and optionally ``"routed_experts_prompt_start"``; each completion's
``routed_experts`` is ``[gen_len - 1, num_moe_layers, topk]`` (a build that keeps every
decoder layer is told by the layer count).

:func:`request_output_to_json` writes any of these from a real ``RequestOutput``. A line
may instead hold vLLM's ``/v1/completions`` response (0.33; request ``return_token_ids=True``,
``logprobs`` 0 or more), told by its ``choices``: ``{"response": {"id", "choices": [{"index",
"token_ids", "prompt_token_ids", "logprobs": {"token_logprobs": [...]}, "routed_experts":
"<base64 .npy>", "finish_reason"}]}, "routed_experts_prompt_start": 0, "reward": [1.0]}``
(``input_ids`` may replace ``prompt_token_ids``; ``reward`` one per choice).

``--engine sglang``: one prompt's ``/generate`` result (server
``--enable-return-routed-experts``, request ``return_logprob=True``,
``return_routed_experts=True``)::

    {"input_ids": [151644, 872, ...],
     "response": {"text": "...", "output_ids": [9707, 11, ...],
                  "meta_info": {"id": "5f1c...", "prompt_tokens": 42, "completion_tokens": 17,
                                "routed_experts": "<base64 int32 [T - 1, num_layers, topk]>",
                                "output_token_logprobs": [[-0.31, 9707, null], ...],
                                "input_token_logprobs": [[null, 151644, null], ...], ...}},
     "reward": 1.0}

* ``response`` is the server's JSON as returned: one response dict, or the list
  of ``n`` response dicts it returns for ``sampling_params.n > 1`` (then ``reward``,
  if given, is a list of ``n``);
* ``meta_info`` may carry ``routed_experts_dtype`` (``int32``, ``uint16``, ``uint8``: the
  compact wire format of sglang #31219; int32 when absent);
* ``routed_experts_start_len`` (optional, default 0) is the request's: the routes start at
  that token, earlier ones have none (SGLang does not echo it in the response);
* ``input_ids`` is the request's prompt token ids. SGLang does not return them
  unless asked: without ``input_ids`` the prompt comes from the response's
  ``prompt_token_ids`` (request ``return_prompt_token_ids=True``) or from
  ``input_token_logprobs`` when it covers the whole prompt (``logprob_start_len=0``);
  otherwise the line is refused. ``input_token_logprobs`` covering only the end of
  the prompt (``logprob_start_len > 0``) gives those tokens' log-probs, the others are 0.

``response`` may instead be a ``/v1/completions`` response (told by its ``choices``; request
``return_routed_experts=True``, ``return_token_ids=True``, ``logprobs`` 0 or more, ``n=1``)::

    {"routed_experts_start_len": 0,
     "response": {"id": "cmpl-5f1c", "object": "text_completion",
                  "choices": [{"index": 0, "text": "...", "token_ids": [9707, 11, ...],
                               "prompt_token_ids": [151644, 872, ...],
                               "logprobs": {"token_logprobs": [-0.31, ...], ...},
                               "finish_reason": "length"}],
                  "sglext": {"routed_experts": "<base64 [T - 1, num_layers, topk]>",
                             "routed_experts_dtype": "uint8"}},
     "reward": 1.0}

* ``sglext`` is the response's (SGLang fills it from the first choice only, so a
  response of several choices is refused); ``routed_experts_dtype`` as above;
* ``token_logprobs`` has one entry per completion token, or with ``echo`` one per
  prompt token first; ``input_ids`` may replace ``prompt_token_ids``.

``--engine megatron``: Megatron's inference engine (0.19), one ``/v1/completions``
response of its text-generation server, or one finished request as serialised::

    {"response": {"id": "...", "choices": [{"index": 0,
                   "prompt_token_ids": [...], "generation_token_ids": [...],
                   "generation_log_probs": [-0.31, ...],
                   "moe_topk_indices": [[[3, 17], ...], ...],
                   "prompt_moe_topk_indices": [...], "finish_reason": "length"}]},
     "reward": [1.0]}

* ``moe_topk_indices`` is ``routing_indices``, int32 ``[T - 1, num_moe_layers, topk]``, as
  nested lists, ``{"data", "dtype"}`` or ``["ndarray", {"data", "dtype"}]`` (Megatron's
  serialised array); ``prompt_moe_topk_indices`` is optional and checked against it;
* ``response`` without ``choices`` is one choice or one serialised request
  (``prompt_tokens``, ``generated_tokens``, ``generated_log_probs``, ``routing_indices``);
  ``reward`` is a number, or a list with one per choice.

``--engine trtllm``: a TensorRT-LLM ``GenerationResult`` (``SamplingParams(return_routed_experts=True,
logprobs=0)``) as :func:`generation_result_to_json` writes it::

    {"request_id": 3, "prompt_token_ids": [...],
     "outputs": [{"index": 0, "token_ids": [...], "logprobs": [-0.31, ...],
                  "routed_experts": {"dtype": "int16", "shape": [T - 1, num_moe_layers, topk], "base64": "..."},
                  "finish_reason": "stop", "reward": 1.0}]}

* ``logprobs`` per generated token: a number, or vLLM-style ``{"<token id>": {"logprob": ...}}``;
* ``routed_experts`` (``CompletionOutput.routed_experts``) in any array form above; a row of -1
  is TensorRT-LLM's missing route (that token routes live).

Every engine's line may also carry:

* ``"retracted_at"``: the sample lengths (prompt plus tokens generated so far) at which the
  engine retracted the request and later recomputed it. The engines return the
  recomputing pass's routes with the first pass's log-probs and mark nothing, so a line
  retracted after its first generated token is refused (miles #3277); the rollout loop
  knows when it retracted (``pause_generation(mode="retract")``) and says so here;
* ``"turns"``: instead of one request, the lines of one multi-turn rollout in order, each
  in the engine's line format and giving one sample; every turn's tokens must start with
  the previous turn's. They become one sample: the last turn's tokens, the loss on every
  turn's completion, each token's log-prob and route from the turn that first ran it;
  tokens a later turn routed differently are counted (``meta["rerouted_tokens"]``, and the
  summary line). ``reward`` beside ``turns`` is the rollout's.

MTP: with ``--mtp-num-layers N`` the model has N MTP depths, MoE where its last decoder layer
is (Megatron's GPT builder gives each depth that layer's spec), numbered ``num-layers + k``.
Megatron's engine keeps one ``RouterReplay`` per MoE router, the MTP block's after the
decoder's, so its routes may hold one more row group: the dump then covers the MTP layers
too, and the trainer replays them there. The other engines capture the decoder only: their
routes leave the MTP layers to the live router, and the summary line says for how many
tokens. A dump covers one set of layers: a line whose routes cover other layers than the
first line's is refused.

Progress goes to stderr every ``--log-interval`` samples (samples, tokens, the
fraction of tokens with a route). Refused, with the input line, the request, the
sample and the field named, and no traceback: a line that is not UTF-8 JSON, a
field of the wrong JSON type, a token id that is not an integer (``5.0`` is
refused, not truncated) or lies outside ``[0, --vocab-size)`` (``[0, 2**31)``
without it), a log-prob that is not a number, not finite or above 0, a reward
that is not a finite number, a request without completions, a completion
without tokens, routes that do not fit the model, and an input with no sample at
all. The output is written under a temporary name next to ``--out`` and renamed
once complete, so an error leaves no output file behind; an ``--out`` that is the
input is refused, and an existing one unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import stat
import sys
from types import SimpleNamespace
from typing import Any, Iterator, Optional, TextIO

import numpy as np

from megatron_r3.dataplane.engines.adapters import route_array
from megatron_r3.dataplane.engines.engine_samples import (
    megatron_sample,
    sglang_openai_sample,
    sglang_samples,
    trtllm_samples,
    vllm_openai_samples,
    vllm_samples,
)
from megatron_r3.dataplane.engines.multi_turn import merge_turns
from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
from megatron_r3.dataplane.formats.jsonl import json_line
from megatron_r3.dataplane.formats.line_placeholders import parse_cut_line
from megatron_r3.dataplane.formats.logprob_positions import LOGPROB_KEYS, LogprobPositions, logprob_position_cuts
from megatron_r3.dataplane.formats.output_files import atomic_output
from megatron_r3.dataplane.formats.route_lists import parse_route_lists
from megatron_r3.dataplane.formats.route_strings import ROUTE_STRING_KEYS, route_string_cuts
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.sample_checks import loss_number
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.layers.moe_layers import model_moe_layers, mtp_moe_layers, parse_moe_layer_freq


class InputLineError(ValueError):
    """A JSONL line that is not in the documented format."""


def request_output_to_json(request_output: Any, rewards: Optional[list] = None) -> dict:
    """A vLLM ``RequestOutput`` as one line of ``--engine vllm`` input (``json.dumps`` it).

    Args:
        request_output: The ``RequestOutput``.
        rewards: Optional reward per completion, in ``outputs`` order.
    """
    outputs = []
    split = hasattr(request_output, "prompt_routed_experts")
    for i, completion in enumerate(request_output.outputs):
        out = {
            "index": completion.index,
            "token_ids": [int(t) for t in completion.token_ids],
            "logprobs": None if completion.logprobs is None else [_positions_json(p) for p in completion.logprobs],
            "routed_experts": None if completion.routed_experts is None else _array_json(completion.routed_experts),
            "finish_reason": completion.finish_reason,
        }
        if rewards is not None:
            out["reward"] = rewards[i]
        outputs.append(out)
    prompt_logprobs = request_output.prompt_logprobs
    out = {
        "request_id": request_output.request_id,
        "prompt_token_ids": [int(t) for t in request_output.prompt_token_ids],
        "prompt_logprobs": None if prompt_logprobs is None else [_positions_json(p) for p in prompt_logprobs],
        "outputs": outputs,
    }
    if split:
        prompt_routes = request_output.prompt_routed_experts
        out["prompt_routed_experts"] = None if prompt_routes is None else _array_json(prompt_routes)
    return out


def generation_result_to_json(result: Any, rewards: Optional[list] = None) -> dict:
    """A TensorRT-LLM ``GenerationResult`` as one line of ``--engine trtllm`` input (``json.dumps`` it).

    Args:
        result: The ``GenerationResult`` (``prompt_token_ids``, ``id``, ``outputs``).
        rewards: Optional reward per completion, in ``outputs`` order.
    """
    outputs = []
    for i, completion in enumerate(result.outputs):
        routed = getattr(completion, "routed_experts", None)
        if routed is None:
            routed = (getattr(completion, "additional_generation_outputs", None) or {}).get("routed_experts")
        logprobs = completion.logprobs
        out = {
            "index": completion.index,
            "token_ids": [int(t) for t in completion.token_ids],
            "logprobs": None if logprobs is None else [
                _positions_json(p) if isinstance(p, dict) else float(p) for p in logprobs],
            "routed_experts": None if routed is None else _array_json(routed),
            "finish_reason": completion.finish_reason,
        }
        if rewards is not None:
            out["reward"] = rewards[i]
        outputs.append(out)
    return {"request_id": getattr(result, "request_id", getattr(result, "id", None)),
            "prompt_token_ids": [int(t) for t in result.prompt_token_ids], "outputs": outputs}


def vllm_line_samples(record: dict, spec: RoutingSpec, vocab_size: Optional[int] = None) -> list[RolloutSample]:
    """The samples of one ``--engine vllm`` line (a parsed JSON object): a ``RequestOutput`` in any of
    vLLM's layouts, or a ``/v1/completions`` response."""
    prompt_start = _line_int(record, "routed_experts_prompt_start", "vLLM line")
    retracted_at = _retracted_at(record)
    response = record.get("response")
    if isinstance(response, dict) and "choices" in response:  # /v1/completions, told by its field
        reward = record.get("reward")
        return vllm_openai_samples(response, record.get("input_ids"), spec,
                                   rewards=None if reward is None else reward if isinstance(reward, list) else [reward],
                                   vocab_size=vocab_size, prompt_start=prompt_start, retracted_at=retracted_at)
    request, rewards = _request(record, "vLLM request")
    if "prompt_routed_experts" in record:  # vLLM's split layout, told by the field, not by shapes
        request.prompt_routed_experts = _array(record["prompt_routed_experts"], "prompt_routed_experts")
    return vllm_samples(request, spec, rewards=rewards, vocab_size=vocab_size, prompt_start=prompt_start,
                        retracted_at=retracted_at)


def trtllm_line_samples(record: dict, spec: RoutingSpec, vocab_size: Optional[int] = None) -> list[RolloutSample]:
    """The samples of one ``--engine trtllm`` line (a parsed JSON object)."""
    request, rewards = _request(record, "TensorRT-LLM result")
    return trtllm_samples(request, spec, rewards=rewards, vocab_size=vocab_size, retracted_at=_retracted_at(record))


def _request(record: dict, what: str) -> tuple[SimpleNamespace, list]:
    """A request line's ``request_id``, ``prompt_token_ids``, ``prompt_logprobs`` and ``outputs`` as the engine's
    objects, and the reward of each output."""
    request = SimpleNamespace(
        request_id=record.get("request_id"),
        prompt_token_ids=_field(record, "prompt_token_ids", what, list),
        prompt_logprobs=_positions(_field(record, "prompt_logprobs", what, list, required=False),
                                   "prompt_logprobs"),
        outputs=[],
    )
    rewards = []
    for position, out in enumerate(_field(record, "outputs", what, list)):
        where = f"{what} {request.request_id!r} outputs[{position}]"
        if not isinstance(out, dict):
            raise InputLineError(f"{where} must be a JSON object, got {_json_type(out)}")
        index = out.get("index", position)
        if isinstance(index, bool) or not isinstance(index, int):
            raise InputLineError(f"{where}.index must be an integer, got {_json_type(index)}")
        logprobs = out.get("logprobs")
        if isinstance(logprobs, LogprobPositions):  # read by the scanner; its text by the general path if need be
            logprobs = logprobs.with_general(lambda value, what=f"{where}.logprobs": _positions(value, what))
        else:
            logprobs = _field(out, "logprobs", where, list, required=False)
            if logprobs and not isinstance(logprobs[0], (int, float)):  # per position {token_id: Logprob}
                logprobs = _positions(logprobs, f"{where}.logprobs")
        request.outputs.append(SimpleNamespace(
            index=index,
            token_ids=_field(out, "token_ids", where, list),
            logprobs=logprobs,
            routed_experts=_array(out.get("routed_experts"), f"{where}.routed_experts"),
            finish_reason=out.get("finish_reason"),
        ))
        rewards.append(out.get("reward"))
    return request, rewards


def sglang_line_samples(record: dict, spec: RoutingSpec, vocab_size: Optional[int] = None) -> list[RolloutSample]:
    """The samples of one ``--engine sglang`` line (a parsed JSON object): ``/generate`` or ``/v1/completions``."""
    response = _field(record, "response", "SGLang line", (dict, list))
    start_len = _line_int(record, "routed_experts_start_len", "SGLang line")
    retracted_at = _retracted_at(record)
    reward = record.get("reward")
    if isinstance(response, dict) and "choices" in response:  # /v1/completions, told by its field
        return [sglang_openai_sample(response, record.get("input_ids"), spec, reward=reward, vocab_size=vocab_size,
                                     start_len=start_len, retracted_at=retracted_at)]
    responses = response if isinstance(response, list) else [response]
    rewards = None if reward is None else (reward if isinstance(reward, list) else [reward])
    return sglang_samples(responses, record.get("input_ids"), spec, rewards=rewards, vocab_size=vocab_size,
                          start_len=start_len, retracted_at=retracted_at)


def megatron_line_samples(record: dict, spec: RoutingSpec, vocab_size: Optional[int] = None) -> list[RolloutSample]:
    """The samples of one ``--engine megatron`` line (a parsed JSON object)."""
    response = _field(record, "response", "Megatron line", dict)
    if "choices" in response:
        choices = _field(response, "choices", "Megatron response", list)
        if not choices:
            raise InputLineError(f"Megatron response {response.get('id')!r} has no choices")
    else:
        choices = [response]
    reward = record.get("reward")
    rewards = reward if isinstance(reward, list) else [reward] * len(choices)
    if len(rewards) != len(choices):
        raise InputLineError(f"{len(rewards)} rewards for {len(choices)} Megatron choices")
    retracted_at = _retracted_at(record)
    samples = []
    for position, (choice, choice_reward) in enumerate(zip(choices, rewards)):
        if not isinstance(choice, dict):
            raise InputLineError(f"Megatron choices[{position}] must be a JSON object, got {_json_type(choice)}")
        if "id" in response and "request_id" not in choice:
            choice = {**choice, "request_id": response["id"]}
        index = choice.get("index", position)
        if isinstance(index, bool) or not isinstance(index, int):
            raise InputLineError(f"Megatron choices[{position}].index must be an integer, got {_json_type(index)}")
        samples.append(megatron_sample(choice, spec, reward=choice_reward, completion_index=index,
                                       vocab_size=vocab_size, retracted_at=retracted_at))
    return samples


LINE_READERS = {"vllm": vllm_line_samples, "sglang": sglang_line_samples, "trtllm": trtllm_line_samples,
                "megatron": megatron_line_samples}


def line_samples(record: dict, engine: str, spec: RoutingSpec, vocab_size: Optional[int] = None) -> tuple[list, int]:
    """The samples of one line, and how many of their tokens a later turn re-routed (a ``turns`` line)."""
    read_line = LINE_READERS[engine]
    if "turns" not in record:
        return read_line(record, spec, vocab_size), 0
    turns = _field(record, "turns", "multi-turn line", list)
    samples = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise InputLineError(f"turns[{k}] must be a JSON object, got {_json_type(turn)}")
        try:
            got = read_line(turn, spec, vocab_size)
        except ValueError as error:
            raise InputLineError(f"turns[{k}]: {error}") from error
        if len(got) != 1:
            raise InputLineError(f"turns[{k}] gives {len(got)} samples; a turn of a rollout is one completion")
        samples.append(got[0])
    request_id = samples[0].meta.get("request_id") if samples else None
    where = f"request {request_id!r} ({len(samples)} turns)"
    merged = merge_turns(samples, where)
    if record.get("reward") is not None:
        merged.sample.meta["reward"] = loss_number(record["reward"], where, "reward")
    return [merged.sample], merged.rerouted_tokens


def dump_jsonl(
    input_path: str, out_path: str, engine: str, spec: RoutingSpec, *, vocab_size: Optional[int] = None,
    overwrite: bool = False, log_interval: int = 1000, log: TextIO = sys.stderr,
) -> dict:
    """Converts a JSONL file into a rollout dump; returns counts.

    The dump is written under a temporary name next to ``out_path`` and renamed once
    complete (:func:`megatron_r3.dataplane.formats.output_files.atomic_output`), so a failed conversion
    leaves no file behind and never a half-written one in place of an old one.

    Args:
        vocab_size: The model's vocabulary: token ids outside it are refused (None: ids below 2**31).
        overwrite: Replace an existing ``out_path`` (refused by default).

    Returns:
        ``{"requests", "samples", "tokens", "routed_tokens", "rerouted_tokens", "mtp_live_tokens", "repeated"}``
        (``rerouted_tokens``: tokens of multi-turn lines a later turn routed differently; ``mtp_live_tokens``:
        tokens the model's MTP MoE layers route live, :meth:`RoutingSpec.mtp_live_tokens`; ``repeated``: samples
        whose request id and completion index an earlier one had; a warning names the first).

    Raises:
        InputLineError: a line that cannot be read or does not fit the model, naming
            the file, the line and (where known) the request, sample and field; an input
            without samples.
        OutputFileError: ``out_path`` is ``input_path``, or exists without ``overwrite``.
    """
    counts = {"requests": 0, "samples": 0, "tokens": 0, "routed_tokens": 0, "rerouted_tokens": 0,
              "mtp_live_tokens": 0}
    first_line: dict = {}  # (request id, completion index) -> the line that gave it
    repeats: list = []
    writer = None
    with atomic_output(out_path, inputs=[input_path], overwrite=overwrite) as partial:
        try:
            for number, record in _records(input_path, engine):
                try:
                    samples, rerouted = line_samples(record, engine, spec, vocab_size)
                    for sample in samples:
                        # The first line's routes set the dump's layers (with or without the MTP block's).
                        if writer is None:
                            writer = RolloutDumpWriter(partial, num_experts=spec.num_experts, topk=spec.topk,
                                                       layer_numbers=sample.routes.layer_numbers)
                        if sample.routes.layer_numbers != writer.layer_numbers:
                            raise RoutingValidationError(
                                f"request {sample.meta.get('request_id')!r} sample "
                                f"{sample.meta.get('completion_index')}: routes cover MoE layers "
                                f"{list(sample.routes.layer_numbers)}, earlier lines' {list(writer.layer_numbers)}: "
                                f"a dump holds one set (the engine returned MTP routes for some lines only?)")
                        writer.write(sample)
                except ValueError as error:
                    raise InputLineError(f"{input_path} line {number}: {error}") from error
                except (TypeError, IndexError, KeyError, AttributeError) as error:  # a JSON type no check names
                    raise InputLineError(
                        f"{input_path} line {number}: malformed record ({type(error).__name__}: {error})"
                    ) from error
                counts["requests"] += 1
                counts["rerouted_tokens"] += rerouted
                for sample in samples:
                    key = (json.dumps(sample.meta["request_id"]), sample.meta["completion_index"])
                    if key in first_line:
                        repeats.append((key, first_line[key], number))
                    first_line.setdefault(key, number)
                    counts["samples"] += 1
                    counts["tokens"] += len(sample.token_ids)
                    counts["routed_tokens"] += int(sample.routes.valid.sum())
                    counts["mtp_live_tokens"] += spec.mtp_live_tokens(sample.routes)
                    if log_interval and counts["samples"] % log_interval == 0:
                        print(f"dump_rollouts: {_summary(counts)}", file=log, flush=True)
            if counts["samples"] == 0:
                raise InputLineError(f"{input_path} holds no request: a dump without samples trains nothing")
        finally:
            if writer is not None:
                writer.close()
    if repeats:
        shown = ", ".join(f"request {rid} completion {index} (lines {was} and {now})"
                          for (rid, index), was, now in repeats[:3])
        print(f"dump_rollouts: warning: {input_path}: {len(repeats)} samples repeat the request id and "
              f"completion index of an earlier one: {shown}{', ...' if len(repeats) > 3 else ''}; each is in the "
              f"dump as often as it appears", file=log, flush=True)
    counts["repeated"] = len(repeats)
    return counts


def _summary(counts: dict) -> str:
    routed = counts["routed_tokens"] / max(counts["tokens"], 1)
    rerouted = f", {counts['rerouted_tokens']} tokens re-routed by a later turn" if counts["rerouted_tokens"] else ""
    mtp = (f", {counts['mtp_live_tokens']} tokens route live at the MTP MoE layers"
           if counts["mtp_live_tokens"] else "")
    return (f"{counts['samples']} samples from {counts['requests']} requests, {counts['tokens']} tokens, "
            f"routed fraction {routed:.4f}{rerouted}{mtp}")


LINE_BUFFER_BYTES = 16 << 20


def _lines(path: str) -> Iterator[bytes]:
    """The file's lines as bytes. A regular file is read through a memory map, each line one copy out of the page
    cache (a rollout line holds megabytes of routes: buffered reads copy them twice, 2.5x the time); anything else
    (a pipe, an empty file, which cannot be mapped) through a 16 MiB buffer (the default 8 KiB one gathers such a
    line in many small reads and copies).

    Raises:
        InputLineError: a mapped file found shorter than when it was mapped (truncated while being read).
    """
    with open(path, "rb", buffering=LINE_BUFFER_BYTES) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            yield from f
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            at, size = 0, len(mapped)
            while at < size:
                # A mapped page past the end of a file truncated meanwhile kills the process (SIGBUS): the size is
                # checked before each line is read, which leaves only a truncation during that line's read.
                if (now := os.fstat(f.fileno()).st_size) < size:
                    raise InputLineError(f"{path}: the file shrank from {size} to {now} bytes while being read "
                                         f"(written to by another process?)")
                end = mapped.find(b"\n", at)
                end = size if end < 0 else end + 1
                yield mapped[at:end]
                at = end


def _records(path: str, engine: str) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of every non-blank line. Megatron's nested route lists come as int32 arrays
    (:func:`megatron_r3.dataplane.formats.route_lists.parse_route_lists`); the other engines' base64 route
    strings are cut out before the JSON parse (:mod:`megatron_r3.dataplane.formats.route_strings`), and so are
    vLLM's per-position log-probs (:mod:`megatron_r3.dataplane.formats.logprob_positions`)."""
    # Bytes: a line that is not UTF-8 is named, not a UnicodeDecodeError.
    for number, raw in enumerate(_lines(path), start=1):
        where = f"{path} line {number}"

        def parse(text: bytes, where: str = where) -> object:
            return json_line(text, where, InputLineError)

        if engine == "megatron":
            record = parse_route_lists(raw, parse)
        elif engine == "vllm":
            strings = route_string_cuts(raw)
            record = parse_cut_line(raw, strings + logprob_position_cuts(raw, skip=strings),
                                    ROUTE_STRING_KEYS + LOGPROB_KEYS, parse)
        else:
            record = parse_cut_line(raw, route_string_cuts(raw), ROUTE_STRING_KEYS, parse)
        if record is None:
            continue
        if not isinstance(record, dict):
            raise InputLineError(f"{path} line {number}: a JSON object is expected, got {_json_type(record)}")
        yield number, record


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _field(record: dict, key: str, what: str, kind: Any, required: bool = True) -> Any:
    """``record[key]``, of JSON type ``kind`` (``list``: an array, ``dict``: an object); null when optional."""
    value = record.get(key)
    if value is None:
        if required:
            raise InputLineError(f"{what} has no {key!r}")
        return None
    if not isinstance(value, kind):
        expected = " or ".join(_json_type(k()) for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise InputLineError(f"{what}: {key!r} must be {expected}, got {_json_type(value)}")
    return value


def _positions(positions: Optional[list], what: str) -> Optional["JsonPositions"]:
    """JSON per-position log-probs -> vLLM's ``[{token_id: Logprob}]`` (None entries stay None).

    The positions are read lazily (:class:`JsonPositions`): the adapter looks up one token per
    position, and only that entry is read. The log-prob values are passed on as they
    are: the engine adapter checks that they are finite numbers <= 0 and names the token.
    """
    if positions is None:
        return None
    if not set(map(type, positions)) <= {dict, type(None)}:
        bad = next(i for i, p in enumerate(positions) if p is not None and not isinstance(p, dict))
        raise InputLineError(f"{what}[{bad}] must map token ids to {{\"logprob\": float, ...}}, got "
                             f"{json.dumps(positions[bad])[:200]}")
    return JsonPositions(positions, what)


class JsonPositions:
    """A line's per-position log-probs, read as vLLM's list of ``{token_id: Logprob}``: position by position
    (:class:`JsonPosition`, made when asked for), or the chosen tokens' log-probs in one pass
    (:meth:`chosen_logprobs`), without an object per position."""

    __slots__ = ("positions", "what", "first")

    def __init__(self, positions: list, what: str, first: int = 0):
        self.positions, self.what, self.first = positions, what, first

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, _, step = index.indices(len(self.positions))
            if step != 1:
                raise ValueError("JSON positions are sliced with step 1 only")
            return JsonPositions(self.positions[index], self.what, self.first + start)
        number = range(len(self.positions))[index]
        position = self.positions[number]
        return None if position is None else JsonPosition(position, self.what, self.first + number)

    def __iter__(self) -> Iterator[Optional["JsonPosition"]]:
        return (self[i] for i in range(len(self.positions)))

    def chosen_logprobs(self, tokens: list) -> Optional[list]:
        """Each position's ``logprob`` for its token in ``tokens`` (as the line gives it), or None where a
        position is null, lacks the token or its entry is not ``{"logprob": ...}``: position by position then
        names the fault."""
        try:
            return [position[str(token)]["logprob"] for position, token in zip(self.positions, tokens)]
        except (TypeError, KeyError):
            return None


class JsonPosition:
    """One position of a line's log-probs, ``{"<token id>": {"logprob": float, ...}}``, read as vLLM's
    ``{token_id: Logprob}``."""

    __slots__ = ("entries", "what", "index")

    def __init__(self, entries: dict, what: str, index: int):
        self.entries, self.what, self.index = entries, what, index

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, token: int) -> Optional[SimpleNamespace]:
        """The token's ``Logprob`` (its ``logprob`` as the line gives it), or None."""
        entry = self.entries.get(str(token))
        if entry is None:
            return None
        if not isinstance(entry, dict) or "logprob" not in entry:
            raise InputLineError(f"{self.what}[{self.index}][{token}] must be {{\"logprob\": float, ...}}, got "
                                 f"{json.dumps(entry)[:200]}")
        return SimpleNamespace(logprob=entry["logprob"])


def _positions_json(position: Optional[dict]) -> Optional[dict]:
    if position is None:
        return None
    return {str(token): {"logprob": float(p.logprob), "rank": getattr(p, "rank", None),
                         "decoded_token": getattr(p, "decoded_token", None)} for token, p in position.items()}


def _array(value: Any, what: str) -> Optional[np.ndarray]:
    """A JSON route array in any form the engines' adapters read (:func:`route_array`); null: None."""
    if value is None:
        return None
    try:
        return route_array(value, what)
    except RoutingValidationError as error:
        raise InputLineError(str(error)) from None


def _line_int(record: dict, key: str, what: str) -> int:
    """An optional integer of the line (default 0)."""
    value = record.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputLineError(f"{what}: {key!r} must be an integer, got {_json_type(value)}")
    return value


def _retracted_at(record: dict) -> Optional[list]:
    """The line's ``retracted_at``: sample lengths at which the engine retracted the request."""
    value = _field(record, "retracted_at", "line", list, required=False)
    if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InputLineError(f"line: 'retracted_at' must be an array of integers, got {json.dumps(value)[:100]}")
    return value


def _array_json(array: Any) -> dict:
    array = np.asarray(array)
    return {"dtype": array.dtype.name, "shape": list(array.shape),
            "base64": base64.b64encode(array.astype(array.dtype.newbyteorder("<")).tobytes()).decode()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(LINE_READERS), required=True)
    parser.add_argument("--input", required=True,
                        help="JSONL file, one request (vllm, trtllm), prompt (sglang) or response (megatron) a line")
    parser.add_argument("--out", required=True, help="the rollout dump to write (not the input; see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--num-layers", type=int, required=True, help="decoder layers of the model")
    parser.add_argument("--moe-layer-freq", default="1", help="an int, or one 0/1 per layer, comma-separated")
    parser.add_argument("--num-experts", type=int, required=True)
    parser.add_argument("--moe-router-topk", type=int, required=True)
    parser.add_argument("--mtp-num-layers", type=int, default=None,
                        help="MTP depths of the model (MoE when its last decoder layer is): routes may cover them")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="refuse token ids outside [0, vocab-size) (default: only ids >= 2**31)")
    parser.add_argument("--log-interval", type=int, default=1000, help="progress every this many samples (0: off)")
    args = parser.parse_args(argv)
    if args.vocab_size is not None and args.vocab_size < 1:
        parser.error(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.log_interval < 0:
        parser.error(f"--log-interval must be >= 0, got {args.log_interval}")
    if args.mtp_num_layers is not None and args.mtp_num_layers < 1:
        parser.error(f"--mtp-num-layers must be >= 1, got {args.mtp_num_layers}")
    try:
        moe_layers = model_moe_layers(args.num_layers, parse_moe_layer_freq(args.moe_layer_freq))
        spec = RoutingSpec(num_layers=args.num_layers, model_moe_layers=moe_layers, num_experts=args.num_experts,
                           topk=args.moe_router_topk,
                           mtp_moe_layers=mtp_moe_layers(args.num_layers, moe_layers, args.mtp_num_layers))
    except ValueError as error:
        parser.error(str(error))
    try:
        counts = dump_jsonl(args.input, args.out, args.engine, spec, vocab_size=args.vocab_size,
                            overwrite=args.overwrite, log_interval=args.log_interval, log=sys.stderr)
    except (ValueError, OSError) as error:  # InputLineError, OutputFileError, an unreadable input
        print(f"dump_rollouts: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {_summary(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
