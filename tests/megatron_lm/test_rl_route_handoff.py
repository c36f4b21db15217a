"""The hand-off of the Megatron-LM series: engine routes in rollout objects -> training rows ->
packed bins -> the order the routers see tokens.

The engine here routes position ``p`` of a sequence by its token and position
(:func:`engine_route`), so every route says which token it belongs to: after grouping,
packing and padding, a bin's recorded routes must still match the bin's own tokens and
position ids, position by position. The negative control hands the pipeline routes moved by
one token and checks that the same comparison catches it.
"""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

NUM_EXPERTS, TOPK, LAYERS = 16, 2, (2, 3, 4)
PAD = 0


def engine_route(token: int, position: int) -> np.ndarray:
    """The experts the fake engine picks for ``token`` at ``position``: [layers, topk], distinct."""
    base = (token * 5 + position * 3) % NUM_EXPERTS
    return np.array([[(base + layer + 7 * k) % NUM_EXPERTS for k in range(TOPK)] for layer in range(len(LAYERS))])


def engine_routes(tokens) -> np.ndarray:
    """What the engine records for a request: every token but the last, int32 as Megatron's."""
    return np.stack([engine_route(t, p) for p, t in enumerate(tokens[:-1])]).astype(np.int32)


@dataclass
class TokenRollout:
    """Stands for megatron.rl.types.TokenRollout (the fields the hand-off reads)."""

    trajectory: list
    generation_mask: list
    completion_ids: list


@dataclass
class Record:
    """Stands for FinishedRequestRecord."""

    routing_indices: np.ndarray


def make_group(rng, group: int, size: int, prompt_len: int):
    """A GRPO group: one prompt, ``size`` single-turn completions, and the engine's ledger."""
    prompt = list(rng.integers(1, 60, prompt_len))
    rollouts, ledger = [], {}
    for i in range(size):
        tokens = prompt + list(rng.integers(1, 60, int(rng.integers(2, 9))))
        cid = f"chatcmpl-{group}-{i}"
        rollouts.append(TokenRollout([tokens], [[p >= prompt_len for p in range(len(tokens))]], [cid]))
        ledger[cid] = Record(engine_routes(tokens))
    return rollouts, ledger


