"""Adapters from each engine's own routing output to :class:`RolloutRoutes`.

Every adapter takes a :class:`RoutingSpec` (what the trainer's model looks
like), validates on the host, and returns a compact, validated container or
raises :class:`RoutingValidationError` naming the sample, the engine's field and,
for a bad entry, the token and layer. A layer axis over every hidden layer is
mapped to MoE layers with the model's MoE layer pattern; a layout that does not
fit the model (layer count, a non-zero dense row, top-k, dtype) is an error,
never a guess. Which layout an engine used is told by the content (fields
present, dtype, layer count), never by a flag. Sources, read at the named commits
(docs/dataplane.md lists them with their versions):

* vLLM 0.33 (``enable_return_routed_experts``; Model Runner V2 and prefix caching):
  each completion's ``routed_experts`` holds ``[num_tokens - 1 - routed_experts_prompt_start,
  num_hidden_layers, topk]``, dense layers zero rows, in the narrowest dtype of the
  model's experts: uint8 up to 256, uint16 up to 65536, else int32 (routed_experts_capturer.py
  ``get_routed_experts_dtype_name`` at aoshen02/vllm@4526213c). The OpenAI server sends it
  as base64 of the array's ``.npy`` bytes (``CompletionResponseChoice.routed_experts`` in
  entrypoints/openai/completion/protocol.py at vllm-project/vllm@002032ee, ``numpy2base64``
  in utils/serial_utils.py at aoshen02/vllm@e64a44b4). The request's
  ``routed_experts_prompt_start`` drops that many leading rows and is not echoed. Routes
  are stored per KV block (aux_output_connector/worker.py at vllm-project/vllm@f99d53b5),
  so there are no capture gaps: every row must be a route.
* vLLM before 0.21: ``CompletionOutput.routed_experts`` is int32 over every hidden layer,
  ``[num_tokens - 1, num_hidden_layers, topk]`` (vllm/outputs.py at vllm-project/vllm@003d3ee2,
  fused_moe/routed_experts_capturer.py at vllm-project/vllm@00bd1493); told from 0.33 by its
  dtype (int32 for a model of up to 65536 experts; nested lists without a prompt start read
  the same way). An all-zero row is a capture gap (a prefix-cached token).
* vLLM 0.21-0.32, split layout (``AuxOutputConfig(enable_return_routed_experts=True)``):
  ``RequestOutput.prompt_routed_experts`` holds the prompt's rows from the request's
  ``routed_experts_prompt_start`` on, each ``CompletionOutput.routed_experts`` that
  completion's rows; one row per MoE layer, int16 or uint8. The connector emits rows up
  to ``num_tokens - 1`` (distributed/aux_output_connector/connector.py ``take_output`` at
  vllm-project/vllm@09155aec), so a completion has ``gen_len - 1`` rows; a final
  ``gen_len``-th row, where present, is the never-run final token's and is dropped. Told
  by the request's ``prompt_routed_experts`` field (present, even None).
* SGLang (``--enable-return-routed-experts``; 0.5.23): ``meta_info["routed_experts"]`` is
  base64 of flattened little-endian int32 ``[num_tokens - 1 - routed_experts_start_len,
  num_hidden_layers, topk]``, dense layers zero (state_capturer/base.py ``get_topk`` at
  sgl-project/sglang@bec3dbc9, state_capturer/routed_experts.py at sgl-project/sglang@30dbb063,
  captured under DeepEP too). Since sglang #36404 a padded row is ``-1`` at every MoE
  layer: that token has no route. The request's ``routed_experts_start_len`` is not echoed
  (``GenerateReqInput`` in managers/io_struct.py at sgl-project/sglang@a6463a10). The compact
  wire format names its dtype (``int32``, ``uint16``, ``uint8``) in
  ``meta_info["routed_experts_dtype"]``, int32 when absent (state_capturer/routed_experts_wire.py
  at sgl-project/sglang@a6463a10, sglang #31219, not in a release). ``/v1/completions``
  returns ``routed_experts`` and ``routed_experts_dtype`` in the response's ``sglext``,
  built from the first of its ``n`` choices only (entrypoints/openai/protocol.py ``SglExt``
  at sgl-project/sglang@a6463a10; sglang #17434). An all-zero row is a capture gap.
* TensorRT-LLM (``LlmArgs.enable_return_routed_experts``, ``SamplingParams.return_routed_experts``;
  NVIDIA/TensorRT-LLM #18397, RFC #17778): ``CompletionOutput.routed_experts``, backed by
  ``additional_generation_outputs["routed_experts"]``, int16 ``[num_tokens - 1,
  num_moe_layers, topk]``, pre-EPLB logical ids, one row per MoE layer in layer order; ``-1``
  marks a missing route (its ``RouteCapture`` module; the index holding it names no path or
  commit). Its per-request store is write-once per position, so there are no gaps.
* Megatron inference (0.19): ``DynamicInferenceRequest.routing_indices`` ``[num_tokens - 1,
  layers, topk]`` (int16 up to 32768 experts), one row per ``RouterReplay`` instance: the
  decoder's MoE layers, then the MTP block's when it has MoE layers; the OpenAI server
  returns it as a choice's ``moe_topk_indices`` and its prompt rows again as
  ``prompt_moe_topk_indices`` (inference_request.py, text_generation_controller.py,
  endpoints/completions.py at NVIDIA/Megatron-LM core_v0.19.0).
* Megatron (R2 recording): each rank/chunk returns ``[L_local, n_local, topk]`` in
  router order; the plans they were recorded under map them back. A token must be
  recorded at every MoE layer or at none.
* Raw arrays: ``[tokens, layers, topk]``; a token whose rows are all -1 at every
  layer has no route.

MTP: an engine array with one more row group than the decoder's (Megatron's MTP
routers) covers the model's ``RoutingSpec.mtp_moe_layers`` (numbered ``num_layers +
k``); the routes then cover those layers too. vLLM, SGLang and TensorRT-LLM capture the
target model's decoder only (TensorRT-LLM refuses speculative decoding with routes), so
their routes leave the MTP layers to the live router.

Validity is per token (:class:`RolloutRoutes`): a token replays at every MoE
layer or at none. A row of -1 at every MoE layer is "no route". In the int32
layouts of vLLM before 0.21 and of SGLang an all-zero row of a MoE layer with
``topk >= 2`` cannot be a route (it repeats expert 0); it is a capture gap: the
whole token then has no route, so it is never replayed as expert 0 and the live
router decides it everywhere; a sample whose rows are all zero is refused (the
capture never ran). The other layouts store routes per KV block or position and
have no gaps: there a repeated expert is refused, naming sample, token and layer.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import pybase64
import torch

from megatron_r3.dataplane.device.packing import scatter_routes
from megatron_r3.dataplane.device.plan import RoutingPlan
from megatron_r3.dataplane.route_checks import (
    REPEATED_CAUSE,
    RoutingValidationError,
    check_integer_dtype,
    rows_equal,
    sample_prefix,
    token_validity,
)
from megatron_r3.dataplane.routes import RolloutRoutes, _as_numpy, id_dtype
from megatron_r3.dataplane.samples import RoutingSpec

UNTYPED = np.dtype(np.int64)
"""What nested JSON lists decode to: they carry no dtype, so no engine's dtype is checked against them."""


