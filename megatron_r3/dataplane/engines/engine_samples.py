"""Rollout samples from what the engines return (vLLM, SGLang, TensorRT-LLM, Megatron): tokens, loss mask, log-probs, routes.

An RL loop that runs the rollout engine in-process hands the engine's own
objects to these functions and writes the result with
:class:`~megatron_r3.dataplane.formats.dump_writer.RolloutDumpWriter` (or feeds it to the
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
  ``logprob_start_len=0``), else the sample is refused. The request's
  ``routed_experts_start_len`` (SGLang does not echo it) is passed as ``start_len``.
* SGLang's ``/v1/completions`` (request ``return_routed_experts=True``,
  ``return_token_ids=True``, ``logprobs`` 0 or more, ``n=1``): the response dict, its
  first choice's ``token_ids``, ``prompt_token_ids`` and ``logprobs.token_logprobs``, and
  the response's ``sglext`` (:func:`sglang_openai_sample`).

* vLLM's ``/v1/completions`` (0.33; request ``return_token_ids=True``, ``logprobs`` 0 or
  more): one sample per choice, each with its own ``routed_experts`` (base64 ``.npy``)
  (:func:`vllm_openai_samples`).
* TensorRT-LLM (``LlmArgs.enable_return_routed_experts``, ``SamplingParams(return_routed_experts=True,
  logprobs=0)``): a ``GenerationResult`` (:func:`trtllm_samples`).
* Megatron's inference engine (0.19): a finished ``DynamicInferenceRequest`` or a
  choice of its ``/v1/completions`` response (:func:`megatron_sample`).

vLLM's split layout (``RequestOutput.prompt_routed_experts`` plus per completion
``routed_experts``, 0.21-0.32) is recognised by the request's ``prompt_routed_experts``
attribute; a request without it is vLLM 0.33's or the one before 0.21, told by the
routes' dtype (:func:`~megatron_r3.dataplane.engines.adapters.from_vllm`).

A request the engine retracted and recomputed after it had sampled tokens returns
routes and log-probs of different passes; nothing in what it returns says so, so the
caller passes ``retracted_at`` and such a sample is refused (:func:`check_retractions`).

One sample per completion (vLLM ``n > 1``: ``n`` samples): ``token_ids`` =
prompt + completion, ``loss_mask`` 1 on the completion, ``logprobs[t]`` the
engine's log-prob of token t (0 where the engine gave none: the first prompt
token, prompt tokens without prompt log-probs), routes from
:mod:`megatron_r3.dataplane.engines.adapters` (validated: the final sampled token and capture gaps
have no route, dense-layer rows are dropped), ``meta`` = ``{"engine",
"request_id", "completion_index", "finish_reason", "reward"}`` (reward only when
given). A completion without log-probs is refused: the trainer's importance
ratios need them. So is a request without completions and a completion without
tokens (nothing to train on), and every number that cannot enter the loss
(:mod:`megatron_r3.dataplane.sample_checks`): token ids that are not integers (a float id
is refused, not truncated) in ``[0, vocab_size)`` (``[0, 2**31)`` without a
vocabulary), log-probs that are not numbers, not finite or above 0, rewards that
are not finite numbers; SGLang fields of the wrong JSON type are named. Errors
are :class:`RoutingValidationError` (or its sibling
:class:`~megatron_r3.dataplane.sample_checks.SampleValueError`, both ``ValueError``)
naming the request, the sample (``request 'r1' sample 1: ...``, sample =
completion index), and the field and token.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from megatron_r3.dataplane.engines.adapters import (
    from_megatron_inference,
    from_sglang,
    from_sglang_openai,
    from_trtllm,
    from_vllm,
    from_vllm_split,
)
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.sample_checks import (
    check_logprobs,
    logprob_array,
    logprob_value,
    loss_number,
    token_id_array,
)
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample


def vllm_samples(
    request_output: Any, spec: RoutingSpec, *, rewards: Optional[Sequence[Optional[float]]] = None,
    vocab_size: Optional[int] = None, prompt_start: int = 0, retracted_at: Optional[Sequence[int]] = None,
) -> list[RolloutSample]:
    """One sample per completion of a vLLM ``RequestOutput``.

    A request with a ``prompt_routed_experts`` attribute (vLLM's split layout, None or
    not) is read with :func:`~megatron_r3.dataplane.engines.adapters.from_vllm_split`; one
    without it with :func:`~megatron_r3.dataplane.engines.adapters.from_vllm` (vLLM 0.33, or
    the int32 layout before 0.21, told by the dtype).

    Args:
        request_output: The ``RequestOutput`` (see the module docstring for the fields read).
        spec: The trainer's model.
        rewards: Optional reward per completion, in ``request_output.outputs`` order
            (a None entry: no reward for that completion).
        vocab_size: The model's vocabulary, to refuse token ids outside it (None: ids below 2**31).
        prompt_start: The request's ``routed_experts_prompt_start``.
        retracted_at: See :func:`check_retractions`.

    Returns:
        The samples, in ``outputs`` order.

    Raises:
        RoutingValidationError: missing prompt ids, log-probs or ``routed_experts``;
            log-probs that do not fit the tokens; routes that do not fit the model
            or the token count. The message names the request and the completion.
    """
    request_id = getattr(request_output, "request_id", None)
    outputs = list(request_output.outputs)
    if not outputs:
        raise RoutingValidationError(f"request {request_id!r}: no completions (outputs is empty)")
    if rewards is not None and len(rewards) != len(outputs):
        raise RoutingValidationError(
            f"request {request_id!r}: {len(rewards)} rewards for {len(outputs)} completions"
        )
    prompt = request_output.prompt_token_ids
    if prompt is None or len(prompt) == 0:
        raise RoutingValidationError(f"request {request_id!r}: no prompt_token_ids")
    prompt = token_id_array(prompt, f"request {request_id!r}", "prompt_token_ids", vocab_size)
    prompt_logprobs = _vllm_prompt_logprobs(prompt, request_output.prompt_logprobs, request_id)
    samples = []
    for position, completion in enumerate(outputs):
        index = getattr(completion, "index", position)
        where = f"request {request_id!r} sample {index}"
        token_ids = _completion_ids(completion.token_ids, where, "token_ids", vocab_size)
        if completion.logprobs is None:
            raise RoutingValidationError(
                f"{where}: vLLM returned no logprobs (sample with SamplingParams(logprobs=0) or more)"
            )
        generated = _chosen_logprobs(completion.logprobs, token_ids, where, "logprobs", first=len(prompt))
        check_retractions(retracted_at, len(prompt), len(prompt) + len(token_ids), where)
        with _named(request_id):
            if hasattr(request_output, "prompt_routed_experts"):
                routes = from_vllm_split(request_output.prompt_routed_experts, completion.routed_experts, spec,
                                         prompt_len=len(prompt), completion_len=len(token_ids),
                                         prompt_start=prompt_start, sample=index)
            else:
                routes = from_vllm(completion, spec, num_tokens=len(prompt) + len(token_ids),
                                   prompt_start=prompt_start, sample=index)
        samples.append(_sample(
            prompt, token_ids, prompt_logprobs, generated, routes,
            _meta("vllm", request_id, index, getattr(completion, "finish_reason", None),
                  None if rewards is None else rewards[position], where),
        ))
    return samples


def sglang_sample(
    response: dict,
    input_ids: Optional[Sequence[int]],
    spec: RoutingSpec,
    *,
    reward: Optional[float] = None,
    completion_index: int = 0,
    vocab_size: Optional[int] = None,
    start_len: int = 0,
    retracted_at: Optional[Sequence[int]] = None,
) -> RolloutSample:
    """The sample of one SGLang ``/generate`` response (one completion).

    Args:
        response: The response dict as the server returns it (``output_ids``, ``meta_info``).
        input_ids: The request's prompt token ids; None: taken from the response's
            ``prompt_token_ids`` or a whole-prompt ``input_token_logprobs``.
        spec: The trainer's model.
        reward: Optional reward of this completion.
        completion_index: Which of the request's ``n`` completions this is (for ``meta``).
        vocab_size: The model's vocabulary, to refuse token ids outside it (None: ids below 2**31).
        start_len: The request's ``routed_experts_start_len``: tokens before it have no route.
        retracted_at: See :func:`check_retractions`.

    Raises:
        RoutingValidationError: as :func:`vllm_samples`, and prompt ids that do not
            fit ``meta_info["prompt_tokens"]`` or the ids in ``input_token_logprobs``.
    """
    if not isinstance(response, dict):
        raise RoutingValidationError(f"SGLang response must be a JSON object, got {type(response).__name__}")
    meta_info = response.get("meta_info")
    if not isinstance(meta_info, dict):
        raise RoutingValidationError("SGLang response has no meta_info")
    request_id = meta_info.get("id")
    where = f"request {request_id!r} sample {completion_index}"
    if "output_ids" not in response:
        raise RoutingValidationError(f"{where}: SGLang response has no output_ids")
    output_ids = _completion_ids(response["output_ids"], where, "output_ids", vocab_size)
    prompt = _sglang_prompt(response, meta_info, input_ids, where, vocab_size)
    _check_count(meta_info, "prompt_tokens", len(prompt), "prompt ids", where)
    _check_count(meta_info, "completion_tokens", len(output_ids), "output_ids", where)
    if meta_info.get("output_token_logprobs") is None:
        raise RoutingValidationError(f"{where}: SGLang meta_info has no output_token_logprobs (return_logprob=True?)")
    generated = _sglang_logprobs(meta_info["output_token_logprobs"], output_ids, where, "output_token_logprobs",
                                 first=len(prompt))
    prompt_logprobs = np.zeros(len(prompt), np.float32)
    entries = _sglang_entries(meta_info.get("input_token_logprobs") or [], where, "input_token_logprobs")
    if len(entries) > len(prompt):
        raise RoutingValidationError(
            f"{where}: input_token_logprobs has {len(entries)} entries for a prompt of {len(prompt)} tokens"
        )
    # Entries cover the prompt from logprob_start_len on, i.e. its last len(entries) tokens.
    start = len(prompt) - len(entries)
    prompt_logprobs[start:] = _sglang_logprobs(entries, prompt[start:], where, "input_token_logprobs", first=start)
    check_retractions(retracted_at, len(prompt), len(prompt) + len(output_ids), where)
    with _named(request_id):
        routes = from_sglang(meta_info, spec, num_tokens=len(prompt) + len(output_ids), sample=completion_index,
                             start_len=start_len)
    return _sample(prompt, output_ids, prompt_logprobs, generated, routes,
                   _meta("sglang", request_id, completion_index, meta_info.get("finish_reason"), reward, where))


def sglang_samples(
    responses: Sequence[dict],
    input_ids: Optional[Sequence[int]],
    spec: RoutingSpec,
    *,
    rewards: Optional[Sequence[float]] = None,
    vocab_size: Optional[int] = None,
    start_len: int = 0,
    retracted_at: Optional[Sequence[int]] = None,
) -> list[RolloutSample]:
    """The samples of the ``n`` responses SGLang returns for one prompt (``sampling_params.n``).

    Args:
        responses: The response dicts, in the order the server returned them.
        input_ids: The request's prompt token ids (see :func:`sglang_sample`).
        spec: The trainer's model.
        rewards: Optional reward per response.
        vocab_size: The model's vocabulary (see :func:`sglang_sample`).
        start_len: The request's ``routed_experts_start_len``.
        retracted_at: See :func:`check_retractions`.
    """
    if not responses:
        raise RoutingValidationError("no SGLang responses (the response list is empty)")
    if rewards is not None and len(rewards) != len(responses):
        raise RoutingValidationError(f"{len(rewards)} rewards for {len(responses)} SGLang responses")
    return [
        sglang_sample(response, input_ids, spec, reward=None if rewards is None else rewards[i], completion_index=i,
                      vocab_size=vocab_size, start_len=start_len, retracted_at=retracted_at)
        for i, response in enumerate(responses)
    ]


def sglang_openai_sample(
    response: dict, input_ids: Optional[Sequence[int]], spec: RoutingSpec, *, reward: Optional[float] = None,
    vocab_size: Optional[int] = None, start_len: int = 0, retracted_at: Optional[Sequence[int]] = None,
) -> RolloutSample:
    """The sample of one SGLang ``/v1/completions`` response (``n=1``).

    Args:
        response: The response dict as the server returns it: ``id``, ``choices`` (one, with
            ``token_ids``, ``prompt_token_ids``, ``logprobs.token_logprobs``, ``finish_reason``)
            and ``sglext`` (the routes).
        input_ids: The request's prompt token ids; None: the choice's ``prompt_token_ids``.
        spec: The trainer's model.
        reward: Optional reward of the completion.
        vocab_size: The model's vocabulary (see :func:`sglang_sample`).
        start_len: The request's ``routed_experts_start_len``.
        retracted_at: See :func:`check_retractions`.

    ``token_logprobs`` holds one entry per completion token or, with ``echo``, one per
    prompt token first (the first of them null: 0).

    Raises:
        RoutingValidationError: as :func:`vllm_samples`, a response of several choices
            (``sglext`` holds the first one's routes only) and prompt ids that do not
            fit ``prompt_token_ids``.
    """
    request_id, choices = _openai_choices(response, "SGLang")
    choice = choices[0]
    index = choice.get("index", 0)
    where = f"request {request_id!r} sample {index}"
    prompt, completion, prompt_logprobs, generated = _openai_choice(choice, input_ids, where, vocab_size, "SGLang")
    check_retractions(retracted_at, len(prompt), len(prompt) + len(completion), where)
    with _named(request_id):
        routes = from_sglang_openai(response, spec, num_tokens=len(prompt) + len(completion), sample=index,
                                    start_len=start_len)
    return _sample(prompt, completion, prompt_logprobs, generated, routes,
                   _meta("sglang", request_id, index, choice.get("finish_reason"), reward, where))


def vllm_openai_samples(
    response: dict, input_ids: Optional[Sequence[int]], spec: RoutingSpec, *,
    rewards: Optional[Sequence[Optional[float]]] = None, vocab_size: Optional[int] = None, prompt_start: int = 0,
    retracted_at: Optional[Sequence[int]] = None,
) -> list[RolloutSample]:
    """One sample per choice of a vLLM ``/v1/completions`` response (request ``return_token_ids=True``,
    ``logprobs`` 0 or more, ``routed_experts_prompt_start`` optional).

    Each choice carries its own ``routed_experts``: base64 of a ``.npy`` array ``[num_tokens - 1 -
    routed_experts_prompt_start, num_hidden_layers, topk]`` (vLLM 0.33), read by
    :func:`~megatron_r3.dataplane.engines.adapters.from_vllm`; prompt ids, completion ids and
    ``logprobs.token_logprobs`` as for :func:`sglang_openai_sample`.

    Args:
        response: The response dict as the server returns it.
        input_ids: The request's prompt token ids; None: each choice's ``prompt_token_ids``.
        spec: The trainer's model.
        rewards: Optional reward per choice, in ``choices`` order.
        vocab_size: The model's vocabulary (see :func:`sglang_sample`).
        prompt_start: The request's ``routed_experts_prompt_start`` (vLLM does not echo it).
        retracted_at: See :func:`check_retractions`.
    """
    request_id, choices = _openai_choices(response, "vLLM")
    if rewards is not None and len(rewards) != len(choices):
        raise RoutingValidationError(f"request {request_id!r}: {len(rewards)} rewards for {len(choices)} choices")
    samples = []
    for position, choice in enumerate(choices):
        index = choice.get("index", position)
        where = f"request {request_id!r} sample {index}"
        prompt, completion, prompt_logprobs, generated = _openai_choice(choice, input_ids, where, vocab_size, "vLLM")
        check_retractions(retracted_at, len(prompt), len(prompt) + len(completion), where)
        if choice.get("routed_experts") is None:
            raise RoutingValidationError(f"{where}: the vLLM choice has no routed_experts (server started with "
                                         f"--enable-return-routed-experts?)")
        with _named(request_id):
            routes = from_vllm(choice["routed_experts"], spec, num_tokens=len(prompt) + len(completion),
                               prompt_start=prompt_start, sample=index)
        samples.append(_sample(prompt, completion, prompt_logprobs, generated, routes,
                               _meta("vllm", request_id, index, choice.get("finish_reason"),
                                     None if rewards is None else rewards[position], where)))
    return samples


def _openai_choices(response: Any, engine: str) -> tuple[Any, list]:
    """An OpenAI ``/v1/completions`` response's id and its choices (at least one, each an object)."""
    if not isinstance(response, dict):
        raise RoutingValidationError(f"{engine} /v1/completions response must be a JSON object, got "
                                     f"{type(response).__name__}")
    request_id = response.get("id")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
        raise RoutingValidationError(f"request {request_id!r}: {engine} /v1/completions response has no choice "
                                     f"object")
    return request_id, choices


def _openai_choice(choice: dict, input_ids: Optional[Sequence[int]], where: str, vocab_size: Optional[int],
                   engine: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """An OpenAI completion choice's prompt ids, completion ids, prompt log-probs and completion log-probs."""
    if choice.get("token_ids") is None:
        raise RoutingValidationError(f"{where}: the {engine} choice has no token_ids (request return_token_ids=True)")
    completion = _completion_ids(choice["token_ids"], where, "token_ids", vocab_size)
    returned = choice.get("prompt_token_ids")
    if input_ids is None and returned is None:
        raise RoutingValidationError(f"{where}: the prompt ids are unknown: pass the request's input_ids, or request "
                                     f"return_token_ids=True so that the choice carries prompt_token_ids")
    prompt = token_id_array(returned if input_ids is None else input_ids, where,
                            "prompt_token_ids" if input_ids is None else "input_ids", vocab_size)
    if input_ids is not None and returned is not None and not np.array_equal(
            prompt, token_id_array(returned, where, "prompt_token_ids", vocab_size)):
        raise RoutingValidationError(f"{where}: input_ids ({len(prompt)} tokens) are not the choice's "
                                     f"prompt_token_ids ({len(returned)} tokens)")
    logprobs = choice.get("logprobs")
    entries = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list):
        raise RoutingValidationError(f"{where}: the {engine} choice has no logprobs.token_logprobs (request "
                                     f"logprobs=0 or more)")
    prompt_logprobs = np.zeros(len(prompt), np.float32)
    field = "logprobs.token_logprobs"
    if len(entries) == len(prompt) + len(completion):  # echo: the prompt's entries come first
        prompt_logprobs[:] = [0.0 if v is None else logprob_value(v, where, f"{field}[{i}]")
                              for i, v in enumerate(entries[:len(prompt)])]
        check_logprobs(prompt_logprobs, where, field)
        entries, field = entries[len(prompt):], f"{field}[{len(prompt)}:]"
    elif len(entries) != len(completion):
        raise RoutingValidationError(
            f"{where}: {field} has {len(entries)} entries for {len(completion)} completion tokens "
            f"({len(prompt) + len(completion)} with echo)"
        )
    return prompt, completion, prompt_logprobs, _number_logprobs(entries, len(completion), where, field, len(prompt))


def trtllm_samples(
    result: Any, spec: RoutingSpec, *, rewards: Optional[Sequence[Optional[float]]] = None,
    vocab_size: Optional[int] = None, retracted_at: Optional[Sequence[int]] = None,
) -> list[RolloutSample]:
    """One sample per completion of a TensorRT-LLM ``GenerationResult`` (``LLM.generate`` with
    ``SamplingParams(return_routed_experts=True, logprobs=0 or more)``).

    Reads ``prompt_token_ids``, ``id`` (or ``request_id``) and ``outputs``: ``CompletionOutput``
    with ``index``, ``token_ids``, ``logprobs`` (per generated token a ``{token_id: Logprob}``
    dict, or a plain log-prob: TensorRT-LLM returns either), ``finish_reason`` and the routes
    (:func:`~megatron_r3.dataplane.engines.adapters.from_trtllm`). Prompt log-probs are 0 (no loss
    sees them).

    Args:
        result: The ``GenerationResult``.
        spec: The trainer's model.
        rewards: Optional reward per completion, in ``outputs`` order.
        vocab_size: The model's vocabulary (see :func:`vllm_samples`).
        retracted_at: See :func:`check_retractions`.
    """
    request_id = getattr(result, "request_id", getattr(result, "id", None))
    outputs = list(result.outputs)
    if not outputs:
        raise RoutingValidationError(f"request {request_id!r}: no completions (outputs is empty)")
    if rewards is not None and len(rewards) != len(outputs):
        raise RoutingValidationError(f"request {request_id!r}: {len(rewards)} rewards for {len(outputs)} completions")
    prompt = result.prompt_token_ids
    if prompt is None or len(prompt) == 0:
        raise RoutingValidationError(f"request {request_id!r}: no prompt_token_ids")
    prompt = token_id_array(prompt, f"request {request_id!r}", "prompt_token_ids", vocab_size)
    samples = []
    for position, completion in enumerate(outputs):
        index = getattr(completion, "index", position)
        where = f"request {request_id!r} sample {index}"
        token_ids = _completion_ids(completion.token_ids, where, "token_ids", vocab_size)
        logprobs = completion.logprobs
        if logprobs is None or len(logprobs) == 0:
            raise RoutingValidationError(f"{where}: TensorRT-LLM returned no logprobs (sample with "
                                         f"SamplingParams(logprobs=0) or more)")
        # Per position {token_id: Logprob}: dicts, or positions parsed from JSON (tools/dump_rollouts.py).
        if isinstance(logprobs[0], dict) or hasattr(logprobs, "chosen_logprobs"):
            generated = _chosen_logprobs(logprobs, token_ids, where, "logprobs", first=len(prompt))
        else:
            generated = _number_logprobs(list(logprobs), len(token_ids), where, "logprobs", len(prompt))
        check_retractions(retracted_at, len(prompt), len(prompt) + len(token_ids), where)
        with _named(request_id):
            routes = from_trtllm(completion, spec, num_tokens=len(prompt) + len(token_ids), sample=index)
        samples.append(_sample(prompt, token_ids, np.zeros(len(prompt), np.float32), generated, routes,
                               _meta("trtllm", request_id, index, getattr(completion, "finish_reason", None),
                                     None if rewards is None else rewards[position], where)))
    return samples


def check_retractions(retracted_at: Optional[Sequence[int]], prompt_len: int, num_tokens: int, where: str) -> None:
    """Refuses a sample whose routes and log-probs come from different forward passes.

    An engine that retracts a running request frees its KV cache; when it schedules the
    request again it recomputes every position so far in a new pass. No engine marks this
    in what it returns, and the routes it returns for the recomputed positions are the new
    pass's (SGLang: the host cache is re-written on re-prefill, sglang #39633 unmerged, miles
    #3277; vLLM and Megatron likewise key routes by KV block; TensorRT-LLM keeps the first
    pass's routes, but the tokens sampled after the retraction then read the recomputed KV).
    The log-probs of the tokens sampled before the retraction stay the first pass's.
    So the caller, which sees the retraction (its own ``pause_generation(mode="retract")``
    around a weight update, or the engine's preemption events), passes ``retracted_at``:
    the sample's length (prompt plus tokens generated so far) at each retraction. A
    retraction after the first generated token is refused; one during the prompt is harmless.

    Args:
        retracted_at: Sample lengths at which the request was retracted; None or empty: never.
        prompt_len, num_tokens: The sample's prompt and total token counts.
        where: The request and sample, for messages.
    """
    if not retracted_at:
        return
    lengths = []
    for length in retracted_at:
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 < length <= num_tokens:
            raise RoutingValidationError(f"{where}: retracted_at entry {length!r} is not a sample length in "
                                         f"[1, {num_tokens}]")
        lengths.append(int(length))
    late = [n for n in lengths if n > prompt_len]
    if late:
        raise RoutingValidationError(
            f"{where}: retracted and recomputed after {late[-1] - prompt_len} generated tokens (retracted_at "
            f"{lengths}): the engine returns the recomputing pass's routes for tokens 0..{late[-1] - 1}, but the "
            f"log-probs of tokens {prompt_len}..{late[-1] - 1} are the sampling pass's (miles #3277); refused"
        )


def megatron_sample(
    record: Any, spec: RoutingSpec, *, reward: Optional[float] = None, completion_index: int = 0,
    vocab_size: Optional[int] = None, retracted_at: Optional[Sequence[int]] = None,
) -> RolloutSample:
    """The sample of one request of Megatron's inference engine (0.19).

    ``record`` is a finished ``DynamicInferenceRequest`` (``request_id``, ``prompt_tokens``,
    ``generated_tokens``, ``generated_log_probs``, ``prompt_log_probs``, ``routing_indices``)
    or a choice of its OpenAI ``/v1/completions`` response as a dict (``prompt_token_ids``,
    ``generation_token_ids``, ``generation_log_probs``, ``moe_topk_indices``,
    ``prompt_moe_topk_indices``). Log-probs: one per generated token (required);
    ``prompt_log_probs`` one per prompt token but the first, else the prompt's are 0.
    ``retracted_at``: see :func:`check_retractions`.

    Raises:
        RoutingValidationError: as :func:`vllm_samples`.
    """
    def get(*names):
        for name in names:
            value = record.get(name) if isinstance(record, dict) else getattr(record, name, None)
            if value is not None:
                return value
        return None

    request_id = get("request_id", "id")
    where = f"request {request_id!r} sample {completion_index}"
    prompt = get("prompt_token_ids", "prompt_tokens")
    if prompt is None or len(prompt) == 0:
        raise RoutingValidationError(f"{where}: Megatron returned no prompt tokens (prompt_token_ids / prompt_tokens; "
                                     f"request return_prompt_tokens=True?)")
    prompt = token_id_array(_as_list(prompt), where, "prompt_token_ids", vocab_size)
    completion = _completion_ids(_as_list(get("generation_token_ids", "generated_tokens")), where,
                                 "generation_token_ids", vocab_size)
    generated = get("generation_log_probs", "generated_log_probs")
    if generated is None:
        raise RoutingValidationError(f"{where}: Megatron returned no generation_log_probs (return_log_probs=True?)")
    generated = _number_logprobs(_as_list(generated), len(completion), where, "generation_log_probs", len(prompt))
    prompt_logprobs = np.zeros(len(prompt), np.float32)
    prompt_given = get("prompt_log_probs")
    if prompt_given is not None and len(_as_list(prompt_given)):
        prompt_logprobs[1:] = _number_logprobs(_as_list(prompt_given), len(prompt) - 1, where, "prompt_log_probs", 1)
    check_retractions(retracted_at, len(prompt), len(prompt) + len(completion), where)
    with _named(request_id):
        routes = from_megatron_inference(get("moe_topk_indices", "routing_indices"), spec,
                                         num_tokens=len(prompt) + len(completion),
                                         prompt_routing=get("prompt_moe_topk_indices"), prompt_len=len(prompt),
                                         sample=completion_index)
    finish = get("finish_reason")
    return _sample(prompt, completion, prompt_logprobs, generated, routes,
                   _meta("megatron", request_id, completion_index, finish, reward, where))


def _as_list(values: Any) -> Any:
    """A tensor's values as a list (Megatron keeps tokens and log-probs as tensors in process)."""
    return values.tolist() if hasattr(values, "tolist") and not isinstance(values, list) else values


def _number_logprobs(values: Any, count: int, where: str, field: str, first: int) -> np.ndarray:
    """A list of ``count`` plain log-prob numbers (Megatron's, SGLang's OpenAI ``token_logprobs``)."""
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise RoutingValidationError(
            f"{where}: {field} has {len(values) if isinstance(values, (list, tuple)) else type(values).__name__} "
            f"entries for {count} tokens"
        )
    return logprob_array(values, where, field, first_token=first)


@contextmanager
def _named(request_id: Any) -> Iterator[None]:
    """Prefixes the request id to an adapter's :class:`RoutingValidationError`."""
    try:
        yield
    except RoutingValidationError as error:
        raise RoutingValidationError(f"request {request_id!r} {error}") from error


def _completion_ids(values: Any, where: str, field: str, vocab_size: Optional[int]) -> np.ndarray:
    """A completion's token ids; an empty completion has nothing to train on."""
    ids = token_id_array(values, where, field, vocab_size)
    if len(ids) == 0:
        raise RoutingValidationError(f"{where}: the completion has no tokens ({field} is empty): nothing to train on")
    return ids


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
    out[1:] = _chosen_logprobs(prompt_logprobs[1:], prompt[1:], where, "prompt_logprobs", first=1, offset=1)
    return out


def _chosen_logprobs(positions: Any, token_ids: np.ndarray, where: str, field: str, first: int,
                     offset: int = 0) -> np.ndarray:
    """The log-prob of each chosen token from vLLM's per-position ``{token_id: Logprob}`` dicts.

    Entry ``i`` of ``positions`` is ``field[i + offset]`` and the sample's token ``first + i``.
    """
    if len(positions) != len(token_ids):
        raise RoutingValidationError(f"{where}: {field} has {len(positions)} positions for {len(token_ids)} tokens")
    tokens = token_ids.tolist()
    # Positions parsed from JSON give the chosen log-probs in one pass where they can (tools/dump_rollouts.py).
    values = positions.chosen_logprobs(tokens) if hasattr(positions, "chosen_logprobs") else None
    if values is None:
        entries = [None if position is None else position.get(token) for position, token in zip(positions, tokens)]
        if None in entries:
            i = entries.index(None)
            raise RoutingValidationError(
                f"{where}: {field}[{i + offset}] has no entry for token {tokens[i]}, the token at that position"
            )
        values = [getattr(entry, "logprob", None) for entry in entries]
    # An array comes from the scanner of tools/dump_rollouts.py: numbers only.
    if not isinstance(values, np.ndarray) and not set(map(type, values)) <= {float, int}:  # name the first bad one
        for i, value in enumerate(values):
            logprob_value(value, where, f"{field}[{i + offset}][{tokens[i]}].logprob")
    out = np.array(values, np.float32)
    check_logprobs(out, where, field, first_token=first)
    return out


def _sglang_prompt(response: dict, meta_info: dict, input_ids: Optional[Sequence[int]], where: str,
                   vocab_size: Optional[int]) -> np.ndarray:
    """The prompt ids: the caller's, else the response's own when it carries them whole."""
    if input_ids is not None:
        return token_id_array(input_ids, where, "input_ids", vocab_size)
    if response.get("prompt_token_ids") is not None:
        return token_id_array(response["prompt_token_ids"], where, "prompt_token_ids", vocab_size)
    entries = _sglang_entries(meta_info.get("input_token_logprobs") or [], where, "input_token_logprobs")
    if "prompt_tokens" in meta_info and len(entries) == _count(meta_info, "prompt_tokens", where) > 0:
        return token_id_array([entry[1] for entry in entries], where, "input_token_logprobs[*][1]", vocab_size)
    raise RoutingValidationError(
        f"{where}: the prompt ids are unknown: pass the request's input_ids, or request "
        f"return_prompt_token_ids=True or logprob_start_len=0 so that the response carries them"
    )


def _sglang_entries(entries: Any, where: str, field: str) -> list:
    """SGLang's ``[logprob, token_id, text]`` entries, each checked to be a list of at least two."""
    if not isinstance(entries, list):
        raise RoutingValidationError(f"{where}: {field} must be a list of [logprob, token_id, text], "
                                     f"got {type(entries).__name__}")
    if set(map(type, entries)) <= {list, tuple} and min(map(len, entries), default=2) >= 2:
        return entries
    for i, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise RoutingValidationError(f"{where}: {field}[{i}] must be [logprob, token_id, text], got {entry!r}")
    return entries


def _sglang_logprobs(entries: Any, token_ids: np.ndarray, where: str, field: str, first: int) -> np.ndarray:
    """Log-probs from SGLang's ``(logprob, token_id, text)`` entries; a None log-prob is 0.

    Entry ``i`` is the sample's token ``first + i``.
    """
    entries = _sglang_entries(entries, where, field)
    if len(entries) != len(token_ids):
        raise RoutingValidationError(f"{where}: {field} has {len(entries)} entries for {len(token_ids)} tokens")
    tokens = [entry[1] for entry in entries]
    expected = token_ids.tolist()
    if tokens != expected or not set(map(type, tokens)) <= {int}:  # equal ints, or name the first that is not
        for i, (token, want) in enumerate(zip(tokens, expected)):
            if isinstance(token, bool) or not isinstance(token, int) or token != want:
                raise RoutingValidationError(f"{where}: {field}[{i}] is for token {token!r}, the sample has token "
                                             f"{want} there")
    values = [entry[0] for entry in entries]
    if None in values:  # the first prompt entry has none: 0
        values = [0.0 if v is None else v for v in values]
    return logprob_array(values, where, field, first_token=first, entry="[0]")


def _count(meta_info: dict, key: str, where: str) -> int:
    value = meta_info[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise RoutingValidationError(f"{where}: meta_info[{key!r}] = {value!r} is not an integer")
    return value


def _check_count(meta_info: dict, key: str, count: int, what: str, where: str) -> None:
    if key in meta_info and _count(meta_info, key, where) != count:
        raise RoutingValidationError(f"{where}: {count} {what}, but meta_info[{key!r}] = {meta_info[key]}")


def _meta(engine: str, request_id: Any, index: int, finish_reason: Any, reward: Optional[float], where: str) -> dict:
    meta = {"engine": engine, "request_id": request_id, "completion_index": int(index),
            "finish_reason": finish_reason}
    if reward is not None:
        meta["reward"] = loss_number(reward, where, "reward")
    return meta


def _sample(prompt, completion, prompt_logprobs, generated, routes, meta) -> RolloutSample:
    return RolloutSample(
        token_ids=np.concatenate([prompt, completion]).astype(np.int32),
        loss_mask=np.arange(len(prompt) + len(completion)) >= len(prompt),
        logprobs=np.concatenate([prompt_logprobs, generated]).astype(np.float32),
        routes=routes,
        meta=meta,
    )
