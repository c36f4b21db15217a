"""The batch plan gives exactly the microbatches the per-microbatch preparation gave.

The host's preparation moved out of the pass: rows, CP placement, plans, fillers, staged
routes and host counts are computed once per batch, vectorised
(:mod:`megatron_r3.dataplane.device.batch_plan`). On fresh random batches (odd lengths,
one-token samples, samples without log-probs or without any route, capture gaps a loss
sees, random forced routes, uint8 and int16 ids) and layouts (TP with and without SP, CP
2 and 4 on every rank, uneven and interleaved pipelines, dense-first models), every field
of every microbatch equals what the preparation of commit cd9be66 gave
(:mod:`tests.support.prepare_reference`).
"""


import numpy as np
import pytest
import torch

from megatron_r3.dataplane.device.microbatch_pipeline import MicrobatchPipeline
from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.device.plan import RankLayout
from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.dataplane.samples import RolloutSample, RoutingSpec
from megatron_r3.layers.moe_layers import model_moe_layers
from tests.support.pipeline import pipeline_config
from tests.support.prepare_reference import reference_items

CPU = torch.device("cpu")
ROW_FIELDS = ("tokens", "labels", "loss_mask", "rollout_logprobs", "advantages", "dead_mask", "position_ids",
              "row_index")


class LocalCounts:
    """An exchange over a group of one: hands each microbatch's local counts back as the group's."""

    def __init__(self, num_experts):
        self.num_experts = num_experts
        self.calls = 0

    def gather_batch(self, local, num_layers):
        self.calls += 1
        return [[None if c is None or any(x is None for x in chunks) else torch.from_numpy(c)[None]
                 for c in chunks] for chunks in local]


def random_samples(gen, count, max_len, spec, *, adversarial):
    """Rollout-shaped samples with random forced routes; ``adversarial`` adds the odd cases."""
    samples = []
    for _ in range(count):
        n = int(gen.integers(1, max_len + 1))
        loss_mask = np.arange(n) >= int(gen.integers(0, n + 1))
        valid = np.ones(n, bool)
        valid[-1] = False  # the engine never ran the final sampled token
        logprobs = -gen.random(n).astype(np.float32)
        routes = True
        if adversarial:
            kind = gen.integers(0, 6)
            if kind == 0:
                valid[gen.random(n) < 0.2] = False  # capture gaps, some where a loss sees
            elif kind == 1:
                routes = False  # a sample without any route
            elif kind == 2:
                logprobs = None
            elif kind == 3:
                loss_mask = gen.random(n) < 0.5  # holes in the loss mask
            elif kind == 4:
                valid[:] = True
        ids = np.argsort(gen.random((n, len(spec.model_moe_layers), spec.num_experts)), axis=-1)[..., :spec.topk]
        samples.append(RolloutSample(
            token_ids=gen.integers(0, 1000, n), loss_mask=loss_mask, logprobs=logprobs,
            routes=RolloutRoutes.from_ids(ids, num_experts=spec.num_experts, layer_numbers=spec.model_moe_layers,
                                          valid=valid) if routes else None))
    return samples


def assert_same_items(new, old):
    assert len(new) == len(old)
    for per_chunk_new, per_chunk_old in zip(new, old):
        assert len(per_chunk_new) == len(per_chunk_old)
        for item, ref in zip(per_chunk_new, per_chunk_old):
            for name in ROW_FIELDS:
                got, want = getattr(item.batch, name), getattr(ref.batch, name)
                assert got.dtype == want.dtype and torch.equal(got, want), name
            for name in ("sample_lens", "padded_lens", "seq_length"):
                assert getattr(item.batch, name) == getattr(ref.batch, name), name
            params, want = item.batch.packed_seq_params, ref.batch.packed_seq_params
            assert torch.equal(params.cu_seqlens_q, want.cu_seqlens_q) and params.cu_seqlens_q.dtype == torch.int32
            assert params.cu_seqlens_kv is params.cu_seqlens_q_padded is params.cu_seqlens_kv_padded \
                is params.cu_seqlens_q
            assert (params.max_seqlen_q, params.max_seqlen_kv) == (want.max_seqlen_q, want.max_seqlen_kv)
            if ref.expert_ids is None:
                assert item.routes is None
                continue
            assert torch.equal(item.routes.wait(), ref.expert_ids)
            assert item.routes.layer_numbers == ref.layer_numbers
            assert item.routes.every_token_routed == ref.every_token_routed
            real = ref.token_index >= 0
            np.testing.assert_array_equal(item.filler_rows[real], ref.filler_rows[real])
            assert not item.filler_rows[~real].any()  # padding without a route is no filler
            counts = item.host_tokens_per_expert
            if ref.local_counts is None:
                assert counts is None
            else:
                assert counts.dtype == torch.int64 and torch.equal(counts[0], torch.from_numpy(ref.local_counts))