def from_array(
    ids: Union[np.ndarray, torch.Tensor],
    spec: RoutingSpec,
    *,
    layers: str = "moe",
    valid: Optional[Union[np.ndarray, torch.Tensor]] = None,
    num_tokens: Optional[int] = None,
    sample: Optional[int] = None,
) -> RolloutRoutes:
    """Raw integer routes ``[tokens, layers, topk]`` (numpy or torch).

    Args:
        ids: Expert ids; a token whose rows are all -1 at every layer has no route, unless
            ``valid`` is given (rows of -1 at some layers only are an error).
        spec: The model.
        layers: ``"moe"``: one row per MoE layer; ``"full"``: one row per decoder
            layer, dense layers all -1 or all 0.
        valid: Optional bool ``[tokens]``; False = the token has no route.
        num_tokens: Expected token count.
        sample: Sample index for error messages.
    """
    ids = _as_numpy(ids)
    check_integer_dtype(ids, sample)
    if layers == "full":
        if ids.ndim != 3 or ids.shape[1] != spec.num_layers:
            raise RoutingValidationError(
                f"sample {sample}: routes have {ids.shape[1] if ids.ndim == 3 else '?'} layers, the model has "
                f"{spec.num_layers} decoder layers (shape {ids.shape})"
            )
        ids = _dense_dropped(ids, spec, f"sample {sample}: routes", dense_fill=(-1, 0))
    elif layers != "moe":
        raise ValueError(f"layers must be 'moe' or 'full', got {layers!r}")
    return RolloutRoutes.from_ids(
        ids, num_experts=spec.num_experts, layer_numbers=spec.model_moe_layers, topk=spec.topk, valid=valid,
        num_tokens=num_tokens, sample=sample,
    )


def vllm_routes_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM 0.33 returns routes in: the narrowest that holds every expert id."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16 if num_experts <= 65536 else np.int32)


