"""Adapters from each engine's own routing output to :class:`RolloutRoutes`.

Every adapter takes a :class:`RoutingSpec` (what the trainer's model looks
like), validates on the host, and returns a compact, validated container or
raises :class:`RoutingValidationError`. A full-model layer layout is mapped to
MoE layers with the model's ``moe_layer_freq``; a layout that does not fit the
model (layer count, non-zero dense rows, top-k) is an error, never a guess.

Conventions (per sample of ``num_tokens = prompt + generated`` tokens):

* vLLM (``enable_return_routed_experts=True``): ``CompletionOutput.routed_experts``
  is ``np.int32 [num_tokens - 1, num_hidden_layers, topk]``; dense layers are
  zero rows; the final sampled token was never run, so it has no row and
  has no route
  (vllm/outputs.py at vllm-project/vllm@003d3ee2; fused_moe/routed_experts_capturer.py, int32
  ``[tokens, num_hidden_layers, num_experts_per_tok]`` at vllm-project/vllm@00bd1493).
* vLLM split layout (``AuxOutputConfig(enable_return_routed_experts=True)``, the
  auxiliary-output connector): ``RequestOutput.prompt_routed_experts`` holds the
  prompt's rows from the request's ``routed_experts_prompt_start`` on, each
  ``CompletionOutput.routed_experts`` that completion's rows; one row per MoE layer
  (``layers="full"`` for a build that keeps every decoder layer), int16 or uint8
  (any integer dtype is read). The connector emits rows up to ``num_tokens - 1``
  (distributed/aux_output_connector/connector.py ``take_output`` at
  vllm-project/vllm@09155aec), so a completion has ``gen_len - 1`` rows; a final
  ``gen_len``-th row, where present, is the never-run final token's and is dropped.
  The two vLLM layouts are told apart by the request's ``prompt_routed_experts``
  field (present, even None: split), never by array shapes.
* SGLang (``--enable-return-routed-experts``): ``meta_info["routed_experts"]`` is
  base64 of flattened little-endian int32 with logical shape
  ``[num_tokens - 1, num_layers, topk]``; same conventions as vLLM
  (layers/moe/routed_experts_capturer.py ``get_routed_experts`` at sgl-project/sglang@d4d0fc58).
  The request's ``routed_experts_start_len`` starts the rows at that token; the
  response does not repeat it (``GenerateReqInput`` in managers/io_struct.py at
  sgl-project/sglang@a6463a10). The compact wire format names its dtype (``int32``,
  ``uint16``, ``uint8``) in ``meta_info["routed_experts_dtype"]``, int32 when absent
  (state_capturer/routed_experts_wire.py at sgl-project/sglang@a6463a10, sglang #31219).
  ``/v1/completions`` returns ``routed_experts`` and ``routed_experts_dtype`` in the
  response's ``sglext`` object, built from the first of its ``n`` choices only
  (entrypoints/openai/protocol.py ``SglExt`` and serving_completions.py at
  sgl-project/sglang@a6463a10; sglang #17434).
* Megatron inference (0.19): ``DynamicInferenceRequest.routing_indices`` is int32
  ``[num_tokens - 1, num_moe_layers, topk]`` (one row per ``RouterReplay``, i.e. per
  MoE layer), rebuilt per KV block; the OpenAI server returns it as a choice's
  ``moe_topk_indices`` and its prompt rows again as ``prompt_moe_topk_indices``
  (inference_request.py, endpoints/completions.py at NVIDIA/Megatron-LM core_v0.19.0).
* Megatron (R2 recording): each rank/chunk returns ``[L_local, n_local, topk]`` in
  router order; the plans they were recorded under map them back. A token must be
  recorded at every MoE layer or at none.
* Raw arrays: ``[tokens, layers, topk]``; a token whose rows are all -1 at every
  layer has no route.

Validity is per token (:class:`RolloutRoutes`): a token replays at every MoE
layer or at none. In the int32 vLLM and SGLang layouts an all-zero row of a MoE
layer with ``topk >= 2`` cannot be a route (it repeats expert 0); it is a capture
gap (e.g. a token the engine took from its prefix cache). The whole token then has
no route, at every MoE layer, so it is never replayed as expert 0 and the live
router decides it everywhere; a sample whose rows are all zero is refused (the
capture never ran). The split vLLM layout and Megatron's store routes per KV block
and have no gaps: there a repeated expert is refused, naming sample, token and layer.
"""

