"""RoutingPlan token placement against what Megatron does to the same tokens.

Each test labels every token with its source row, pushes the labels through
Megatron's own functions (``get_batch_on_this_cp_rank`` for CP,
``_split_along_first_dim`` as used by ``scatter_to_sequence_parallel_region``
for SP) and flattens ``[s_local, b]`` s-major like the router; the plan must
give the same sequence.
"""

import numpy as np
import pytest
import torch
from megatron.core import utils as mcore_utils
from megatron.core.tensor_parallel.mappings import _split_along_first_dim

from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan, bshd_token_index, padded_lengths, thd_token_index
from tests.support.fake_group import FakeGroup
from tests.support.pipeline import pipeline_config


def _megatron_cp(labels, cp_size, cp_rank, monkeypatch):
    """labels [b, s] -> this CP rank's [b, s/cp] via get_batch_on_this_cp_rank."""
    group = FakeGroup(cp_size, cp_rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: g.size())
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g=None: g.rank())
    batch = mcore_utils.get_batch_on_this_cp_rank({"tokens": labels.clone()}, is_hybrid_cp=False, cp_group=group)
    return batch["tokens"]


def _megatron_router_order(labels_bs, rank, monkeypatch):
    """[b, s] labels -> router-order 1-D labels on `rank` (CP, then embedding [s, b], then SP)."""
    local = _megatron_cp(labels_bs, rank.cp_size, rank.cp_rank, monkeypatch)
    hidden = local.transpose(0, 1).contiguous()  # the embedding output is [s, b, h]
    if rank.sequence_parallel:
        hidden = _split_along_first_dim(hidden, FakeGroup(rank.tp_size, rank.tp_rank))
    return hidden.reshape(-1).numpy()


def _labels_bshd(lens, seq_len):
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    pos = np.arange(seq_len)[None, :]
    return torch.from_numpy(np.where(pos < np.asarray(lens)[:, None], offsets[:, None] + pos, -1))


RANK_SHAPES = [(1, False, 1), (2, True, 1), (1, False, 2), (4, True, 2), (2, False, 4), (8, True, 1),
               (1, False, 8), (2, True, 8), (8, True, 2)]


@pytest.mark.parametrize("tp,sp,cp", RANK_SHAPES)
def test_bshd_matches_megatron(tp, sp, cp, monkeypatch):
    rng = np.random.default_rng(tp * 100 + cp * 10 + sp)
    align = 2 * cp * (tp if sp else 1)
    seq_len = align * int(rng.integers(1, 6))
    lens = rng.integers(0, seq_len + 1, size=int(rng.integers(1, 5)))
    labels = _labels_bshd(lens, seq_len)
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            rank = RankLayout(tp_size=tp, tp_rank=tp_rank, sequence_parallel=sp, cp_size=cp, cp_rank=cp_rank)
            expected = _megatron_router_order(labels, rank, monkeypatch)
            np.testing.assert_array_equal(bshd_token_index(lens, seq_len, rank), expected)


@pytest.mark.parametrize("tp,sp,cp", RANK_SHAPES)
def test_thd_matches_per_sequence_cp_split(tp, sp, cp, monkeypatch):
    """THD: each padded sequence is split like a one-row BSHD batch, then concatenated, then SP."""
    rng = np.random.default_rng(7 + tp * 100 + cp * 10 + sp)
    lens = rng.integers(1, 40, size=int(rng.integers(1, 30)))
    for pad_multiple in (1, 16):
        for tp_rank in range(tp):
            for cp_rank in range(cp):
                rank = RankLayout(tp_size=tp, tp_rank=tp_rank, sequence_parallel=sp, cp_size=cp, cp_rank=cp_rank)
                padded = padded_lengths(lens, rank, pad_multiple)
                offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
                pieces = []
                for length, plen, off in zip(lens, padded, offsets):
                    row = torch.from_numpy(np.where(np.arange(plen) < length, off + np.arange(plen), -1))[None]
                    pieces.append(_megatron_cp(row, cp, cp_rank, monkeypatch)[0])
                local = torch.cat(pieces)[:, None]  # packed THD is [t, 1, h] after the embedding
                if sp:
                    local = _split_along_first_dim(local, FakeGroup(tp, tp_rank))
                np.testing.assert_array_equal(thd_token_index(lens, rank, padded), local.reshape(-1).numpy())