def from_vllm(
    output: Any, spec: RoutingSpec, *, num_tokens: Optional[int] = None, prompt_start: int = 0,
    sample: Optional[int] = None, field: str = "routed_experts",
) -> RolloutRoutes:
    """A vLLM completion's ``routed_experts``: vLLM 0.33's, or the int32 array of vLLM before 0.21.

    Args:
        output: A ``CompletionOutput`` (anything with ``.routed_experts``) or the routes: an
            array ``[num_tokens - 1 - prompt_start, num_hidden_layers, topk]``, base64 of its
            ``.npy`` bytes (the OpenAI server's form), or any form :func:`route_array` reads.
        spec: The model.
        num_tokens: ``len(prompt_token_ids) + len(token_ids)``; checked against the array when given.
        prompt_start: The request's ``SamplingParams.routed_experts_prompt_start`` (vLLM 0.33):
            tokens before it have no row and no route.
        sample: Sample index for error messages.
        field: What the routes are, for messages.

    The layout is told by the dtype: int32 for a model of up to 65536 experts is vLLM
    before 0.21 (capture gaps possible, no prompt start); vLLM 0.33 returns
    :func:`vllm_routes_dtype`. Any other dtype is not this model's routes and is refused.
    """
    routed = getattr(output, "routed_experts", output)
    if routed is None:
        raise RoutingValidationError(
            f"sample {sample}: vLLM returned no {field} (enable_return_routed_experts=True?)"
        )
    rows = route_array(routed, field, sample)
    before_021 = rows.dtype == np.int32 and spec.num_experts <= 65536
    if before_021 or (rows.dtype == UNTYPED and not prompt_start):
        if prompt_start:
            raise RoutingValidationError(
                f"sample {sample}: {field}: int32 routes are vLLM's layout before 0.21, which has no "
                f"routed_experts_prompt_start, but the request's is {prompt_start} (vLLM 0.33 returns "
                f"{vllm_routes_dtype(spec.num_experts)} for {spec.num_experts} experts)"
            )
        return _from_engine_rows(rows, spec, num_tokens, sample, "vLLM", field=field, axis="hidden",
                                 capture_gaps=True)
    expected = vllm_routes_dtype(spec.num_experts)
    if rows.dtype not in (expected, UNTYPED):
        raise RoutingValidationError(
            f"sample {sample}: {field} has dtype {rows.dtype}; vLLM returns {expected} for a model of "
            f"{spec.num_experts} experts (0.33) or int32 (before 0.21): not this model's routes"
        )
    return _from_engine_rows(rows, spec, num_tokens, sample, "vLLM", field=field, axis="hidden",
                             start=_prompt_start(prompt_start, num_tokens, sample, "routed_experts_prompt_start"),
                             capture_gaps=False)


VLLM_SPLIT_DTYPES = (np.dtype(np.int16), np.dtype(np.uint8))


def from_vllm_split(
    prompt_routes: Any, completion_routes: Any, spec: RoutingSpec, *, prompt_len: int, completion_len: int,
    prompt_start: int = 0, sample: Optional[int] = None,
) -> RolloutRoutes:
    """vLLM's split layout (0.21-0.32): the request's ``prompt_routed_experts`` and one completion's ``routed_experts``.

    Args:
        prompt_routes: ``RequestOutput.prompt_routed_experts``, ``[prompt_len - prompt_start, layers, topk]``
            (None only when ``prompt_start == prompt_len``).
        completion_routes: ``CompletionOutput.routed_experts``, ``[completion_len - 1, layers, topk]``
            (a ``completion_len``-th row, the never-run final token's, is dropped).
        spec: The model.
        prompt_len: ``len(prompt_token_ids)``.
        completion_len: ``len(token_ids)`` of the completion.
        prompt_start: The request's ``SamplingParams.routed_experts_prompt_start``: prompt tokens
            before it have no row and no route (the live router decides them).
        sample: Sample index for error messages.

    The layer axis is one row per MoE layer (vLLM's), or one per decoder layer with dense
    layers zero (a build that keeps them), told by its length. Rows are validated strictly:
    the connector stores routes per KV block and has no capture gaps, so a zero-filled row
    is a repeated expert and refused.
    """
    if not 0 <= prompt_start <= prompt_len:
        raise RoutingValidationError(
            f"sample {sample}: routed_experts_prompt_start {prompt_start} is outside the prompt [0, {prompt_len}]"
        )
    if completion_routes is None:
        raise RoutingValidationError(
            f"sample {sample}: vLLM returned no routed_experts for this completion "
            f"(AuxOutputConfig(enable_return_routed_experts=True)?)"
        )
    parts = []
    if prompt_routes is None:
        if prompt_start != prompt_len:
            raise RoutingValidationError(
                f"sample {sample}: vLLM returned no prompt_routed_experts for a prompt of {prompt_len} tokens "
                f"(routed_experts_prompt_start {prompt_start}); the completion's routes alone do not say "
                f"where they start"
            )
    else:
        parts.append(("prompt_routed_experts", route_array(prompt_routes, "prompt_routed_experts", sample),
                      prompt_len - prompt_start, prompt_len - prompt_start))
    parts.append(("routed_experts", route_array(completion_routes, "routed_experts", sample),
                  max(completion_len - 1, 0), completion_len))
    moe_rows, layer_numbers = [], spec.model_moe_layers
    for field, rows, need, most in parts:
        where = f"sample {sample}: {field}"
        if rows.dtype not in VLLM_SPLIT_DTYPES + (UNTYPED,):
            check_integer_dtype(rows, sample)
            raise RoutingValidationError(f"{where} has dtype {rows.dtype}; vLLM's split layout returns int16 or "
                                         f"uint8: not vLLM's routes")
        if rows.ndim != 3:
            raise RoutingValidationError(f"{where} must be 3-D [tokens, layers, topk], got shape {rows.shape}")
        if not need <= rows.shape[0] <= most:
            raise RoutingValidationError(
                f"sample {sample}: vLLM {field} covers {rows.shape[0]} tokens; it must cover {need}"
                + (" (every generated token but the final one)" if field == "routed_experts" else
                   f" (prompt tokens {prompt_start}..{prompt_len - 1})")
            )
        if rows.shape[2] != spec.topk:
            raise RoutingValidationError(
                f"sample {sample}: vLLM {field} has top-k {rows.shape[2]}, the model routes to top-{spec.topk}"
            )
        moe, layer_numbers = _layer_rows(rows[:need], spec, where, "vLLM", axis="either")
        moe_rows.append(moe)
    num_tokens = prompt_len + completion_len
    ids = np.zeros((num_tokens, len(layer_numbers), spec.topk), np.int32)
    valid = np.zeros(num_tokens, np.bool_)
    filled = np.concatenate(moe_rows).astype(np.int32) if moe_rows else ids[:0]
    ids[prompt_start:prompt_start + len(filled)] = filled
    valid[prompt_start:prompt_start + len(filled)] = True
    prompt_end = prompt_start + (len(moe_rows[0]) if len(moe_rows) == 2 else 0)
    return _checked(ids, spec, layer_numbers, valid, num_tokens, sample,
                    lambda token: "prompt_routed_experts" if token is not None and token < prompt_end
                    else "routed_experts")


