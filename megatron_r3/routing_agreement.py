"""How often the trainer's own router agrees with the routes it replays.

Under replay every router still runs its live top-k (patch "moe: per-microbatch
routing replay"); ``MoERouting.live_expert_ids()`` keeps it beside the routes
taken. A (token, MoE layer) pair *agrees* when the live top-k set equals the
replayed set. Agreement below 1 is exactly what replay corrects: without it
those tokens would have gone to other experts than the rollout engine's.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_r3.routing_replay import MoERouting


def routing_agreement_counts(routing: MoERouting, moe_layer_numbers: Sequence[int]) -> torch.Tensor:
    """Per MoE layer of the model: replayed (token, layer) pairs, and those where the live top-k agrees.

    Args:
        routing: The ``MoERouting`` of one forward of one model chunk, after the forward.
        moe_layer_numbers: All MoE layer numbers of the model, increasing; the columns.

    Returns:
        float64 ``[2, len(moe_layer_numbers)]`` on the routes' device: row 0 agreeing pairs,
        row 1 replayed pairs. Layers this chunk does not build, and a routing that
        replayed nothing, count zero.
    """
    counts = torch.zeros((2, len(moe_layer_numbers)), dtype=torch.float64,
                         device=routing.expert_ids.device if routing.expert_ids is not None else None)
    if routing.expert_ids is None or not routing.layer_numbers:
        return counts
    replayed = routing.expert_ids[..., 0] >= 0  # [L_local, n_local]; -1 rows were routed live
    live = routing.live_expert_ids().sort(dim=-1).values
    given = routing.expert_ids.sort(dim=-1).values
    agree = (live == given).all(dim=-1) & replayed
    columns = torch.tensor([list(moe_layer_numbers).index(n) for n in routing.layer_numbers], device=counts.device)
    counts[0, columns] = agree.sum(dim=1).to(torch.float64)
    counts[1, columns] = replayed.sum(dim=1).to(torch.float64)
    return counts