def test_every_token_lands_on_exactly_one_rank():
    lens = [5, 17, 1, 30]
    for cp, tp in [(1, 1), (2, 2), (4, 1), (8, 2)]:
        seen = []
        for cp_rank in range(cp):
            for tp_rank in range(tp):
                rank = RankLayout(tp_size=tp, tp_rank=tp_rank, sequence_parallel=True, cp_size=cp, cp_rank=cp_rank)
                seen.append(thd_token_index(lens, rank))
        rows = np.concatenate(seen)
        assert sorted(rows[rows >= 0].tolist()) == list(range(sum(lens)))


def test_plan_layers_follow_pipeline_chunk():
    config = pipeline_config(8, pp=2, vp=2)
    source_layers = (2, 3, 5, 6, 8)  # dense layers 1, 4, 7
    plan = RoutingPlan.build(RankLayout(pp_rank=1, vp_stage=1), [3, 4], source_layer_numbers=source_layers,
                             config=config)
    assert plan.layer_numbers == (8,)
    assert plan.layer_index.tolist() == [4]
    plan = RoutingPlan.build(RankLayout(pp_rank=0, vp_stage=0), [3, 4], source_layer_numbers=source_layers,
                             config=config)
    assert plan.layer_numbers == (2,) and plan.num_local_tokens == 8 and plan.num_source_tokens == 7


def test_plan_layers_follow_uneven_interleaved_chunks():
    # 12 layers, pp=4, vp=2, 2 on the first and 2 on the last rank: chunk (pp, vp) builds
    # (0,0) [1], (1,0) [2,3], (2,0) [4,5], (3,0) [6], (0,1) [7], (1,1) [8,9], (2,1) [10,11], (3,1) [12].
    config = pipeline_config(12, pp=4, vp=2, first=2, last=2)
    source_layers = (2, 3, 5, 6, 8, 9, 11, 12)  # dense layers 1, 4, 7, 10
    expected = {(0, 0): (), (1, 0): (2, 3), (2, 0): (5,), (3, 0): (6,),
                (0, 1): (), (1, 1): (8, 9), (2, 1): (11,), (3, 1): (12,)}
    for (pp_rank, vp_stage), layers in expected.items():
        rank = RankLayout(pp_rank=pp_rank, vp_stage=vp_stage)
        plan = RoutingPlan.build(rank, [3], source_layer_numbers=source_layers, config=config)
        assert plan.layer_numbers == layers
        assert plan.layer_index.tolist() == [source_layers.index(n) for n in layers]


def test_bad_layouts_are_errors():
    rank = RankLayout(cp_size=2, tp_size=2, tp_rank=1, sequence_parallel=True, cp_rank=1)
    with pytest.raises(ValueError):
        bshd_token_index([3], 6, rank)  # 6 is not a multiple of 2*cp
    with pytest.raises(ValueError):
        thd_token_index([3, 4], rank, padded_lens=[4, 6])  # 6 is not a multiple of 4
    with pytest.raises(ValueError):
        thd_token_index([5], rank, padded_lens=[4])  # padding shorter than the sequence
    with pytest.raises(ValueError):
        RankLayout(cp_size=2, cp_rank=2)


def test_chunk_plans_cover_every_moe_layer_once():
    from megatron_r3.dataplane.device.plan import chunk_plans

    config = pipeline_config(12, pp=3, vp=2)
    moe = (2, 3, 5, 6, 7, 9, 10, 12)
    seen = []
    for pp_rank in range(3):
        plans = chunk_plans(RankLayout(pp_rank=pp_rank, cp_size=2), [9, 4], source_layer_numbers=moe, config=config,
                            qkv_format="thd")
        assert len(plans) == 2
        seen += [n for p in plans for n in p.layer_numbers]
    assert sorted(seen) == list(moe)
