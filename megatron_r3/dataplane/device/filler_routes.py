"""Filler routes for positions whose output no loss can see, so a microbatch routes every token.

Under causal attention a position's output reaches only later positions of its
attention segment: its own sequence in a packed THD row (per-sequence
``cu_seqlens``), the whole row in BSHD without a document mask. The loss, the
log-probs the trainer uses and every gradient come from *loss-bearing* positions:
position ``t`` predicts token ``t + 1`` and bears a loss where that token is trained.
So a position after the last loss-bearing one of its segment (every sample's final
token, which the rollout engine sampled but never ran; the padding after a
sequence) changes nothing that is computed from the batch, whatever experts it goes
to. Such a *dead* position without a recorded route gets a route chosen on the host
(:func:`filler_expert_ids`): deterministic, ``topk`` distinct experts, consecutive
positions cycling through the experts so that no expert gets a burst. Then every
token of the microbatch has a route, and the alltoall dispatcher takes its split
sizes from the host (no device sync).

A position that does reach a loss and has no route (a prompt token the engine did
not report, a capture gap) keeps routing live, and its microbatch keeps Megatron's
path: :func:`fill_dead_positions` refuses to give it a filler.

Dead positions are also left out of the load-balancing statistics (aux loss,
z-loss, expert-bias token counts), whether they replay fillers or route live: they
are passed to the model as Megatron's ``padding_mask``. A batch is then computed the
same with fillers as with those positions routed live.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_r3.dataplane.routes import RolloutRoutes


def first_dead_position(loss_mask: np.ndarray) -> int:
    """The first position of a segment whose output no loss can see.

    Args:
        loss_mask: bool ``[n]`` per token of the segment: the token is trained on.
            Position ``t`` predicts token ``t + 1``.

    Returns:
        One past the last loss-bearing position: the index of the last trained token
        (ignoring token 0, which no position predicts), or 0 when nothing is trained.
    """
    trained = np.flatnonzero(np.asarray(loss_mask, dtype=bool)[1:])
    return int(trained[-1]) + 1 if len(trained) else 0


def first_dead_positions(loss_masks: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """:func:`first_dead_position` of several segments at once.

    Args:
        loss_masks: The segments' loss masks end to end, ``[sum(lengths)]``.
        lengths: int ``[num_segments]``.

    Returns:
        int64 ``[num_segments]``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    trained = np.asarray(loss_masks, dtype=bool).copy()
    trained[starts[lengths > 0]] = False  # token 0 of a segment: no position predicts it
    where = np.flatnonzero(trained)
    # The last trained token before each segment's end, if it lies in the segment.
    last = np.searchsorted(where, starts + lengths) - 1
    found = last >= 0
    found[found] = where[last[found]] >= starts[found]
    return np.where(found, where[np.maximum(last, 0)] - starts, 0) if len(where) else np.zeros_like(lengths)


def filler_expert_ids(count: int, start: int, num_layers: int, topk: int, num_experts: int,
                      dtype=np.uint8) -> np.ndarray:
    """``[count, num_layers, topk]`` filler routes for consecutive dead positions.

    Position ``start + i`` goes to experts ``(start + i) * topk + j`` mod ``num_experts``
    for ``j < topk``: distinct (``topk <= num_experts``), and consecutive positions
    cycle through every expert, so each expert gets its share. The same at every layer.
    """
    if topk > num_experts:
        raise ValueError(f"top-{topk} routes cannot be distinct among {num_experts} experts")
    experts = ((np.arange(start, start + count)[:, None] * topk + np.arange(topk)) % num_experts).astype(dtype)
    return np.broadcast_to(experts[:, None, :], (count, num_layers, topk)).copy()


def fill_dead_positions(routes: RolloutRoutes, positions: Sequence[int], dead_from: int,
                        filler_start: int = 0) -> RolloutRoutes:
    """``routes`` with filler routes at ``positions``, which must all be dead.

    Args:
        routes: One sample's routes.
        positions: Route-less positions to fill (no route, at or after ``dead_from``).
        dead_from: The sample's :func:`first_dead_position`.
        filler_start: Index of the first filler in the microbatch's filler sequence.

    Raises:
        ValueError: a position reaches a loss (before ``dead_from``) or already has a route.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if not len(positions):
        return routes
    if positions.min() < dead_from:
        raise ValueError(f"position {int(positions.min())} reaches a loss (the sample's last loss-bearing "
                         f"position is {dead_from - 1}): it must keep its live route, not a filler")
    if routes.valid[positions].any():
        raise ValueError(f"position {int(positions[routes.valid[positions]][0])} has a recorded route already")
    ids, valid = routes.ids.copy(), routes.valid.copy()
    ids[positions] = filler_expert_ids(len(positions), filler_start, routes.num_layers, routes.topk,
                                       routes.num_experts, routes.ids.dtype)
    valid[positions] = True
    return RolloutRoutes(ids, valid, routes.num_experts, routes.layer_numbers)


def with_fillers(routes: Sequence[RolloutRoutes], loss_masks: Sequence[np.ndarray],
                 filler_start: int = 0) -> tuple[list[RolloutRoutes], int]:
    """A microbatch's routes with every dead route-less position filled (THD: one segment per sample).

    Returns:
        The routes, and the index of the next filler (for the row's padding).
    """
    out = []
    for sample_routes, loss_mask in zip(routes, loss_masks):
        dead_from = first_dead_position(loss_mask)
        missing = np.flatnonzero(~sample_routes.valid[dead_from:]) + dead_from
        out.append(fill_dead_positions(sample_routes, missing, dead_from, filler_start))
        filler_start += len(missing)
    return out, filler_start