from __future__ import annotations

import base64
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from megatron_r3.dataplane.device.packing import scatter_routes
from megatron_r3.dataplane.device.plan import RoutingPlan
from megatron_r3.dataplane.route_checks import (
    REPEATED_CAUSE,
    RoutingValidationError,
    check_integer_dtype,
    token_validity,
)
from megatron_r3.dataplane.routes import RolloutRoutes, _as_numpy, id_dtype
from megatron_r3.dataplane.samples import RoutingSpec


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
        ids = _moe_rows(ids, spec, sample, dense_fill=(-1, 0))
    elif layers != "moe":
        raise ValueError(f"layers must be 'moe' or 'full', got {layers!r}")
    return RolloutRoutes.from_ids(
        ids, num_experts=spec.num_experts, layer_numbers=spec.model_moe_layers, topk=spec.topk, valid=valid,
        num_tokens=num_tokens, sample=sample,
    )


def from_vllm(
    output: Any, spec: RoutingSpec, *, num_tokens: Optional[int] = None, sample: Optional[int] = None
) -> RolloutRoutes:
    """vLLM ``CompletionOutput.routed_experts`` (or that array itself).

    Args:
        output: A ``CompletionOutput`` (anything with ``.routed_experts``) or the
            ``np.int32 [num_tokens - 1, num_hidden_layers, topk]`` array.
        spec: The model.
        num_tokens: ``len(prompt_token_ids) + len(token_ids)``; checked against the
            array when given.
        sample: Sample index for error messages.
    """
    routed = getattr(output, "routed_experts", output)
    if routed is None:
        raise RoutingValidationError(
            f"sample {sample}: vLLM returned no routed_experts (enable_return_routed_experts=True?)"
        )
    return _from_engine_rows(_as_numpy(routed), spec, num_tokens, sample, "vLLM")


def from_vllm_split(
    prompt_routes: Any, completion_routes: Any, spec: RoutingSpec, *, prompt_len: int, completion_len: int,
    prompt_start: int = 0, layers: str = "moe", sample: Optional[int] = None,
) -> RolloutRoutes:
    """vLLM's split layout: the request's ``prompt_routed_experts`` and one completion's ``routed_experts``.

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
        layers: ``"moe"``: one row per MoE layer (vLLM's layout); ``"full"``: one row per decoder
            layer, dense layers zero.
        sample: Sample index for error messages.

    Rows are validated strictly: the connector stores routes per KV block and has no
    capture gaps, so a zero-filled row is a repeated expert and refused.
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
    moe_rows = []
    for field, rows, need, most in parts:
        if rows.ndim != 3:
            raise RoutingValidationError(f"sample {sample}: vLLM {field} must be 3-D, got shape {rows.shape}")
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
        moe_rows.append(_layer_rows(rows[:need], spec, layers, sample, f"vLLM {field}"))
    num_tokens = prompt_len + completion_len
    ids = np.zeros((num_tokens, len(spec.model_moe_layers), spec.topk), np.int32)
    valid = np.zeros(num_tokens, np.bool_)
    filled = np.concatenate(moe_rows).astype(np.int32) if moe_rows else ids[:0]
    ids[prompt_start:prompt_start + len(filled)] = filled
    valid[prompt_start:prompt_start + len(filled)] = True
    return RolloutRoutes.from_ids(
        ids, num_experts=spec.num_experts, layer_numbers=spec.model_moe_layers, topk=spec.topk, valid=valid,
        num_tokens=num_tokens, sample=sample,
    )


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
    ``uint8``), int32 when absent (SGLang before the compact wire format).
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
    start_len = _start_len(start_len, num_tokens, sample)
    field = f"{field}['routed_experts']"
    if dtype_name not in SGLANG_WIRE_DTYPES:
        raise RoutingValidationError(
            f"sample {sample}: {field}: routed_experts_dtype {dtype_name!r} is not one of "
            f"{sorted(SGLANG_WIRE_DTYPES)}"
        )
    if isinstance(payload, (str, bytes)):
        try:
            flat = np.frombuffer(base64.b64decode(payload, validate=True), dtype=SGLANG_WIRE_DTYPES[dtype_name])
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
    return _from_engine_rows(flat, spec, num_tokens, sample, "SGLang", start=start_len)


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


def from_megatron_inference(
    routing: Any, spec: RoutingSpec, *, num_tokens: int, prompt_routing: Any = None, prompt_len: Optional[int] = None,
    sample: Optional[int] = None,
) -> RolloutRoutes:
    """Megatron's inference engine: ``request.routing_indices`` or a choice's ``moe_topk_indices``.

    Args:
        routing: int32 ``[num_tokens - 1, num_moe_layers, topk]``: an array, nested lists,
            Megatron's serialised ``{"data", "dtype"}`` or ``["ndarray", {"data", "dtype"}]``.
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
    if rows.ndim != 3 or rows.shape[1:] != (len(spec.model_moe_layers), spec.topk):
        raise RoutingValidationError(
            f"sample {sample}: Megatron routes have shape {rows.shape}; the model needs [tokens - 1, MoE layers, "
            f"topk] = [{num_tokens - 1}, {len(spec.model_moe_layers)}, {spec.topk}]"
        )
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
    return _from_engine_rows(rows, spec, num_tokens, sample, "Megatron", layers="moe", capture_gaps=False)


