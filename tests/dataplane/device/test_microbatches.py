"""megatron_r3.dataplane.device.microbatches: packed microbatches from rollout samples."""

import numpy as np
import pytest
import torch

from megatron_r3.dataplane.device.microbatches import pack_rollout_microbatch
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.layers.context_parallel import zigzag_placement

CPU = torch.device("cpu")


def samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [RolloutSample(rng.integers(1, 1000, n), rng.random(n) < 0.7, -rng.random(n).astype(np.float32))
            for n in lengths]


@pytest.mark.parametrize("tp, sp, cp", [(1, False, 1), (2, True, 1), (1, False, 2), (2, True, 4), (4, False, 2)])
def test_cp_ranks_together_hold_the_packed_row(tp, sp, cp):
    group = samples([7, 1, 12, 5])
    seq_length = 64
    advantages = [0.5, -1.0, 2.0, 0.25]
    rows = {k: torch.zeros(seq_length)
            for k in ("tokens", "labels", "loss_mask", "logprobs", "advantages", "positions")}
    for cp_rank in range(cp):
        rank = RankLayout(tp_size=tp, sequence_parallel=sp, cp_size=cp, cp_rank=cp_rank)
        mb = pack_rollout_microbatch(group, rank, seq_length, CPU, advantages)
        assert sum(mb.padded_lens) == seq_length and all(p % rank.alignment == 0 for p in mb.padded_lens)
        assert mb.tokens.shape == (1, seq_length // cp)
        index = zigzag_placement(mb.packed_seq_params.cu_seqlens_q_padded, cp, cp_rank, seq_length // cp).index
        assert mb.row_index.tolist() == index.tolist()
        for key, value in (("tokens", mb.tokens), ("labels", mb.labels), ("loss_mask", mb.loss_mask),
                           ("logprobs", mb.rollout_logprobs), ("advantages", mb.advantages),
                           ("positions", mb.position_ids)):
            rows[key][index] = value[0].to(torch.float32)
        # The routing plan of the same microbatch lists the same tokens in the same order.
        plan = RoutingPlan.build(RankLayout(cp_size=cp, cp_rank=cp_rank), mb.sample_lens, source_layer_numbers=[1],
                                 layer_numbers=[1], qkv_format="thd", padded_lens=mb.padded_lens)
        source = np.concatenate([s.token_ids for s in group])
        routed = plan.token_index >= 0
        np.testing.assert_array_equal(mb.tokens[0].numpy()[routed], source[plan.token_index[routed]])
        assert (mb.tokens[0].numpy()[~routed] == 0).all()

    start = 0
    for sample, advantage, width in zip(group, advantages, mb.padded_lens):
        n = len(sample.token_ids)
        span = slice(start, start + width)
        np.testing.assert_array_equal(rows["tokens"][span][:n].numpy(), sample.token_ids)
        np.testing.assert_array_equal(rows["labels"][span][:n - 1].numpy(), sample.token_ids[1:])
        np.testing.assert_array_equal(rows["loss_mask"][span][:n - 1].numpy(), sample.loss_mask[1:])
        np.testing.assert_allclose(rows["logprobs"][span][:n - 1].numpy(), sample.logprobs[1:])
        np.testing.assert_allclose(rows["advantages"][span][:n - 1].numpy(), advantage * sample.loss_mask[1:])
        assert not rows["loss_mask"][span][n - 1:].any() and not rows["labels"][span][n - 1:].any()
        np.testing.assert_array_equal(rows["positions"][span].numpy(), np.arange(width))
        start += width
    # The attention is told the padded lengths, one tensor for every cu_seqlens field (padded_thd_params).
    params = mb.packed_seq_params
    assert params.cu_seqlens_q.tolist() == np.concatenate([[0], np.cumsum(mb.padded_lens)]).tolist()
    assert params.cu_seqlens_kv is params.cu_seqlens_q_padded is params.cu_seqlens_kv_padded is params.cu_seqlens_q


def test_rows_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_rollout_microbatch(samples([5]), RankLayout(cp_size=2), 30, CPU)
    with pytest.raises(ValueError, match=r"samples of \[7, 1, 12\] tokens need 24 positions.*--seq-length is 20"):
        pack_rollout_microbatch(samples([7, 1, 12]), RankLayout(cp_size=2), 20, CPU)
    with pytest.raises(ValueError, match="2 advantages for a microbatch of 3 samples"):
        pack_rollout_microbatch(samples([7, 1, 12]), RankLayout(), 20, CPU, [1.0, 2.0])
