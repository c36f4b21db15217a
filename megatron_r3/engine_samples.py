"""Rollout samples from what vLLM and SGLang return: tokens, loss mask, log-probs and routes.

An RL loop that runs the rollout engine in-process hands the engine's own
objects to these functions and writes the result with
:class:`~megatron_r3.rollout_dump.RolloutDumpWriter` (or feeds it to the
trainer directly). They read the engines' documented fields only (duck-typed),
so real vLLM objects, SGLang response dicts and look-alikes all work:

* vLLM (``LLM(..., enable_return_routed_experts=True)``, ``SamplingParams(logprobs=0)``
  or more; ``prompt_logprobs`` optional): a ``RequestOutput`` with ``request_id``,
  ``prompt_token_ids``, ``prompt_logprobs`` (None, or a list whose first entry is
  None, then per prompt token a dict ``token_id -> Logprob``) and ``outputs``,
  a list of ``CompletionOutput`` with ``index``, ``token_ids``, ``logprobs`` (per
  generated token a dict ``token_id -> Logprob``; a list or vLLM's ``FlatLogprobs``),
  ``routed_experts`` and ``finish_reason``. A ``Logprob`` is anything with ``.logprob``.
* SGLang (server ``--enable-return-routed-experts``, request ``return_logprob=True``
  and ``return_routed_experts=True``): the ``/generate`` response dict, ``output_ids``
  and ``meta_info`` with ``routed_experts``, ``output_token_logprobs``,
  ``input_token_logprobs``, ``prompt_tokens``, ``completion_tokens`` and ``id``.
  The response does not repeat the prompt: SGLang tokenises it (or takes the
  request's ``input_ids``) on the server. The caller passes the request's
  ``input_ids``; without them the prompt ids come from the response's
  ``prompt_token_ids`` (request ``return_prompt_token_ids=True``) or from
  ``input_token_logprobs`` when it covers the whole prompt (request
  ``logprob_start_len=0``), else the sample is refused.

One sample per completion (vLLM ``n > 1``: ``n`` samples): ``token_ids`` =
prompt + completion, ``loss_mask`` 1 on the completion, ``logprobs[t]`` the
engine's log-prob of token t (0 where the engine gave none: the first prompt
token, prompt tokens without prompt log-probs), routes from
:mod:`megatron_r3.adapters` (validated: the final sampled token and capture gaps
have no route, dense-layer rows are dropped), ``meta`` = ``{"engine",
"request_id", "completion_index", "finish_reason", "reward"}`` (reward only when
given). A completion without log-probs is refused: the trainer's importance
ratios need them. Errors are :class:`RoutingValidationError` naming the request
and the sample (``request 'r1' sample 1: ...``, sample = completion index).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from megatron_r3.adapters import RoutingSpec, from_sglang, from_vllm
from megatron_r3.rollout_dump import RolloutSample
from megatron_r3.validation import RoutingValidationError


def vllm_samples(
    request_output: Any, spec: RoutingSpec, *, rewards: Optional[Sequence[Optional[float]]] = None
) -> list[RolloutSample]:
    """One sample per completion of a vLLM ``RequestOutput``.

    Args:
        request_output: The ``RequestOutput`` (see the module docstring for the fields read).
        spec: The trainer's model.
        rewards: Optional reward per completion, in ``request_output.outputs`` order
            (a None entry: no reward for that completion).

    Returns:
        The samples, in ``outputs`` order.

    Raises:
        RoutingValidationError: missing prompt ids, log-probs or ``routed_experts``;
            log-probs that do not fit the tokens; routes that do not fit the model
            or the token count. The message names the request and the completion.
    """
    request_id = getattr(request_output, "request_id", None)
    outputs = list(request_output.outputs)
    if rewards is not None and len(rewards) != len(outputs):
        raise RoutingValidationError(
            f"request {request_id!r}: {len(rewards)} rewards for {len(outputs)} completions"
        )
    prompt = request_output.prompt_token_ids
    if prompt is None or len(prompt) == 0:
        raise RoutingValidationError(f"request {request_id!r}: no prompt_token_ids")
    prompt_logprobs = _vllm_prompt_logprobs(prompt, request_output.prompt_logprobs, request_id)
    samples = []
    for position, completion in enumerate(outputs):
        index = getattr(completion, "index", position)
        where = f"request {request_id!r} sample {index}"
        token_ids = list(completion.token_ids)
        if completion.logprobs is None:
            raise RoutingValidationError(
                f"{where}: vLLM returned no logprobs (sample with SamplingParams(logprobs=0) or more)"
            )
        generated = _chosen_logprobs(completion.logprobs, token_ids, where, "logprobs", first=0)
        with _named(request_id):
            routes = from_vllm(completion, spec, num_tokens=len(prompt) + len(token_ids), sample=index)
        samples.append(_sample(
            prompt, token_ids, prompt_logprobs, generated, routes,
            _meta("vllm", request_id, index, getattr(completion, "finish_reason", None),
                  None if rewards is None else rewards[position]),
        ))
    return samples


def sglang_sample(
    response: dict,
    input_ids: Optional[Sequence[int]],
    spec: RoutingSpec,
    *,
    reward: Optional[float] = None,
    completion_index: int = 0,
) -> RolloutSample:
    """The sample of one SGLang ``/generate`` response (one completion).

    Args:
        response: The response dict as the server returns it (``output_ids``, ``meta_info``).
        input_ids: The request's prompt token ids; None: taken from the response's
            ``prompt_token_ids`` or a whole-prompt ``input_token_logprobs``.
        spec: The trainer's model.
        reward: Optional reward of this completion.
        completion_index: Which of the request's ``n`` completions this is (for ``meta``).

    Raises:
        RoutingValidationError: as :func:`vllm_samples`, and prompt ids that do not
            fit ``meta_info["prompt_tokens"]`` or the ids in ``input_token_logprobs``.
    """
    meta_info = response.get("meta_info")
    if not isinstance(meta_info, dict):
        raise RoutingValidationError("SGLang response has no meta_info")
    request_id = meta_info.get("id")
    where = f"request {request_id!r} sample {completion_index}"
    if "output_ids" not in response:
        raise RoutingValidationError(f"{where}: SGLang response has no output_ids")
    output_ids = [int(t) for t in response["output_ids"]]
    prompt = _sglang_prompt(response, meta_info, input_ids, where)
    _check_count(meta_info, "prompt_tokens", len(prompt), "prompt ids", where)
    _check_count(meta_info, "completion_tokens", len(output_ids), "output_ids", where)
    if meta_info.get("output_token_logprobs") is None:
        raise RoutingValidationError(f"{where}: SGLang meta_info has no output_token_logprobs (return_logprob=True?)")
    generated = _sglang_logprobs(meta_info["output_token_logprobs"], output_ids, where, "output_token_logprobs")
    prompt_logprobs = np.zeros(len(prompt), np.float32)
    entries = meta_info.get("input_token_logprobs") or []
    if len(entries) > len(prompt):
        raise RoutingValidationError(
            f"{where}: input_token_logprobs has {len(entries)} entries for a prompt of {len(prompt)} tokens"
        )
    # Entries cover the prompt from logprob_start_len on, i.e. its last len(entries) tokens.
    prompt_logprobs[len(prompt) - len(entries):] = _sglang_logprobs(
        entries, prompt[len(prompt) - len(entries):], where, "input_token_logprobs"
    )
    with _named(request_id):
        routes = from_sglang(meta_info, spec, num_tokens=len(prompt) + len(output_ids), sample=completion_index)
    return _sample(prompt, output_ids, prompt_logprobs, generated, routes,
                   _meta("sglang", request_id, completion_index, meta_info.get("finish_reason"), reward))


def sglang_samples(
    responses: Sequence[dict],
    input_ids: Optional[Sequence[int]],
    spec: RoutingSpec,
    *,
    rewards: Optional[Sequence[float]] = None,
) -> list[RolloutSample]:
    """The samples of the ``n`` responses SGLang returns for one prompt (``sampling_params.n``).

    Args:
        responses: The response dicts, in the order the server returned them.
        input_ids: The request's prompt token ids (see :func:`sglang_sample`).
        spec: The trainer's model.
        rewards: Optional reward per response.
    """
    if rewards is not None and len(rewards) != len(responses):
        raise RoutingValidationError(f"{len(rewards)} rewards for {len(responses)} SGLang responses")
    return [
        sglang_sample(response, input_ids, spec, reward=None if rewards is None else rewards[i], completion_index=i)
        for i, response in enumerate(responses)
    ]


@contextmanager
def _named(request_id: Any) -> Iterator[None]:
    """Prefixes the request id to an adapter's :class:`RoutingValidationError`."""
    try:
        yield
    except RoutingValidationError as error:
        raise RoutingValidationError(f"request {request_id!r} {error}") from error


