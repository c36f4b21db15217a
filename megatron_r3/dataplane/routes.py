"""The routing container: one sample's experts per token and MoE layer, stored compactly.

Ids are stored as ``uint8`` for up to 256 experts and ``int16`` above (never
int32/int64 on the host: a 32k-token sample of a 48-layer top-8 model is 12.6
MB as uint8 against 50 MB as int32). A bool ``valid[token]`` says whether the
token has a route: a token replays at every MoE layer or at none. A token
without one means "no route: the live router decides this token at every MoE
layer" (padding, the final sampled token the engine never ran, capture gaps);
its ids hold zeros and are never read as routes. Validity costs one byte per
token, ``1 / (layers * topk)`` bytes per routing entry (1.003 at 48 layers, top-8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from megatron_r3.dataplane.route_checks import (
    RoutingValidationError,
    check_integer_dtype,
    rows_equal,
    token_validity,
    validate_routes,
)


def id_dtype(num_experts: int) -> np.dtype:
    """The compact dtype for ``num_experts``: uint8 up to 256, int16 up to 32768."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise ValueError(f"{num_experts} experts do not fit int16 routing ids")


@dataclass
class RolloutRoutes:
    """One sample's routes, ``[num_tokens, num_moe_layers, topk]``, plus their meaning.

    Build it with :meth:`from_ids` (or an adapter in :mod:`megatron_r3.dataplane.engines.adapters`),
    which validates and compacts; the constructor trusts its input.

    Attributes:
        ids: ``uint8`` (<= 256 experts) or ``int16`` ``[num_tokens, num_moe_layers, topk]``.
        valid: bool ``[num_tokens]``; False = the token has no route at any MoE layer.
        num_experts: Routed experts per MoE layer.
        layer_numbers: Global 1-based layer numbers of the MoE layers, increasing,
            one per dim-1 row (``TransformerLayer.layer_number``).
    """

    ids: np.ndarray
    valid: np.ndarray
    num_experts: int
    layer_numbers: tuple[int, ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def topk(self) -> int:
        return self.ids.shape[2]

    @property
    def nbytes(self) -> int:
        """Host bytes held: the ids and one validity byte per token."""
        return self.ids.nbytes + self.valid.nbytes

    @classmethod
    def from_ids(
        cls,
        ids: np.ndarray,
        *,
        num_experts: int,
        layer_numbers: Sequence[int],
        topk: Optional[int] = None,
        valid: Optional[np.ndarray] = None,
        num_tokens: Optional[int] = None,
        sample: Optional[int] = None,
    ) -> "RolloutRoutes":
        """Validates integer ids ``[tokens, moe_layers, topk]`` and stores them compactly.

        Args:
            ids: Any integer array (numpy or torch on CPU). A token whose rows are all
                -1 at every layer has no route, unless ``valid`` is given.
            num_experts: Routed experts per MoE layer.
            layer_numbers: 1-based global MoE layer numbers, increasing.
            topk: Expected top-k (default: whatever ``ids`` has).
            valid: Optional bool ``[tokens]``, per token; default: False where a token's rows
                are all -1 at every layer.
            num_tokens: Expected token count of the sample.
            sample: Sample index for error messages.

        Raises:
            RoutingValidationError: see :func:`megatron_r3.dataplane.route_checks.validate_routes`; without
                ``valid``, also a token with rows of all -1 at some layers but routes at others.
        """
        ids = _as_numpy(ids)
        check_integer_dtype(ids, sample)
        layer_numbers = tuple(int(n) for n in layer_numbers)
        if any(b <= a for a, b in zip(layer_numbers, layer_numbers[1:])) or any(n < 1 for n in layer_numbers):
            raise RoutingValidationError(f"layer numbers must be 1-based and increasing, got {layer_numbers}")
        if ids.ndim != 3:
            raise RoutingValidationError(f"routes must be [tokens, layers, topk], got shape {ids.shape}")
        no_route = None
        if valid is None:
            no_route = rows_equal(ids, -1)
            valid = ~no_route.any(axis=1)  # a token with -1 rows at some layers only is rejected below
        else:
            valid = np.ascontiguousarray(_as_numpy(valid), dtype=np.bool_)
        validate_routes(
            ids,
            valid,
            num_experts=num_experts,
            topk=ids.shape[2] if topk is None else topk,
            layer_numbers=layer_numbers,
            num_tokens=num_tokens,
            sample=sample,
        )
        if no_route is not None:  # after the shape checks: the message names layers by number
            token_validity(
                ~no_route, layer_numbers, "no route (a row of -1) at this layer but routes at others", sample
            )
        compact = np.array(ids, dtype=id_dtype(num_experts), order="C")  # a copy: the caller's array stays theirs
        if not valid.all():
            compact[~valid] = 0
        return cls(compact, valid, int(num_experts), layer_numbers)

    @classmethod
    def empty(cls, num_tokens: int, *, num_experts: int, topk: int, layer_numbers: Sequence[int]) -> "RolloutRoutes":
        """A sample with no routes at all (every token routed live); the target of recording."""
        n_layers = len(layer_numbers)
        return cls(
            np.zeros((num_tokens, n_layers, topk), id_dtype(num_experts)),
            np.zeros(num_tokens, np.bool_),
            int(num_experts),
            tuple(int(n) for n in layer_numbers),
        )

    def to_int64(self) -> np.ndarray:
        """Ids widened to int64, -1 at every layer of tokens without a route (for inspection and tests)."""
        out = self.ids.astype(np.int64)
        out[~self.valid] = -1
        return out

    def select_layers(self, layer_numbers: Sequence[int]) -> "RolloutRoutes":
        """The same routes restricted to (a subset of) this sample's MoE layers."""
        index = layer_index(self.layer_numbers, layer_numbers)
        return RolloutRoutes(
            np.ascontiguousarray(self.ids[:, index]),
            self.valid.copy(),
            self.num_experts,
            tuple(layer_numbers),
        )


def layer_index(available: Sequence[int], wanted: Sequence[int]) -> np.ndarray:
    """Positions of ``wanted`` layer numbers in ``available``; a missing layer is an error."""
    position = {n: i for i, n in enumerate(available)}
    missing = [n for n in wanted if n not in position]
    if missing:
        raise RoutingValidationError(f"routes have no MoE layer {missing} (they hold layers {list(available)})")
    return np.asarray([position[n] for n in wanted], dtype=np.int32)


def concat_routes(samples: Sequence[RolloutRoutes]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates samples along tokens: the packing source ``(ids [N, L, K], valid [N])``.

    All samples must share experts, top-k and layer numbers. Row ``offset_i + t``
    is token t of sample i, where ``offset_i`` is the sum of earlier samples' token counts.
    """
    if not samples:
        raise ValueError("no samples")
    head = samples[0]
    for i, s in enumerate(samples):
        if (s.num_experts, s.topk, s.layer_numbers) != (head.num_experts, head.topk, head.layer_numbers):
            raise RoutingValidationError(
                f"sample {i}: routes have (experts, topk, layers) = {(s.num_experts, s.topk, s.layer_numbers)}, "
                f"sample 0 has {(head.num_experts, head.topk, head.layer_numbers)}"
            )
    if len(samples) == 1:
        return head.ids, head.valid
    return np.concatenate([s.ids for s in samples]), np.concatenate([s.valid for s in samples])


def _as_numpy(array) -> np.ndarray:
    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu().numpy()
    return np.asarray(array)