SGLANG_WIRE_DTYPES = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}


def from_sglang(
    meta_info: Union[dict, str, bytes], spec: RoutingSpec, *, num_tokens: Optional[int] = None,
    sample: Optional[int] = None, start_len: int = 0, field: str = "SGLang meta_info",
) -> RolloutRoutes:
    """SGLang ``meta_info["routed_experts"]``: base64 of flattened ``[num_tokens - 1 - start_len, num_layers, topk]``.

    Args:
        meta_info: The response's ``meta_info`` dict (or an OpenAI response's ``sglext``), or
            its ``routed_experts`` payload (base64, or an already decoded integer array).
        spec: The model.
        num_tokens: The sample's token count; default ``prompt_tokens +
            completion_tokens`` from ``meta_info`` when present.
        sample: Sample index for error messages.
        start_len: The request's ``routed_experts_start_len`` (tokens before it have no row and
            no route; SGLang does not echo it).
        field: What ``meta_info`` is, for messages.

    The payload's dtype is ``meta_info["routed_experts_dtype"]`` (``int32``, ``uint16`` or
    ``uint8``), int32 when absent (every SGLang release). A row of -1 at every MoE layer
    (a padded row, sglang #36404) leaves that token to the live router.
    """
    dtype_name = "int32"
    payload = meta_info
    if isinstance(meta_info, dict):
        if meta_info.get("routed_experts") is None:
            raise RoutingValidationError(
                f"sample {sample}: {field} has no routed_experts (--enable-return-routed-experts, request "
                f"return_routed_experts=True?)"
            )
        payload = meta_info["routed_experts"]
        if num_tokens is None and "prompt_tokens" in meta_info and "completion_tokens" in meta_info:
            num_tokens = int(meta_info["prompt_tokens"]) + int(meta_info["completion_tokens"])
        dtype_name = meta_info.get("routed_experts_dtype") or "int32"
    start_len = _prompt_start(start_len, num_tokens, sample, "routed_experts_start_len")
    field = f"{field}['routed_experts']"
    if dtype_name not in SGLANG_WIRE_DTYPES:
        raise RoutingValidationError(
            f"sample {sample}: {field}: routed_experts_dtype {dtype_name!r} is not one of "
            f"{sorted(SGLANG_WIRE_DTYPES)}"
        )
    if isinstance(payload, (str, bytes)):
        try:
            flat = np.frombuffer(_b64decode(payload), dtype=SGLANG_WIRE_DTYPES[dtype_name])
        except ValueError as error:  # binascii.Error, or bytes that are not whole values
            raise RoutingValidationError(
                f"sample {sample}: {field} is not base64 of {dtype_name} values ({error})"
            ) from None
    elif isinstance(payload, (list, np.ndarray, torch.Tensor)):  # already decoded
        try:
            flat = _as_numpy(payload).reshape(-1)
        except ValueError as error:  # ragged nested lists
            raise RoutingValidationError(f"sample {sample}: {field} is not an integer array ({error})") from None
    else:
        raise RoutingValidationError(f"sample {sample}: {field} must be a base64 string, got {type(payload).__name__}")
    row = spec.num_layers * spec.topk
    # The payload is flat: name the shape it must have rather than guess which dimension is off.
    if num_tokens is not None and flat.size != (num_tokens - 1 - start_len) * row:
        tokens, which = ("tokens - 1 - start_len", f"every token from routed_experts_start_len {start_len}") \
            if start_len else ("tokens - 1", "every token")
        raise RoutingValidationError(
            f"sample {sample}: {field} holds {flat.size} {dtype_name} values; this sample needs [{tokens}, layers, "
            f"topk] = [{num_tokens - 1 - start_len}, {spec.num_layers}, {spec.topk}] = "
            f"{(num_tokens - 1 - start_len) * row} ({which} but the final sampled one, every decoder layer, "
            f"top-{spec.topk})"
        )
    if flat.size % row:
        raise RoutingValidationError(
            f"sample {sample}: {field} holds {flat.size} {dtype_name} values, not a whole number of "
            f"[layers, topk] = [{spec.num_layers}, {spec.topk}] rows of a [tokens - 1, layers, topk] array"
        )
    flat = flat.reshape(-1, spec.num_layers, spec.topk)
    return _from_engine_rows(flat, spec, num_tokens, sample, "SGLang", field=field, axis="hidden", start=start_len,
                             capture_gaps=True)