def route_array(value: Any, field: str, sample: Optional[int] = None) -> np.ndarray:
    """An engine's integer route array from what it returns or serialises.

    Accepts a numpy array or CPU tensor, nested lists, ``{"dtype", "shape", "base64"}``
    (little-endian bytes, this project's JSON form), and Megatron's serialised
    ``{"data", "dtype"}`` or ``["ndarray", {"data", "dtype"}]``.
    """
    try:
        if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == "ndarray":
            value = value[1]
        if isinstance(value, dict):
            if "base64" in value:
                dtype = np.dtype(value["dtype"]).newbyteorder("<")
                array = np.frombuffer(base64.b64decode(value["base64"], validate=True), dtype=dtype)
                array = array.reshape(value["shape"])
            else:
                array = np.asarray(value["data"], dtype=np.dtype(value["dtype"]))
        else:
            array = _as_numpy(value) if isinstance(value, torch.Tensor) else np.asarray(value)
    except (KeyError, TypeError, ValueError, OverflowError) as error:  # binascii.Error is a ValueError
        raise RoutingValidationError(
            f"sample {sample}: {field} must be an integer array, nested lists, {{\"dtype\", \"shape\", \"base64\"}} "
            f"or {{\"data\", \"dtype\"}} ({type(error).__name__}: {error})"
        ) from None
    check_integer_dtype(array, sample)
    return array