def _vllm_prompt_logprobs(prompt: Sequence[int], prompt_logprobs: Any, request_id: Any) -> np.ndarray:
    """Prompt log-probs per prompt token; 0 for the first one, and all 0 when none were asked for."""
    if prompt_logprobs is None:
        return np.zeros(len(prompt), np.float32)
    where = f"request {request_id!r}"
    if len(prompt_logprobs) != len(prompt):
        raise RoutingValidationError(
            f"{where}: prompt_logprobs has {len(prompt_logprobs)} entries for {len(prompt)} prompt tokens"
        )
    if prompt_logprobs[0]:  # None in a list, an empty position in vLLM's FlatLogprobs
        raise RoutingValidationError(f"{where}: prompt_logprobs[0] must be empty (the first token has no log-prob)")
    out = np.zeros(len(prompt), np.float32)
    out[1:] = _chosen_logprobs(prompt_logprobs[1:], list(prompt[1:]), where, "prompt_logprobs", first=1)
    return out


def _chosen_logprobs(positions: Any, token_ids: Sequence[int], where: str, field: str, first: int) -> np.ndarray:
    """The log-prob of each chosen token from vLLM's per-position ``{token_id: Logprob}`` dicts."""
    if len(positions) != len(token_ids):
        raise RoutingValidationError(f"{where}: {field} has {len(positions)} positions for {len(token_ids)} tokens")
    out = np.empty(len(token_ids), np.float32)
    for i, (position, token) in enumerate(zip(positions, token_ids)):
        entry = None if position is None else position.get(int(token))
        if entry is None:
            raise RoutingValidationError(
                f"{where}: {field}[{i + first}] has no entry for token {int(token)}, the token at that position"
            )
        out[i] = entry.logprob
    return out


