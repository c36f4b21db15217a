"""Megatron's allgather token dispatcher with no shape set by the routes: no host sync at any expert-parallel size.

``MoEAllGatherTokenDispatcher`` gathers every rank's tokens, then copies its local experts' token
counts to the host (``.cpu()``, ``.item()``) to size the permutation: one wait on the device per MoE
layer and microbatch, and shapes that change with the routes, so the pass cannot be a CUDA graph.
:class:`StaticShapeAllGatherTokenDispatcher` sizes the permutation for the most rows its local experts
can receive, the gathered tokens times ``min(top-k, local experts)``, and keeps the counts on the device:

* the routed rows come first, in the order Megatron's permutation gives them (by local expert, then by
  token), the other rows after them. Megatron's own ``permute`` does this: with ``num_out_tokens`` its
  unfused form sorts the routing map (rows past the routed ones are tokens not routed here) and
  TransformerEngine's fused one writes the routed rows only;
* the experts take the counts on the device and compute the routed rows only (torch's grouped GEMM with
  device offsets, :class:`~megatron_r3.layers.grouped_experts.GroupedGemmExperts`), so the rows past the
  last expert's are never computed: their values are whatever the memory held;
* those rows never reach a routed value: the unfused permutation's rows past the routed ones are zeroed
  forward (so their gradient, which the experts leave unset, is dropped before it is added into the
  tokens' gradient) and zeroed again before the unpermutation adds the rows back into the tokens;
  TransformerEngine's fused unpermutation and its backward read the routed rows only.

The routed rows and the outputs are the same values as Megatron's dispatcher gives (CPU-tested over two
expert ranks). The cost is memory: the permuted activations hold the upper bound of rows, about
``min(top-k, local experts) / (top-k / expert ranks)`` times the routed ones (2 at two expert ranks with
``local experts >= top-k``), so it is opt-in (``--moe-allgather-static-shapes``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, permute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


class StaticShapeAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` whose permutation has a size fixed by the batch (see the module docstring)."""

    # The experts get the counts on the device (megatron_r3.rl.model.forward_graphs reads this).
    counts_stay_on_device = True

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The local experts' rows of the gathered tokens, routed rows first, and their counts on the device."""
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0).long()
        rows = self.local_map.shape[0] * min(self.router_topk, self.num_local_experts)
        fused = self.config.moe_permute_fusion
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden_states, self.local_map, probs=local_probs, num_out_tokens=rows, fused=fused)
        self.routed_rows = None
        if not fused:
            self.routed_rows = (torch.arange(rows, device=permuted.device) < tokens_per_expert.sum()).unsqueeze(-1)
            permuted = torch.where(self.routed_rows, permuted, 0)
            permuted_probs = torch.where(self.routed_rows.squeeze(-1), permuted_probs, 0)
        self.local_probs = permuted_probs
        self.routing_map = None
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' rows added back into the gathered tokens; rows past the routed ones count for nothing."""
        if self.routed_rows is not None:
            hidden_states = torch.where(self.routed_rows, hidden_states, 0)
        return super().combine_preprocess(hidden_states)


class StaticShapeMoELayer(MoELayer):
    """``MoELayer`` whose allgather dispatcher is :class:`StaticShapeAllGatherTokenDispatcher`.

    Raises:
        ValueError: The layer's dispatcher is not the allgather one, or its experts read their token
            counts on the host (they would compute the rows past the routed ones as tokens).
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        if pg_collection is None:  # as MoELayer does: the dispatcher below needs the same groups
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs)
        if config.moe_token_dispatcher_type != "allgather":
            raise ValueError("--moe-allgather-static-shapes needs --moe-token-dispatcher-type allgather")
        if not getattr(self.experts, "takes_device_tokens_per_expert", False):
            raise ValueError(f"--moe-allgather-static-shapes needs experts that take their token counts on the "
                             f"device (torch's grouped GEMM: GroupedGemmExperts), not {type(self.experts).__name__}")
        self.token_dispatcher = StaticShapeAllGatherTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection)