def from_sglang_openai(
    response: dict, spec: RoutingSpec, *, num_tokens: int, sample: Optional[int] = None, start_len: int = 0,
) -> RolloutRoutes:
    """The routes of an SGLang ``/v1/completions`` response (request ``return_routed_experts``).

    They are the response's ``sglext`` (``routed_experts``, ``routed_experts_dtype``), read
    as :func:`from_sglang` reads ``meta_info``. SGLang builds ``sglext`` from the first
    choice only, so a response of several choices is refused: the others have no routes.

    Args:
        response: The response dict as the server returns it.
        spec: The model.
        num_tokens: Prompt plus generated tokens of the first choice.
        sample: Sample index for error messages.
        start_len: The request's ``routed_experts_start_len``.
    """
    where = "the SGLang /v1/completions response"
    if not isinstance(response, dict) or not isinstance(response.get("sglext"), dict):
        raise RoutingValidationError(
            f"sample {sample}: {where} has no sglext object (request return_routed_experts=True on a server "
            f"started with --enable-return-routed-experts?)"
        )
    choices = response.get("choices")
    if isinstance(choices, list) and len(choices) > 1:
        raise RoutingValidationError(
            f"sample {sample}: {where} has {len(choices)} choices but sglext holds the routes of the first "
            f"only (request n=1, or use /generate)"
        )
    return from_sglang(response["sglext"], spec, num_tokens=num_tokens, sample=sample, start_len=start_len,
                       field="SGLang response sglext")


def from_trtllm(
    output: Any, spec: RoutingSpec, *, num_tokens: Optional[int] = None, sample: Optional[int] = None,
) -> RolloutRoutes:
    """A TensorRT-LLM ``CompletionOutput``'s routes (#18397): int16 ``[num_tokens - 1, num_moe_layers, topk]``.

    Args:
        output: A ``CompletionOutput`` (its ``routed_experts``, else
            ``additional_generation_outputs["routed_experts"]``), or the routes in any form
            :func:`route_array` reads.
        spec: The model.
        num_tokens: Prompt plus generated tokens; checked against the array when given.
        sample: Sample index for error messages.

    A row of -1 at every MoE layer (TensorRT-LLM's missing route) leaves that token to the
    live router; every other row must be a route (the engine's store has no gaps).
    """
    routed = getattr(output, "routed_experts", None) if not _is_route_value(output) else output
    if routed is None and not _is_route_value(output):
        extra = getattr(output, "additional_generation_outputs", None) or {}
        routed = extra.get("routed_experts")
    if routed is None:
        raise RoutingValidationError(
            f"sample {sample}: TensorRT-LLM returned no routed_experts (LlmArgs.enable_return_routed_experts and "
            f"SamplingParams.return_routed_experts?)"
        )
    if isinstance(routed, (list, tuple)) and routed and isinstance(routed[0], (np.ndarray, torch.Tensor)):
        # additional_generation_outputs entries are lists the engine appends to; a request attaches once
        if len(routed) != 1:
            raise RoutingValidationError(f"sample {sample}: routed_experts holds {len(routed)} arrays; TensorRT-LLM "
                                         f"attaches one per finished request")
        routed = routed[0]
    rows = route_array(routed, "routed_experts", sample)
    if rows.dtype not in (np.dtype(np.int16), UNTYPED):
        check_integer_dtype(rows, sample)
        raise RoutingValidationError(f"sample {sample}: routed_experts has dtype {rows.dtype}; TensorRT-LLM returns "
                                     f"int16: not TensorRT-LLM's routes")
    return _from_engine_rows(rows, spec, num_tokens, sample, "TensorRT-LLM", field="routed_experts", axis="moe",
                             capture_gaps=False)


