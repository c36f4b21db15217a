"""Host-side checks of routing data, vectorised, before anything touches the GPU.

Every failure raises :class:`RoutingValidationError` whose message names the
sample, the token and the (1-based, global) layer of the first offending entry,
and how many entries are affected in total. Validity is per token: a token
replays at every MoE layer or at none.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class RoutingValidationError(ValueError):
    """Routing data that does not fit the model or the sample.

    Attributes:
        token: The sample's token the message names first, when it names one (lets a caller
            that assembled the sample from several fields name the field that token came from).
    """

    def __init__(self, message: str, token: Optional[int] = None):
        super().__init__(message)
        self.token = token


# A router's top-k never names an expert twice, so such a row was not written by a router.
REPEATED_CAUSE = (
    "; a top-k never repeats an expert: such rows are usually rows the engine zero-filled because its "
    "capture never ran (vLLM v0.26.0 with FlashInfer's monolithic MoE returned all-zero routes, vllm "
    "#54730; see also vllm #44116), or ids decoded with the wrong dtype"
)


def sample_prefix(sample: Optional[int]) -> str:
    """``"sample <n>: "`` for messages, or nothing when the sample is not known."""
    return "" if sample is None else f"sample {sample}: "


def check_integer_dtype(ids: np.ndarray, sample: Optional[int] = None) -> None:
    """Routes must be integers: a float array is a caller bug, not something to round."""
    if not np.issubdtype(ids.dtype, np.integer):
        raise RoutingValidationError(f"{sample_prefix(sample)}expert ids must be integers, got dtype {ids.dtype}")


def validate_routes(
    ids: np.ndarray,
    valid: np.ndarray,
    *,
    num_experts: int,
    topk: int,
    layer_numbers: Sequence[int],
    num_tokens: Optional[int] = None,
    sample: Optional[int] = None,
) -> None:
    """Checks one sample's routes; raises on the first problem.

    Args:
        ids: Integer array ``[num_tokens, num_moe_layers, topk]``.
        valid: Bool array ``[num_tokens]``; tokens without a route are not checked.
        num_experts: Experts per MoE layer; valid ids lie in ``[0, num_experts)``.
        topk: Experts per token.
        layer_numbers: Global 1-based MoE layer numbers, one per dim-1 row.
        num_tokens: The sample's token count, when known.
        sample: Index of the sample, for messages.

    Raises:
        RoutingValidationError: wrong dtype, rank, layer count, token count or
            top-k; an id outside ``[0, num_experts)``; a repeated id in one row.
    """
    where = sample_prefix(sample)
    check_integer_dtype(ids, sample)
    if ids.ndim != 3:
        raise RoutingValidationError(f"{where}routes must be [tokens, layers, topk], got shape {ids.shape}")
    if ids.shape[1] != len(layer_numbers):
        raise RoutingValidationError(
            f"{where}routes have {ids.shape[1]} layers, the model has {len(layer_numbers)} MoE layers "
            f"(layer numbers {list(layer_numbers)})"
        )
    if ids.shape[2] != topk:
        raise RoutingValidationError(f"{where}routes have top-k {ids.shape[2]}, the model routes to top-{topk}")
    if num_tokens is not None and ids.shape[0] != num_tokens:
        raise RoutingValidationError(f"{where}routes cover {ids.shape[0]} tokens, the sample has {num_tokens}")
    if valid.shape != ids.shape[:1] or valid.dtype != np.bool_:
        raise RoutingValidationError(
            f"{where}validity must be bool per token {ids.shape[:1]}, got {valid.dtype} {valid.shape}"
        )
    if ids.size == 0:
        return
    # Negative ids wrap to huge unsigned values, so one comparison checks both bounds.
    unsigned = ids.view(np.dtype(f"u{ids.dtype.itemsize}")) if ids.dtype.kind == "i" else ids
    if unsigned.max() >= num_experts:  # whole-array reduction first: the per-row mask is the slow path
        out_of_range = (unsigned >= num_experts).any(axis=2) & valid[:, None]
        _raise_first(out_of_range, ids, layer_numbers, where, f"expert id outside [0, {num_experts})")
    if topk > 1:
        # Narrow before the pairwise pass (4-8x less memory traffic); ids out of range are left only in
        # tokens without a route here, and whatever they wrap to is masked out below.
        small = unsigned.astype(np.uint8 if num_experts <= 256 else np.uint16, copy=False)
        repeated = _repeated_in_row(small) & valid[:, None]
        _raise_first(repeated, ids, layer_numbers, where, "repeated expert id in one token's row", REPEATED_CAUSE)


def rows_equal(ids: np.ndarray, value: int) -> np.ndarray:
    """``[T, L]`` bool of ``ids [T, L, K]``: every entry of the row (token, layer) is ``value``.

    A row of 1, 2 or 4 bytes is compared as one integer, a row of a multiple of 8 bytes one
    8-byte word at a time (uint8 ids top-8: one compare per row): numpy reduces a short last
    axis element by element, an order of magnitude slower.
    """
    tokens, layers, topk = ids.shape
    try:
        pattern = np.full(topk, value, ids.dtype)
    except OverflowError:  # -1 in an unsigned dtype: no row holds it
        return np.zeros((tokens, layers), dtype=np.bool_)
    width = topk * ids.itemsize
    if ids.size == 0 or not ids.flags.c_contiguous or not (width in (1, 2, 4) or width % 8 == 0):
        return (ids == value).all(axis=2)
    word = np.dtype(f"u{min(width, 8)}")
    words, want = ids.view(word), pattern.view(word)
    equal = words[..., 0] == want[0]
    for j in range(1, len(want)):
        equal &= words[..., j] == want[j]
    return equal


def token_validity(
    present: np.ndarray, layer_numbers: Sequence[int], what: str, sample: Optional[int] = None
) -> np.ndarray:
    """Per-token validity ``[T]`` from a per-row mask ``present [T, L]``: True where every row is present.

    A token with rows at some MoE layers only is an error, never half a route: the
    message names the sample, the token and its first missing layer, then ``what``.
    """
    valid = present.all(axis=1)
    partial = present.any(axis=1) & ~valid
    if partial.any():
        token = int(np.argmax(partial))
        layer = int(np.argmin(present[token]))
        raise RoutingValidationError(
            f"{sample_prefix(sample)}token {token}, layer {layer_numbers[layer]}: {what}; a token replays at every "
            f"MoE layer or at none ({int(partial.sum())} partial tokens in total)",
            token=token,
        )
    return valid


def _repeated_in_row(ids: np.ndarray) -> np.ndarray:
    """[T, L] mask of rows holding an id twice. Pairwise compares beat a sort for the usual small top-k."""
    topk = ids.shape[2]
    if topk > 16:
        ordered = np.sort(ids, axis=2)
        return (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    columns = np.ascontiguousarray(np.moveaxis(ids, 2, 0))  # [topk, T, L]: contiguous compares
    repeated = np.zeros(ids.shape[:2], dtype=np.bool_)
    for i in range(topk):
        for j in range(i + 1, topk):
            repeated |= columns[i] == columns[j]
    return repeated


def _raise_first(bad: np.ndarray, ids: np.ndarray, layer_numbers: Sequence[int], where: str, what: str,
                 cause: str = "") -> None:
    if not bad.any():
        return
    token, layer = np.argwhere(bad)[0]
    raise RoutingValidationError(
        f"{where}token {token}, layer {layer_numbers[layer]}: {what}: {ids[token, layer].tolist()} "
        f"({int(bad.sum())} bad rows in total){cause}",
        token=int(token),
    )