def pack_like_megatron(rows, bin_size, multiple, max_per_bin):
    """megatron.rl.sequence_packing_utils.SequencePacker's placement: longest first, first fit in
    order, each sequence at a ``multiple``-aligned start; tokens, position ids, token-level loss
    mask per bin; seq_starts with the padded end as its last entry (PackingInfo)."""
    # get_actual_sequence_lengths: up to the last token that is not the pad token.
    lengths = [0 if r is None else int(np.flatnonzero(np.asarray(r.trajectory[-1]) != PAD)[-1]) + 1 for r in rows]
    order = sorted(range(len(rows)), key=lambda i: lengths[i], reverse=True)
    bins, current, used = [], [], 0
    for i in order:
        width = -(-lengths[i] // multiple) * multiple
        if current and (used + width > bin_size or len(current) >= max_per_bin):
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += width
    bins.append(current)
    tokens = np.full((len(bins), bin_size), PAD)
    positions = np.zeros((len(bins), bin_size), dtype=np.int64)
    loss = np.zeros((len(bins), bin_size))
    starts = {}
    for b, seqs in enumerate(bins):
        at, starts[b] = 0, []
        for i in seqs:
            starts[b].append(at)
            if rows[i] is not None:
                traj, mask = rows[i].trajectory[-1][:lengths[i]], rows[i].generation_mask[-1][:lengths[i]]
                tokens[b, at:at + len(traj)] = traj
                positions[b, at:at + len(traj)] = np.arange(len(traj))
                loss[b, at:at + len(traj)] = mask
            at += -(-lengths[i] // multiple) * multiple
        starts[b].append(at)
    return bins, starts, lengths, tokens, positions, loss


def misaligned(ids, recorded, tokens, positions) -> list:
    """Bin positions whose recorded route is not the engine's route of the token there."""
    return [q for q in np.flatnonzero(recorded) if not np.array_equal(ids[q], engine_route(tokens[q], positions[q]))]


def packed_bins(rr, groups, ledger, bin_size=64, multiple=1, max_per_bin=4):
    """The whole hand-off: ledger -> rows (with inert padding rows) -> packed bins."""
    routes_by_completion = rr.ledger_routes(groups, ledger)
    rows = [r for g in groups for r in g] + [None, None]  # prepare_data_for_update's PAD_ROWs
    row_routes = [rr.row_routes(r, routes_by_completion, (len(LAYERS), TOPK)) for r in rows]
    bins, starts, lengths, tokens, positions, loss = pack_like_megatron(rows, bin_size, multiple, max_per_bin)
    packed = [
        rr.pack_bin_routes([row_routes[i] for i in seqs], starts[b][:-1], [lengths[i] for i in seqs], loss[b],
                           bin_size, len(LAYERS), TOPK, NUM_EXPERTS)
        for b, seqs in enumerate(bins)
    ]
    return packed, tokens, positions, loss, starts


@pytest.mark.parametrize("multiple", [1, 4])  # 4: the 2*cp alignment of context parallelism 2
def test_routes_survive_grouping_packing_and_padding(rr, multiple):
    rng = np.random.default_rng(0)
    groups, ledger = [], {}
    for g in range(3):
        rollouts, records = make_group(rng, g, size=4, prompt_len=int(rng.integers(3, 7)))
        groups.append(rollouts)
        ledger.update(records)
    packed, tokens, positions, loss, starts = packed_bins(rr, groups, ledger, multiple=multiple)
    recorded = 0
    for b, routes in enumerate(packed):
        assert misaligned(routes.ids, routes.recorded, tokens[b], positions[b]) == []
        recorded += int(routes.recorded.sum())
        # Recorded routes sit on real tokens only, never on padding.
        assert not (routes.recorded & (tokens[b] == PAD)).any()
        # Positions no loss sees got fillers, so every token of the bin replays a route; a filler
        # never sits where the next token is trained, and names distinct experts.
        assert routes.every_token_routed and routes.live == 0
        fillers = routes.valid & ~routes.recorded
        assert not (fillers[:-1] & (loss[b][1:] != 0)).any()
        for q in np.flatnonzero(fillers):
            assert len(set(routes.ids[q, 0])) == TOPK
    assert recorded == sum(len(t) - 1 for g in groups for r in g for t in r.trajectory)


def test_a_route_moved_by_one_token_is_caught(rr):
    """Negative control: the same pipeline fed routes one token late fails the same comparison."""
    rng = np.random.default_rng(1)
    rollouts, ledger = make_group(rng, 0, size=3, prompt_len=5)
    for record in ledger.values():
        moved = record.routing_indices.copy()
        moved[1:] = record.routing_indices[:-1]
        record.routing_indices = moved
    packed, tokens, positions, _, _ = packed_bins(rr, [rollouts], ledger)
    assert any(misaligned(r.ids, r.recorded, tokens[b], positions[b]) for b, r in enumerate(packed))


def test_a_completion_that_sampled_the_pad_token_last_keeps_the_routes_of_its_packed_tokens(rr):
    """Packing counts a trajectory up to its last non-pad token, so a completion whose last
    sampled tokens are the pad token is packed shorter than the engine ran it (a random-init
    model on 1 x H200: a 512-token completion packed as 511 tokens with 511 routes)."""
    rng = np.random.default_rng(3)
    rollouts, ledger = make_group(rng, 0, size=3, prompt_len=5)
    for k, rollout in enumerate(rollouts):  # the last 1, 2, 3 sampled tokens are the pad token
        tokens = rollout.trajectory[0][:-(k + 1)] + [PAD] * (k + 1)
        rollout.trajectory[0] = tokens
        ledger[rollout.completion_ids[0]] = Record(engine_routes(tokens))
    packed, tokens, positions, _, _ = packed_bins(rr, [rollouts], ledger)
    recorded = 0
    for b, routes in enumerate(packed):
        assert misaligned(routes.ids, routes.recorded, tokens[b], positions[b]) == []
        recorded += int(routes.recorded.sum())
    # Each sequence keeps a route for every packed token (the engine ran the last one: a pad followed).
    assert recorded == sum(len(r.trajectory[0]) - (k + 1) for k, r in enumerate(rollouts))


def test_routes_of_the_wrong_length_are_refused_naming_the_completion(rr):
    rng = np.random.default_rng(2)
    rollouts, ledger = make_group(rng, 0, size=1, prompt_len=4)
    (cid, record), = ledger.items()
    routes = rr.ledger_routes([rollouts], {cid: Record(np.concatenate([record.routing_indices, record.routing_indices[:1]]))})
    with pytest.raises(rr.RoutingReplayError, match=rf"completion '{cid}'.*needs \[{len(rollouts[0].trajectory[0]) - 1}"):
        rr.row_routes(rollouts[0], routes, (len(LAYERS), TOPK))


def test_dead_positions_get_fillers_and_a_loss_bearing_gap_routes_live(rr):
    """Positions from each sequence's last trained token on take fillers; a position whose next
    token is trained but that has no route routes live, and the bin is not fully routed."""
    tokens = [5, 6, 7, 8, 9, 10]
    mask = [False, False, True, True, False, False]  # tokens 2 and 3 trained: positions 1, 2 bear a loss
    routes = engine_routes(tokens)
    rollout = TokenRollout([tokens], [mask], ["c"])
    row = rr.row_routes(rollout, {"c": routes}, (len(LAYERS), TOPK))
    loss = np.zeros(12)
    loss[2:4] = 1
    full = rr.pack_bin_routes([row], [0], [6], loss, 12, len(LAYERS), TOPK, NUM_EXPERTS)
    assert full.every_token_routed and full.recorded[:5].all() and not full.recorded[5:].any()
    gap = rr.RowRoutes(ids=row.ids, valid=row.valid & (np.arange(5) != 1))  # position 1 lost its route
    partial = rr.pack_bin_routes([gap], [0], [6], loss, 12, len(LAYERS), TOPK, NUM_EXPERTS)
    assert not partial.every_token_routed and partial.live == 1 and not partial.valid[1]
    dead = rr.RowRoutes(ids=row.ids, valid=row.valid & (np.arange(5) != 4))  # position 4: after the last trained token
    assert rr.pack_bin_routes([dead], [0], [6], loss, 12, len(LAYERS), TOPK, NUM_EXPERTS).every_token_routed


def test_a_multi_turn_row_takes_each_position_from_the_turn_that_sampled_the_next_token(rr):
    turn1 = [1, 2, 3, 4, 5]  # prompt 1 2 3, generated 4 5
    turn2 = turn1 + [6, 7, 8, 9]  # observation 6 7, generated 8 9
    masks = [[p >= 3 for p in range(5)], [p >= 7 for p in range(9)]]
    first = engine_routes(turn1)
    second = (engine_routes(turn2) + 1) % NUM_EXPERTS  # the second turn's prefill routed otherwise
    row = rr.rollout_routes([turn1, turn2], masks, [first, second], ["a", "b"], (len(LAYERS), TOPK))
    assert row.valid.all() and row.num_positions == 8
    for p in range(8):
        want = first[p] if p in (2, 3) else second[p]  # tokens 3 and 4 were sampled by turn 1
        assert np.array_equal(row.ids[p], want), p
    unrouted = rr.rollout_routes([turn1, turn2], masks, [first, None], ["a", "b"], (len(LAYERS), TOPK))
    assert unrouted.valid.tolist() == [True] * 4 + [False] * 4


def test_router_order_follows_the_context_and_sequence_parallel_split_of_the_tokens(rr):
    """Routes carried through router_order land on the token the router sees at that slot."""
    from megatron_r3.layers.context_parallel import zigzag_placement

    cu = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32)  # four sequences, each a multiple of 2*cp
    tokens = torch.arange(1, 33).reshape(1, 32)
    routes = torch.stack([torch.from_numpy(engine_route(int(t), 0)) for t in tokens[0]]).unsqueeze(0)  # [1, 32, L, K]
    for cp_rank in range(2):
        index = zigzag_placement(cu, 2, cp_rank, 16)[0].to(torch.int64)
        local_tokens = tokens.index_select(1, index)  # what get_logprobs hands the model
        for sp_rank in range(2):
            ordered = rr.router_order(routes.long(), index, 2, sp_rank)
            seen = local_tokens.t()[sp_rank * 8:(sp_rank + 1) * 8].reshape(-1)  # [s, b] after embedding, SP slice
            for slot, token in enumerate(seen.tolist()):
                assert torch.equal(ordered[:, slot], torch.from_numpy(engine_route(token, 0)).long())