def _start_len(value: Any, num_tokens: Optional[int], sample: Optional[int]) -> int:
    """The request's ``routed_experts_start_len``: a count within the sample's routed tokens."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise RoutingValidationError(f"sample {sample}: routed_experts_start_len = {value!r} is not a count")
    if num_tokens is not None and value > num_tokens - 1:
        raise RoutingValidationError(
            f"sample {sample}: routed_experts_start_len {value} is beyond the {num_tokens - 1} routed tokens of a "
            f"{num_tokens}-token sample (SGLang takes it within the prompt)"
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
    rows: np.ndarray, spec: RoutingSpec, num_tokens: Optional[int], sample: Optional[int], engine: str,
    *, start: int = 0, layers: str = "full", capture_gaps: bool = True,
) -> RolloutRoutes:
    """Engine layout ``[num_tokens - 1 - start, num_layers, topk]`` -> container.

    The final sampled token has no route, nor has a token before ``start``. With
    ``capture_gaps`` an all-zero row (``topk >= 2``) is a capture gap: its token has no
    route; a sample with rows but none that is a route is refused (the capture never ran).
    Without it every row must be a route.
    """
    check_integer_dtype(rows, sample)
    if rows.ndim != 3:
        raise RoutingValidationError(f"sample {sample}: {engine} routes must be 3-D, got shape {rows.shape}")
    if num_tokens is None:
        num_tokens = rows.shape[0] + 1 + start
    if rows.shape[0] != num_tokens - 1 - start:
        raise RoutingValidationError(
            f"sample {sample}: {engine} routes cover {rows.shape[0]} tokens; a sample of {num_tokens} tokens "
            f"must have {num_tokens - 1 - start} (every token " + (f"from {start} on " if start else "")
            + "but the final sampled one)"
        )
    if rows.shape[2] != spec.topk:
        raise RoutingValidationError(
            f"sample {sample}: {engine} routes have top-k {rows.shape[2]}, the model routes to top-{spec.topk}"
        )
    moe = _layer_rows(rows, spec, layers, sample, f"{engine} routes")
    valid = np.zeros(num_tokens, dtype=np.bool_)
    valid[start:-1] = True  # the final sampled token was never run
    if capture_gaps and spec.topk >= 2 and len(moe):
        routed = (moe != 0).any(axis=2).all(axis=1)  # an all-zero row is a capture gap, not a route
        if not routed.any():
            raise RoutingValidationError(
                f"sample {sample}: token {start}, layer {spec.model_moe_layers[0]}: every {engine} route row is "
                f"all zeros ({len(moe)} tokens), i.e. expert 0 repeated{REPEATED_CAUSE}"
            )
        valid[start:-1] = routed
    ids = np.zeros((num_tokens,) + moe.shape[1:], moe.dtype)
    ids[start:num_tokens - 1] = moe
    return RolloutRoutes.from_ids(
        ids, num_experts=spec.num_experts, layer_numbers=spec.model_moe_layers, topk=spec.topk, valid=valid,
        num_tokens=num_tokens, sample=sample,
    )


def _layer_rows(rows: np.ndarray, spec: RoutingSpec, layers: str, sample: Optional[int], what: str) -> np.ndarray:
    """An engine array's layer axis -> MoE layers: ``"full"`` (every decoder layer, dense ones zero) or ``"moe"``."""
    if layers == "full":
        return _moe_rows(rows, spec, sample, dense_fill=(0,))
    if layers != "moe":
        raise ValueError(f"layers must be 'moe' or 'full', got {layers!r}")
    if rows.shape[1] != len(spec.model_moe_layers):
        hint = ""
        if rows.shape[1] == spec.num_layers:
            hint = " (one row per decoder layer: this build returns the full layer axis; read it with layers='full')"
        raise RoutingValidationError(
            f"sample {sample}: {what} have {rows.shape[1]} layers, the model has {len(spec.model_moe_layers)} MoE "
            f"layers{hint}"
        )
    return rows


def _moe_rows(ids: np.ndarray, spec: RoutingSpec, sample: Optional[int], dense_fill: tuple[int, ...]) -> np.ndarray:
    """Full-model layer axis -> MoE layers only; dense layers must hold only a filler value."""
    if ids.ndim != 3 or ids.shape[1] != spec.num_layers:
        raise RoutingValidationError(
            f"sample {sample}: routes have {ids.shape[1] if ids.ndim == 3 else '?'} layers, the model has "
            f"{spec.num_layers} decoder layers (shape {ids.shape})"
        )
    dense = np.asarray([n for n in range(1, spec.num_layers + 1) if n not in set(spec.model_moe_layers)])
    if len(dense):
        rows = ids[:, dense - 1]
        filled = np.zeros(rows.shape[:2], dtype=np.bool_)
        for value in dense_fill:
            filled |= (rows == value).all(axis=2)
        if not filled.all():
            token, layer = np.argwhere(~filled)[0]
            raise RoutingValidationError(
                f"sample {sample}: token {token}, layer {dense[layer]}: dense layer holds routes "
                f"{rows[token, layer].tolist()}; the layout does not fit moe layers {list(spec.model_moe_layers)}"
            )
    return ids[:, np.asarray(spec.model_moe_layers) - 1]