def from_megatron_inference(
    routing: Any, spec: RoutingSpec, *, num_tokens: int, prompt_routing: Any = None, prompt_len: Optional[int] = None,
    sample: Optional[int] = None,
) -> RolloutRoutes:
    """Megatron's inference engine: ``request.routing_indices`` or a choice's ``moe_topk_indices``.

    Args:
        routing: ``[num_tokens - 1, layers, topk]`` (one row per MoE layer, then one per MTP MoE
            layer when the engine recorded them): an array, nested lists, Megatron's serialised
            ``{"data", "dtype"}`` or ``["ndarray", {"data", "dtype"}]``.
        spec: The model.
        num_tokens: Prompt plus generated tokens.
        prompt_routing: The choice's ``prompt_moe_topk_indices`` (the first ``prompt_len`` rows of
            ``routing``), checked against ``routing`` when given.
        prompt_len: The prompt's token count (needed with ``prompt_routing``).
        sample: Sample index for error messages.

    The engine keeps routes per KV block and returns none when a block lacks them, so
    every row must be a route: a repeated expert is refused.
    """
    if routing is None:
        raise RoutingValidationError(
            f"sample {sample}: Megatron returned no routing_indices / moe_topk_indices (record routes with "
            f"the inference engine's router recording on)"
        )
    rows = route_array(routing, "moe_topk_indices", sample)
    if prompt_routing is not None:
        prompt = route_array(prompt_routing, "prompt_moe_topk_indices", sample)
        # core_v0.19.0 slices the serialised ["ndarray", {...}] pair rather than the array, which
        # repeats the whole of moe_topk_indices: that is the same data, not a conflict.
        same = prompt.shape == rows.shape and np.array_equal(prompt, rows)
        if not same and (prompt_len is None or prompt.shape != (prompt_len,) + rows.shape[1:]
                         or not np.array_equal(prompt, rows[:prompt_len])):
            raise RoutingValidationError(
                f"sample {sample}: prompt_moe_topk_indices (shape {prompt.shape}) is not the first {prompt_len} "
                f"rows of moe_topk_indices (shape {rows.shape})"
            )
    return _from_engine_rows(rows, spec, num_tokens, sample, "Megatron", field="moe_topk_indices", axis="moe",
                             capture_gaps=False)


def route_array(value: Any, field: str, sample: Optional[int] = None) -> np.ndarray:
    """An engine's integer route array from what it returns or serialises.

    Accepts a numpy array or CPU tensor, nested lists (read as int64: JSON has no dtype),
    base64 of an ``.npy`` file (vLLM's OpenAI server), ``{"dtype", "shape", "base64"}``
    (little-endian bytes, this project's JSON form), and Megatron's serialised
    ``{"data", "dtype"}`` or ``["ndarray", {"data", "dtype"}]``.
    """
    try:
        if isinstance(value, (str, bytes)):
            array = _npy_array(_b64decode(value))
        else:
            if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == "ndarray":
                value = value[1]
            if isinstance(value, dict):
                if "base64" in value:
                    dtype = np.dtype(value["dtype"]).newbyteorder("<")
                    array = np.frombuffer(_b64decode(value["base64"]), dtype=dtype)
                    array = array.reshape(value["shape"])
                else:
                    array = np.asarray(value["data"], dtype=np.dtype(value["dtype"]))
            elif isinstance(value, torch.Tensor):
                array = _as_numpy(value)
            elif isinstance(value, np.ndarray):
                array = value
            else:  # nested lists: any integers read as int64; floats stay floats and are refused below
                array = np.asarray(value)
                if array.size == 0 or np.issubdtype(array.dtype, np.integer):
                    array = array.astype(UNTYPED, copy=False)
    except (KeyError, TypeError, ValueError, OverflowError) as error:  # binascii.Error is a ValueError
        raise RoutingValidationError(
            f"{sample_prefix(sample)}{field} must be an integer array, nested lists, base64 of a .npy array, "
            f"{{\"dtype\", \"shape\", \"base64\"}} or {{\"data\", \"dtype\"}} ({type(error).__name__}: {error})"
        ) from None
    if not np.issubdtype(array.dtype, np.integer):
        raise RoutingValidationError(f"{sample_prefix(sample)}{field}: expert ids must be integers, got dtype {array.dtype}")
    return array



def _is_route_value(value: Any) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor, list, tuple, dict, str, bytes))


def _b64decode(payload: Union[str, bytes]) -> bytes:
    """Strict base64 (pybase64's SIMD decoder validates as it decodes: 60x the standard library's)."""
    return pybase64.b64decode(payload, validate=True)


def _npy_array(raw: bytes) -> np.ndarray:
    """The array of an ``.npy`` file's bytes, without a copy; object arrays (pickles) are refused."""
    stream = io.BytesIO(raw)
    version = np.lib.format.read_magic(stream)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in read_header:
        raise ValueError(f".npy format version {version} is not 1.0 or 2.0")
    shape, fortran_order, dtype = read_header[version](stream)
    if dtype.hasobject:
        raise ValueError(f".npy array of dtype {dtype} holds Python objects")
    count = int(np.prod(shape, dtype=np.int64))
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=stream.tell())
    return array.reshape(shape[::-1]).T if fortran_order else array.reshape(shape)