def check_layout(rank, config, spec, seq_length, micro_batch_size, seed, adversarial=True):
    gen = np.random.default_rng(seed)
    samples = random_samples(gen, 3 * micro_batch_size, seq_length // micro_batch_size - 2 * rank.alignment, spec,
                             adversarial=adversarial)
    advantages = gen.standard_normal(len(samples))
    rows = RowLayout(rank, config, seq_length, micro_batch_size, CPU)
    exchange = LocalCounts(spec.num_experts)
    pipeline = MicrobatchPipeline(rows, spec, exchange)
    batch = pipeline.plan(samples, advantages)
    for replays, fillers in ((False, True), (True, True), (True, False)):
        new = pipeline.prepare(batch, rollout_routes=replays, fillers=fillers).all_items()
        old = reference_items(samples, advantages, rows, spec, rollout_routes=replays, fillers=fillers,
                              counts=True)
        assert_same_items(new, old)
    # Once per batch: the second pass of the same setting exchanged nothing more.
    assert exchange.calls == 2


def spec_of(config, num_experts=16, topk=4):
    return RoutingSpec(config.num_layers, model_moe_layers(config.num_layers, config.moe_layer_freq),
                       num_experts, topk)


TOKEN_LAYOUTS = [(1, False, 1), (2, True, 1), (4, False, 1), (1, False, 2), (2, True, 2), (1, False, 4),
                 (2, True, 4)]


@pytest.mark.parametrize("tp, sp, cp", TOKEN_LAYOUTS, ids=lambda v: str(v))
def test_every_rank_of_tp_sp_cp_layouts(tp, sp, cp):
    config = pipeline_config(4)
    spec = spec_of(config)
    for tp_rank in range(tp if sp else 1):
        for cp_rank in range(cp):
            rank = RankLayout(tp_size=tp, tp_rank=tp_rank, sequence_parallel=sp, cp_size=cp, cp_rank=cp_rank)
            check_layout(rank, config, spec, seq_length=16 * rank.alignment * 3, micro_batch_size=3,
                         seed=100 * tp + 10 * cp + cp_rank + tp_rank)


@pytest.mark.parametrize("pp, vp, first, last, freq", [
    (2, None, 1, None, 1),  # uneven: one layer on the first stage
    (2, None, None, 2, [0, 1, 1, 0, 1, 1, 1]),  # uneven last stage, dense layers between
    (2, 2, None, None, [0, 0, 1, 1, 1, 1, 1, 1]),  # interleaved, dense first
    (3, None, 3, 1, 1),
], ids=["pp2-first1", "pp2-last2-dense", "pp2-vp2-dense-first", "pp3-uneven"])
def test_every_stage_of_uneven_and_interleaved_pipelines(pp, vp, first, last, freq):
    num_layers = len(freq) if isinstance(freq, list) else 7
    config = pipeline_config(num_layers, pp=pp, vp=vp, first=first, last=last, moe_layer_freq=freq,
                             num_moe_experts=16)
    spec = spec_of(config)
    for pp_rank in range(pp):
        rank = RankLayout(tp_size=2, tp_rank=pp_rank % 2, sequence_parallel=True, cp_size=2, cp_rank=1 - pp_rank % 2,
                          pp_rank=pp_rank)
        check_layout(rank, config, spec, seq_length=8 * 40, micro_batch_size=4, seed=pp_rank + 7)


def test_more_than_256_experts_and_odd_lengths_without_cp():
    config = pipeline_config(3)
    spec = spec_of(config, num_experts=300, topk=5)
    check_layout(RankLayout(), config, spec, seq_length=101, micro_batch_size=5, seed=3)


def test_rollout_shaped_rows_without_odd_cases():
    config = pipeline_config(4)
    check_layout(RankLayout(cp_size=2, cp_rank=1), config, spec_of(config), seq_length=256, micro_batch_size=4,
                 seed=11, adversarial=False)


def test_a_planned_batch_holds_its_advantages():
    config = pipeline_config(2)
    spec = spec_of(config)
    rows = RowLayout(RankLayout(), config, 32, 2, CPU)
    pipeline = MicrobatchPipeline(rows, spec)
    samples = random_samples(np.random.default_rng(0), 2, 10, spec, adversarial=False)
    batch = pipeline.plan(samples, [1.0, 2.0])
    with pytest.raises(ValueError, match="holds its advantages already"):
        pipeline.prepare(batch, [1.0, 2.0])
    with pytest.raises(ValueError, match="3 samples do not make whole microbatches"):
        pipeline.plan(samples + samples[:1])