def _sglang_prompt(response: dict, meta_info: dict, input_ids: Optional[Sequence[int]], where: str) -> list[int]:
    """The prompt ids: the caller's, else the response's own when it carries them whole."""
    if input_ids is not None:
        return [int(t) for t in input_ids]
    if response.get("prompt_token_ids") is not None:
        return [int(t) for t in response["prompt_token_ids"]]
    entries = meta_info.get("input_token_logprobs") or []
    if "prompt_tokens" in meta_info and len(entries) == int(meta_info["prompt_tokens"]) > 0:
        return [int(entry[1]) for entry in entries]
    raise RoutingValidationError(
        f"{where}: the prompt ids are unknown: pass the request's input_ids, or request "
        f"return_prompt_token_ids=True or logprob_start_len=0 so that the response carries them"
    )


def _sglang_logprobs(entries: Sequence, token_ids: Sequence[int], where: str, field: str) -> np.ndarray:
    """Log-probs from SGLang's ``(logprob, token_id, text)`` entries; a None log-prob is 0."""
    if len(entries) != len(token_ids):
        raise RoutingValidationError(f"{where}: {field} has {len(entries)} entries for {len(token_ids)} tokens")
    out = np.zeros(len(token_ids), np.float32)
    for i, (entry, token) in enumerate(zip(entries, token_ids)):
        if int(entry[1]) != int(token):
            raise RoutingValidationError(
                f"{where}: {field}[{i}] is for token {int(entry[1])}, the sample has token {int(token)} there"
            )
        if entry[0] is not None:
            out[i] = entry[0]
    return out


def _check_count(meta_info: dict, key: str, count: int, what: str, where: str) -> None:
    if key in meta_info and int(meta_info[key]) != count:
        raise RoutingValidationError(f"{where}: {count} {what}, but meta_info[{key!r}] = {meta_info[key]}")


def _meta(engine: str, request_id: Any, index: int, finish_reason: Any, reward: Optional[float]) -> dict:
    meta = {"engine": engine, "request_id": request_id, "completion_index": int(index),
            "finish_reason": finish_reason}
    if reward is not None:
        meta["reward"] = float(reward)
    return meta


def _sample(prompt, completion, prompt_logprobs, generated, routes, meta) -> RolloutSample:
    return RolloutSample(
        token_ids=np.asarray(list(prompt) + list(completion), dtype=np.int32),
        loss_mask=np.arange(len(prompt) + len(completion)) >= len(prompt),
        logprobs=np.concatenate([prompt_logprobs, generated]).astype(np.float32),
        routes=routes,
        meta=meta,
    )