def _prompt_start(value: Any, num_tokens: Optional[int], sample: Optional[int], name: str) -> int:
    """A request's route start (``routed_experts_start_len``, ``routed_experts_prompt_start``): a count
    within the sample's routed tokens."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise RoutingValidationError(f"sample {sample}: {name} = {value!r} is not a count")
    if num_tokens is not None and value > num_tokens - 1:
        raise RoutingValidationError(
            f"sample {sample}: {name} {value} is beyond the {num_tokens - 1} routed tokens of a "
            f"{num_tokens}-token sample (the engine takes it within the prompt)"
        )
    return int(value)


def from_megatron_recorded(
    parts: Sequence[tuple[RoutingPlan, torch.Tensor]], sample_lens: Sequence[int], spec: RoutingSpec
) -> list[RolloutRoutes]:
    """Routes recorded by the trainer's routers (R2), back in the per-sample layout.

    Args:
        parts: ``(plan, expert_ids)`` for every rank/chunk part to combine; ``expert_ids``
            is ``[L_local, n_local, topk]`` in router order as recorded under ``plan``
            (a row of -1 means nothing recorded). Parts may live on any device;
            the result is on the host.
        sample_lens: Token count of each sample of the microbatch, in plan order.
        spec: The model.

    Returns:
        One container per sample: a token recorded at every MoE layer has its route, a
        token recorded at none has no route.

    Raises:
        RoutingValidationError: a token recorded at some MoE layers only (a part is missing),
            naming sample, token and the first missing layer.
    """
    total = int(sum(sample_lens))
    ids = torch.zeros((total, len(spec.model_moe_layers), spec.topk), dtype=_torch_id_dtype(spec.num_experts))
    recorded = torch.zeros((total, len(spec.model_moe_layers)), dtype=torch.bool)  # per row: parts combine
    for plan, expert_ids in parts:
        if plan.num_source_tokens != total or plan.num_source_layers != len(spec.model_moe_layers):
            raise RoutingValidationError(
                f"plan covers {plan.num_source_tokens} tokens x {plan.num_source_layers} layers, the "
                f"microbatch has {total} x {len(spec.model_moe_layers)}"
            )
        scatter_routes(expert_ids.detach().cpu().contiguous(), torch.from_numpy(plan.token_index),
                       torch.from_numpy(plan.layer_index), ids, recorded)
    out, start = [], 0
    for i, length in enumerate(sample_lens):
        valid = token_validity(recorded[start:start + length].numpy(), spec.model_moe_layers,
                               "not recorded at this layer but at others (a part is missing)", i)
        out.append(RolloutRoutes.from_ids(ids[start:start + length].numpy(), num_experts=spec.num_experts,
                                          layer_numbers=spec.model_moe_layers, topk=spec.topk, valid=valid,
                                          sample=i))
        start += length
    return out


def _torch_id_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if id_dtype(num_experts) == np.uint8 else torch.int16


def _from_engine_rows(
    rows: np.ndarray, spec: RoutingSpec, num_tokens: Optional[int], sample: Optional[int], engine: str, *,
    field: str, axis: str, start: int = 0, capture_gaps: bool,
) -> RolloutRoutes:
    """Engine layout ``[num_tokens - 1 - start, layers, topk]`` -> container.

    The final sampled token has no route, nor has a token before ``start``, nor one whose
    rows are -1 at every MoE layer. With ``capture_gaps`` an all-zero row (``topk >= 2``) is
    a capture gap: its token has no route; a sample with rows but none that is a route is
    refused (the capture never ran). Without it every other row must be a route.
    """
    where = f"sample {sample}: {field}"
    if not np.issubdtype(rows.dtype, np.integer):
        raise RoutingValidationError(f"{where}: expert ids must be integers, got dtype {rows.dtype}")
    if rows.ndim != 3:
        raise RoutingValidationError(f"{where} must be 3-D [tokens, layers, topk], got shape {rows.shape}")
    if num_tokens is None:
        num_tokens = rows.shape[0] + 1 + start
    if rows.shape[0] != num_tokens - 1 - start:
        raise RoutingValidationError(
            f"{where}: {engine} routes cover {rows.shape[0]} tokens; a sample of {num_tokens} tokens "
            f"must have {num_tokens - 1 - start} (every token " + (f"from {start} on " if start else "")
            + "but the final sampled one)"
        )
    if rows.shape[2] != spec.topk:
        raise RoutingValidationError(
            f"{where}: {engine} routes have top-k {rows.shape[2]}, the model routes to top-{spec.topk}"
        )
    moe, layer_numbers = _layer_rows(_narrowed(rows, spec.num_experts), spec, where, engine, axis)
    routed = np.ones(len(moe), dtype=np.bool_)
    if moe.dtype.kind == "i" and len(moe) and moe.min() < 0:  # rows of -1: no route (a whole-array test first)
        no_route = rows_equal(moe, -1)
        routed = token_validity(~no_route, layer_numbers, "no route (a row of -1) at this layer but routes at "
                                "others", sample)
    if capture_gaps and spec.topk >= 2 and len(moe):
        gap = rows_equal(moe, 0)  # an all-zero row is a capture gap, not a route
        if gap.any():
            if (gap.all(axis=1) | ~routed).all():
                raise RoutingValidationError(
                    f"{where}: token {start}, layer {layer_numbers[0]}: every {engine} route row is all zeros "
                    f"({len(moe)} tokens), i.e. expert 0 repeated{REPEATED_CAUSE}"
                )
            routed &= ~gap.any(axis=1)
    ids = np.zeros((num_tokens,) + moe.shape[1:], moe.dtype)
    ids[start:num_tokens - 1] = moe
    valid = np.zeros(num_tokens, dtype=np.bool_)
    valid[start:num_tokens - 1] = routed
    ids[~valid] = 0  # no route: its -1 rows are not ids, and the range check reads the whole array at once
    return _checked(ids, spec, layer_numbers, valid, num_tokens, sample, field)


def _narrowed(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """Engine ids in the narrowest signed dtype that holds every id of the model and -1, where all
    lie in ``[-1, num_experts)``: SGLang's int32 becomes int8 for 128 experts, a quarter of the
    bytes every later check reads. Ids outside stay as they are, for the checks to name."""
    target = np.dtype(np.int8 if num_experts <= 128 else np.int16 if num_experts <= 32768 else np.int32)
    if rows.dtype.itemsize <= target.itemsize or rows.size == 0:
        return rows
    if rows.min() >= -1 and rows.max() < num_experts:
        return rows.astype(target)
    return rows


def _checked(ids: np.ndarray, spec: RoutingSpec, layer_numbers: Sequence[int], valid: np.ndarray, num_tokens: int,
             sample: Optional[int], field: Union[str, Callable[[Optional[int]], str]]) -> RolloutRoutes:
    """The validated container; a bad entry's message names the sample, the engine's field, the token and the layer.

    ``field``: the engine's field, or a function of the token a message names giving the field
    that token's rows came from (a sample assembled from several fields).
    """
    try:
        return RolloutRoutes.from_ids(ids, num_experts=spec.num_experts, layer_numbers=layer_numbers, topk=spec.topk,
                                      valid=valid, num_tokens=num_tokens)
    except RoutingValidationError as error:
        name = field(error.token) if callable(field) else field
        raise RoutingValidationError(f"sample {sample}: {name}: {error}", token=error.token) from None


def _layer_rows(rows: np.ndarray, spec: RoutingSpec, where: str, engine: str,
                axis: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """An engine array's layer axis -> the rows of the layers its routes cover, and their numbers.

    ``axis``: ``"hidden"``, one row per decoder layer (dense layers zero rows, dropped here);
    ``"moe"``, one per MoE layer; ``"either"``, told by the count. Either may be followed by
    one row per MTP MoE layer of the model: the routes then cover those layers too.
    """
    n, moe, mtp = rows.shape[1], spec.model_moe_layers, spec.mtp_moe_layers
    if axis in ("moe", "either"):
        if n == len(moe):
            return rows, moe
        if mtp and n == len(moe) + len(mtp):
            return rows, spec.routed_layers
    if axis in ("hidden", "either"):
        for extra in ((), mtp) if mtp else ((),):
            if n == spec.num_layers + len(extra):
                decoder = _dense_dropped(rows[:, :spec.num_layers], spec, where, dense_fill=(0,))
                return (np.concatenate([decoder, rows[:, spec.num_layers:]], axis=1) if extra else decoder,
                        moe + tuple(extra))
    expected = {"hidden": f"one row per decoder layer ({spec.num_layers})",
                "moe": f"one row per MoE layer ({len(moe)})",
                "either": f"one row per MoE layer ({len(moe)}) or per decoder layer ({spec.num_layers})"}[axis]
    mtp_text = f", then one per MTP MoE layer ({len(mtp)})" if mtp else ""
    raise RoutingValidationError(
        f"{where} has {n} layers, the model has {spec.num_layers} decoder layers, {len(moe)} of them MoE"
        + (f", and {len(mtp)} MTP MoE layers" if mtp else "") + f": {engine} returns {expected}{mtp_text}; "
        f"routes for another model?"
    )


def _dense_dropped(ids: np.ndarray, spec: RoutingSpec, where: str, dense_fill: tuple[int, ...]) -> np.ndarray:
    """Decoder-layer axis -> MoE layers only; dense layers must hold only a filler value."""
    moe = np.asarray(spec.model_moe_layers) - 1
    dense = np.setdiff1d(np.arange(spec.num_layers), moe)
    if len(dense):
        rows = ids[:, dense]
        filled = np.zeros(rows.shape[:2], dtype=np.bool_)
        for value in dense_fill:
            filled |= rows_equal(rows, value)
        if not filled.all():
            token, layer = np.argwhere(~filled)[0]
            raise RoutingValidationError(
                f"{where}: token {token}, layer {dense[layer] + 1}: dense layer holds routes "
                f"{rows[token, layer].tolist()}; the layout does not fit moe layers {list(spec.model_moe_layers)} "
                f"({int((~filled).sum())} such rows)"
            )
    if len(moe) == spec.num_layers:
        return ids
    return ids[:, moe]
