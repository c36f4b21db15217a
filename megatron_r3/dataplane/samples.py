"""The two types every part of the data plane shares: a rollout sample and the model its routes are for.

:class:`RolloutSample` is what a rollout engine returns for one prompt and completion
(tokens, loss mask, log-probs, routes) and what the trainer packs; the rollout dump
(:mod:`megatron_r3.dataplane.formats.rollout_dump`) stores it. :class:`RoutingSpec` says what a
model's routes must look like (its MoE layers, experts, top-k); every adapter and check
of routes takes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.layers.moe_layers import hybrid_moe_layers, model_moe_layers, mtp_moe_layers


@dataclass
class RolloutSample:
    """One rollout sample as stored in a dump.

    Attributes:
        token_ids: int32 ``[T]``, prompt and generated tokens.
        loss_mask: bool ``[T]``.
        logprobs: Optional float32 ``[T]``, the rollout engine's log-prob of each token.
        routes: Optional routes over the same T tokens.
        meta: JSON-serialisable per-sample metadata.
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: Optional[np.ndarray] = None
    routes: Optional[RolloutRoutes] = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def unscored(cls, token_ids) -> "RolloutSample":
        """A sample to run through the model: its tokens (int64), no loss anywhere."""
        ids = np.asarray(token_ids, dtype=np.int64)
        return cls(token_ids=ids, loss_mask=np.zeros(len(ids), dtype=bool))


@dataclass(frozen=True)
class RoutingSpec:
    """What routes must look like for one model.

    Attributes:
        num_layers: Decoder layers of the full model (``num_hidden_layers``).
        model_moe_layers: The model's MoE layers: global 1-based layer numbers, increasing.
        num_experts: Routed experts per MoE layer.
        topk: Experts per token.
        mtp_moe_layers: The MoE layers of the model's multi-token-prediction block, numbered after
            the decoder's (``num_layers + k`` for GPTModel's depth k; docs/routing_replay.md), increasing;
            empty for a model without MTP MoE layers. Routes may cover them when the engine
            returned them; without such routes they route live.
    """

    num_layers: int
    model_moe_layers: tuple[int, ...]
    num_experts: int
    topk: int
    mtp_moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        # Named by the flags that set them (the launcher's and the tools'), before any route is read.
        if self.num_experts < 1:
            raise ValueError(f"--num-experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk {self.topk} must lie in [1, --num-experts {self.num_experts}]")
        mtp = tuple(self.mtp_moe_layers)
        if any(n <= self.num_layers for n in mtp) or any(b <= a for a, b in zip(mtp, mtp[1:])):
            raise ValueError(f"MTP MoE layers {mtp} must be increasing and numbered after the {self.num_layers} "
                             f"decoder layers")

    @property
    def routed_layers(self) -> tuple[int, ...]:
        """Every MoE layer routes may cover: the decoder's, then the MTP block's."""
        return tuple(self.model_moe_layers) + tuple(self.mtp_moe_layers)

    def mtp_live_tokens(self, routes: RolloutRoutes) -> int:
        """Tokens of a sample that the model's MTP MoE layers route live.

        Every token where the routes do not cover the MTP layers (the engine returned none:
        vLLM, SGLang and TensorRT-LLM capture the decoder only), else the tokens without a
        route; 0 for a model without MTP MoE layers.
        """
        if not self.mtp_moe_layers:
            return 0
        if set(self.mtp_moe_layers) <= set(routes.layer_numbers):
            return int(routes.num_tokens - routes.valid.sum())
        return routes.num_tokens

    @classmethod
    def from_config(cls, config: Any, hybrid_layer_pattern: Optional[str] = None) -> "RoutingSpec":
        """From a Megatron ``TransformerConfig`` (``num_layers``, ``moe_layer_freq``,
        ``num_moe_experts``, ``moe_router_topk``); a HybridModel's MoE layers are the ``E`` layers
        of its ``hybrid_layer_pattern``."""
        if hybrid_layer_pattern is not None:
            moe_layers = hybrid_moe_layers(hybrid_layer_pattern)
        else:
            moe_layers = model_moe_layers(config.num_layers, config.moe_layer_freq)
        return cls(
            num_layers=config.num_layers,
            model_moe_layers=moe_layers,
            num_experts=config.num_moe_experts,
            topk=config.moe_router_topk,
            mtp_moe_layers=mtp_moe_layers(config.num_layers, moe_layers, getattr(config, "mtp_num_layers", None),
                                          hybrid_layer_pattern),
        )
