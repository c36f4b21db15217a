"""How often the trainer's own router agrees with the rollout engine's routes.

A (token, MoE layer) pair with an engine route *agrees* when the trainer's live top-k set
equals the engine's set. Agreement below 1 is exactly what replay corrects: without it
those tokens would have gone to other experts than the engine's. The trainer's choice
comes from a pass that routes live (``MoERouting.recorded_expert_ids()``), or from a
replayed pass that keeps its live top-k (``keep_live_routes=True``,
``MoERouting.live_expert_ids()``); only a pass that asks pays for the measurement.
"""

from __future__ import annotations

from typing import Sequence

import torch


def routing_agreement_counts(
    engine_ids: torch.Tensor,
    trainer_ids: torch.Tensor,
    layer_numbers: Sequence[int],
    model_moe_layers: Sequence[int],
) -> torch.Tensor:
    """Per MoE layer of the model: pairs with an engine route, and those where the trainer agrees.

    Args:
        engine_ids: int64 ``[len(layer_numbers), n_local, topk]``, the engine's routes of one
            model chunk's microbatch; rows of -1 have no route and do not count.
        trainer_ids: The trainer's own top-k for the same tokens, same shape.
        layer_numbers: The MoE layer of each row.
        model_moe_layers: All MoE layer numbers of the model, increasing; the columns.

    Returns:
        float64 ``[2, len(model_moe_layers)]`` on the routes' device: row 0 agreeing pairs,
        row 1 pairs with an engine route. Layers this chunk does not build count zero.
    """
    counts = torch.zeros((2, len(model_moe_layers)), dtype=torch.float64, device=engine_ids.device)
    if not len(layer_numbers):
        return counts
    routed = engine_ids[..., 0] >= 0  # [L_local, n_local]
    agree = (trainer_ids.sort(dim=-1).values == engine_ids.sort(dim=-1).values).all(dim=-1) & routed
    columns = torch.tensor([list(model_moe_layers).index(n) for n in layer_numbers], device=counts.device)
    counts[0, columns] = agree.sum(dim=1).to(torch.float64)
    counts[1, columns] = routed.sum(dim=1).to(torch.float64)
    return counts
