"""Which experts each token went to, by global token id, under any layout.

The MoE router sees hidden states ``[s_local, b, h]`` flattened s-major: ``s_local``
is this rank's CP chunks of the sequence, cut again into ``tp`` contiguous slices
under sequence parallelism (a packed THD batch is ``[t_local, 1, h]``).
:func:`router_token_index` gives the global token id of each router row, and
:class:`RouterRecorder` uses it to record routing decisions in layout-independent
form, plus how close each decision was to a tie.
"""

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from tests.support.batches import Microbatch


def router_token_index(mb: Microbatch, sequence_parallel: bool) -> torch.Tensor:
    """Global token id of each row the router sees for ``mb`` on this rank (-1: padding).

    Args:
        mb: This rank's microbatch.
        sequence_parallel: Whether SP slices the sequence across the TP group.

    Returns:
        int64 ``[s_local * b]`` in the router's (s-major) row order.
    """
    index = mb.token_index.t()  # [s, b], the model's layout
    if sequence_parallel:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        index = index.chunk(tp_size, dim=0)[tp_rank]
    return index.reshape(-1)


class RouterRecorder:
    """Records the routing decisions of every MoE layer of some model chunks.

    Wrap each microbatch's model forward in :meth:`microbatch`; router calls
    outside it (recompute during backward) are not recorded, so each token is
    recorded once per layer. Per global MoE layer it keeps:

    * ``routes[layer]``: list of ``(token ids [n], experts [n, k])``, experts in
      ascending order, padding rows dropped;
    * ``margins[layer]``: the smallest top-k margin ``logit[k-th] - logit[(k+1)-th]``
      over all recorded tokens: how far the closest decision was from a tie
      (meaningful for score functions that rank experts by logit: softmax, and
      sigmoid without expert bias).

    Args:
        chunks: This rank's model chunks.
        sequence_parallel: ``config.sequence_parallel``.
    """

    def __init__(self, chunks, sequence_parallel: bool):
        self.sequence_parallel = sequence_parallel
        self.routes: dict[int, list] = {}
        self.margins: dict[int, float] = {}
        self._rows = None
        self._handles = []
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, TopKRouter):
                    layer = _layer_of(chunk, name)
                    self._handles.append(module.register_forward_hook(self._hook(layer)))

    @contextlib.contextmanager
    def microbatch(self, mb: Microbatch):
        """Attribute the router calls inside this block to ``mb``."""
        self._rows = router_token_index(mb, self.sequence_parallel)
        try:
            yield
        finally:
            self._rows = None

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(router, args, output):
            if self._rows is None:
                return
            _, routing_map = output
            with torch.no_grad():
                num_experts = routing_map.size(-1)
                logits = router.gating(args[0]).reshape(-1, num_experts).float()
                top = logits.topk(router.topk + 1, dim=-1).values
                margin = (top[:, router.topk - 1] - top[:, router.topk]).min().item()
                experts = routing_map.reshape(-1, num_experts).nonzero()[:, 1]
                experts = experts.view(-1, router.topk).cpu()
            rows = self._rows.to(experts.device)
            real = rows >= 0
            self.routes.setdefault(layer, []).append((rows[real], experts[real]))
            self.margins[layer] = min(margin, self.margins.get(layer, float("inf")))

        return hook


def _layer_of(chunk, module_name: str) -> int:
    local = int(module_name.split("decoder.layers.")[1].split(".")[0])
    return chunk.decoder.layers[local].layer_number - 1


def full_routes(per_rank: list[dict], num_tokens: int, topk: int) -> dict[int, torch.Tensor]:
    """Routes of all ranks as ``{layer: experts [num_tokens, k]}`` (-1: never routed).

    Ranks that route the same token (TP replicas without SP) must agree.

    Args:
        per_rank: Each rank's ``RouterRecorder.routes``.
        num_tokens: Number of global token ids.
        topk: Experts per token.
    """
    out = {}
    for routes in per_rank:
        for layer, records in routes.items():
            full = out.setdefault(layer, torch.full((num_tokens, topk), -1, dtype=torch.long))
            for rows, experts in records:
                seen = full[rows, 0] >= 0
                agree = torch.equal(full[rows][seen], experts[seen])
                assert agree, f"layer {layer}: ranks disagree on a token's experts"
                full[rows] = experts
    return out
