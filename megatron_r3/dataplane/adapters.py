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
  has no route.
* SGLang (``--enable-return-routed-experts``): ``meta_info["routed_experts"]`` is
  base64 of flattened little-endian int32 with logical shape
  ``[num_tokens - 1, num_layers, topk]``; same conventions as vLLM.
* Megatron (R2 recording): each rank/chunk returns ``[L_local, n_local, topk]`` in
  router order; the plans they were recorded under map them back. A token must be
  recorded at every MoE layer or at none.
* Raw arrays: ``[tokens, layers, topk]``; a token whose rows are all -1 at every
  layer has no route.

Validity is per token (:class:`RolloutRoutes`): a token replays at every MoE
layer or at none. In engine layouts an all-zero row of a MoE layer with
``topk >= 2`` cannot be a route (it repeats expert 0); it is a capture gap (e.g.
a token the engine took from its prefix cache). The whole token then has no
route, at every MoE layer, so it is never replayed as expert 0 and the live
router decides it everywhere.
"""

from __future__ import annotations

import base64
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from megatron_r3.dataplane.packing import scatter_routes
from megatron_r3.dataplane.plan import RoutingPlan
from megatron_r3.dataplane.routes import RolloutRoutes, _as_numpy, id_dtype
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.validation import RoutingValidationError, check_integer_dtype, token_validity


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


def from_sglang(
    meta_info: Union[dict, str, bytes], spec: RoutingSpec, *, num_tokens: Optional[int] = None,
    sample: Optional[int] = None,
) -> RolloutRoutes:
    """SGLang ``meta_info["routed_experts"]`` (base64 of flattened int32 ``[num_tokens - 1, num_layers, topk]``).

    Args:
        meta_info: The response's ``meta_info`` dict, or its ``routed_experts`` payload
            (base64, or an already decoded int32 array).
        spec: The model.
        num_tokens: The sample's token count; default ``prompt_tokens +
            completion_tokens`` from ``meta_info`` when present.
        sample: Sample index for error messages.
    """
    field = "SGLang meta_info['routed_experts']"
    payload = meta_info
    if isinstance(meta_info, dict):
        if "routed_experts" not in meta_info:
            raise RoutingValidationError(
                f"sample {sample}: SGLang meta_info has no routed_experts (--enable-return-routed-experts?)"
            )
        payload = meta_info["routed_experts"]
        if num_tokens is None and "prompt_tokens" in meta_info and "completion_tokens" in meta_info:
            num_tokens = int(meta_info["prompt_tokens"]) + int(meta_info["completion_tokens"])
    if isinstance(payload, (str, bytes)):
        try:
            flat = np.frombuffer(base64.b64decode(payload, validate=True), dtype="<i4")
        except ValueError as error:  # binascii.Error, or bytes that are not whole int32 values
            raise RoutingValidationError(f"sample {sample}: {field} is not base64 of int32 values ({error})") from None
    elif isinstance(payload, (list, np.ndarray, torch.Tensor)):  # already decoded int32
        try:
            flat = _as_numpy(payload).reshape(-1)
        except ValueError as error:  # ragged nested lists
            raise RoutingValidationError(f"sample {sample}: {field} is not an array of int32 ({error})") from None
    else:
        raise RoutingValidationError(f"sample {sample}: {field} must be a base64 string, got {type(payload).__name__}")
    row = spec.num_layers * spec.topk
    # The payload is flat: name the shape it must have rather than guess which dimension is off.
    if num_tokens is not None and flat.size != (num_tokens - 1) * row:
        raise RoutingValidationError(
            f"sample {sample}: {field} holds {flat.size} int32 values; this sample needs [tokens - 1, layers, "
            f"topk] = [{num_tokens - 1}, {spec.num_layers}, {spec.topk}] = {(num_tokens - 1) * row} (every token "
            f"but the final sampled one, every decoder layer, top-{spec.topk})"
        )
    if flat.size % row:
        raise RoutingValidationError(
            f"sample {sample}: {field} holds {flat.size} int32 values, not a whole number of "
            f"[layers, topk] = [{spec.num_layers}, {spec.topk}] rows of a [tokens - 1, layers, topk] array"
        )
    flat = flat.reshape(-1, spec.num_layers, spec.topk)
    return _from_engine_rows(flat, spec, num_tokens, sample, "SGLang")


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
    rows: np.ndarray, spec: RoutingSpec, num_tokens: Optional[int], sample: Optional[int], engine: str
) -> RolloutRoutes:
    """Engine layout ``[num_tokens - 1, num_layers, topk]`` -> container.

    The final sampled token has no route, and neither has a token with a capture gap at any MoE layer.
    """
    check_integer_dtype(rows, sample)
    if rows.ndim != 3:
        raise RoutingValidationError(f"sample {sample}: {engine} routes must be 3-D, got shape {rows.shape}")
    if num_tokens is None:
        num_tokens = rows.shape[0] + 1
    if rows.shape[0] != num_tokens - 1:
        raise RoutingValidationError(
            f"sample {sample}: {engine} routes cover {rows.shape[0]} tokens; a sample of {num_tokens} tokens "
            f"must have {num_tokens - 1} (every token but the final sampled one)"
        )
    if rows.shape[2] != spec.topk:
        raise RoutingValidationError(
            f"sample {sample}: {engine} routes have top-k {rows.shape[2]}, the model routes to top-{spec.topk}"
        )
    moe = _moe_rows(rows, spec, sample, dense_fill=(0,))
    valid = np.ones(num_tokens, dtype=np.bool_)
    valid[-1] = False  # the final sampled token was never run
    if spec.topk >= 2:
        valid[:-1] = (moe != 0).any(axis=2).all(axis=1)  # an all-zero row is a capture gap, not a route
    ids = np.concatenate([moe, np.zeros((1,) + moe.shape[1:], moe.dtype)])
    return RolloutRoutes.from_ids(
        ids, num_experts=spec.num_experts, layer_numbers=spec.model_moe_layers, topk=spec.topk, valid=valid,
        num_tokens=num_tokens, sample=sample,
    )


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
