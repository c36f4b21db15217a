"""One sample from a multi-turn rollout whose every turn re-encodes the turns before it.

An agent loop (SkyRL 0.4, slime, miles) calls the engine once per turn: turn k's
prompt is turn k-1's prompt and completion plus the new observation, so turn k
runs the earlier tokens again (or takes them from the prefix cache) and may route
them differently: different batch shapes, kernels, or weights moved on between
turns. The trainer sees one sample, the last turn's tokens, with the loss on every
turn's completion, and must replay for each token the route of the pass that
produced what the loss compares with: the turn that first ran the token. That is
the turn that generated it (a generated token's log-prob and every later one of its
turn came from that turn's pass), and for a prompt or observation token the turn
whose prompt first held it. A turn's final sampled token was never run in its own
turn; the next turn runs it first.

:func:`merge_turns` builds that sample and counts the tokens a later turn re-routed
differently (compared as sets of experts per layer: the order of a top-k does not
change what the layer computes). Routes a later turn did not return
(``routed_experts_prompt_start`` / ``routed_experts_start_len`` past the earlier
turns) are simply not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.dataplane.samples import RolloutSample


@dataclass
class MergedTurns:
    """The sample of a multi-turn rollout and what merging found.

    Attributes:
        sample: The last turn's tokens; loss on every turn's completion; each token's
            log-prob and route from the turn that first ran it.
        rerouted_tokens: Tokens a later turn routed differently from the turn kept (at any MoE layer).
        first_rerouted: ``(turn, token)`` of the first such token (turns count from 0), or None.
    """

    sample: RolloutSample
    rerouted_tokens: int
    first_rerouted: Optional[tuple[int, int]]


def merge_turns(turns: Sequence[RolloutSample], where: str = "") -> MergedTurns:
    """Merges the samples of one rollout's turns, in order, into one sample.

    Args:
        turns: One sample per turn (prompt + that turn's completion, loss mask on the
            completion), each built by an engine adapter.
        where: What the rollout is, for messages (``"request 'r1'"``).

    Returns:
        The merged sample (its ``meta`` is the last turn's, plus ``turns`` and
        ``rerouted_tokens``) and the re-routing count.

    Raises:
        RoutingValidationError: no turns; a turn whose tokens do not start with the previous
            turn's tokens (naming the turn and the first differing token); turns whose routes
            cover different layers or models, or only some of which have routes.
    """
    prefix = f"{where}: " if where else ""
    if not turns:
        raise RoutingValidationError(f"{prefix}a multi-turn rollout needs at least one turn")
    last = turns[-1]
    for k in range(1, len(turns)):
        before, now = turns[k - 1].token_ids, turns[k].token_ids
        if len(now) <= len(before) or not np.array_equal(now[:len(before)], before):
            differs = np.flatnonzero(now[:len(before)] != before[:len(now)])
            token = int(differs[0]) if len(differs) else min(len(before), len(now))
            theirs = int(now[token]) if token < len(now) else "nothing"
            raise RoutingValidationError(
                f"{prefix}turn {k} does not re-encode turn {k - 1}: its token {token} is {theirs}, turn {k - 1} has "
                f"{int(before[token]) if token < len(before) else 'nothing'} there (turn {k - 1} has {len(before)} "
                f"tokens, turn {k} {len(now)}); each turn's prompt must be the previous turn's tokens and more"
            )
    with_routes = [turn.routes is not None for turn in turns]
    if any(with_routes) and not all(with_routes):
        raise RoutingValidationError(f"{prefix}turns {[k for k, r in enumerate(with_routes) if not r]} have no "
                                     f"routes, the others do")
    loss_mask = last.loss_mask.copy()
    logprobs = None if last.logprobs is None else last.logprobs.copy()
    for turn in turns[-2::-1]:  # earliest last: the turn that first ran a token wins
        n = len(turn.token_ids)
        loss_mask[:n] |= turn.loss_mask
        if logprobs is not None and turn.logprobs is not None:
            logprobs[:n] = turn.logprobs
    routes, rerouted, first = None, 0, None
    if last.routes is not None:
        routes, rerouted, first = _earliest_routes([turn.routes for turn in turns], prefix)
    meta = dict(last.meta, turns=len(turns), rerouted_tokens=rerouted)
    sample = RolloutSample(token_ids=last.token_ids.copy(), loss_mask=loss_mask, logprobs=logprobs, routes=routes,
                           meta=meta)
    return MergedTurns(sample, rerouted, first)


def _earliest_routes(routes: Sequence[RolloutRoutes], prefix: str) -> tuple[RolloutRoutes, int, Optional[tuple]]:
    """Each token's route from the first turn that has one; counts tokens a later turn routed differently."""
    head = routes[-1]
    for k, r in enumerate(routes):
        if (r.num_experts, r.topk, r.layer_numbers) != (head.num_experts, head.topk, head.layer_numbers):
            raise RoutingValidationError(
                f"{prefix}turn {k}'s routes have (experts, topk, layers) = {(r.num_experts, r.topk, r.layer_numbers)}, "
                f"the last turn's {(head.num_experts, head.topk, head.layer_numbers)}"
            )
    ids, valid = head.ids.copy(), head.valid.copy()
    for r in routes[-2::-1]:  # earliest last: the first turn with a route wins
        ids[:r.num_tokens][r.valid] = r.ids[r.valid]
        valid[:r.num_tokens] |= r.valid
    kept = np.sort(ids, axis=2)
    rerouted = np.zeros(head.num_tokens, dtype=np.bool_)
    first = None
    for k, r in enumerate(routes):
        tokens = np.flatnonzero(r.valid)
        differs = tokens[(np.sort(r.ids[tokens], axis=2) != kept[tokens]).any(axis=(1, 2))]
        if len(differs) and (first is None or differs[0] < first[1]):
            first = (k, int(differs[0]))
        rerouted[differs] = True
    return RolloutRoutes(ids, valid, head.num_experts, head.layer_numbers), int(rerouted.sum()), first
