"""The rollout engine: where a sample's positions lie among a rank's local tokens, and generation in
fixed slots against packing every step anew, under parallel layouts."""

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.device.plan import RankLayout
from megatron_r3.dataplane.samples import RolloutSample, RoutingSpec
from megatron_r3.layers.context_parallel import zigzag_placement
from megatron_r3.rl.model.passes import no_loss, run_pass
from megatron_r3.rl.model.replica_comm import (
    broadcast_from_last_stage,
    gather_vocab_parallel,
    sum_over_context_parallel,
)
from megatron_r3.rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_r3.rl.rollout.generation_rows import local_positions
from megatron_r3.rl.rollout.token_sampling import sample_tokens, sampling_uniforms
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_positions_find_each_held_position_on_its_cp_rank(cp):
    rng = np.random.default_rng(cp)
    lengths = rng.integers(1, 30, size=7) * 2 * cp  # padded to a multiple of 2 * cp
    cu = torch.tensor([0, *np.cumsum(lengths)])
    positions = rng.choice(int(cu[-1]), size=12, replace=False)
    owners = {}
    for rank in range(cp):
        row_index = zigzag_placement(cu, cp, rank, int(cu[-1]) // cp).index.numpy()
        held, local = local_positions(row_index, positions)
        expected = [(i, int(np.flatnonzero(row_index == p)[0])) for i, p in enumerate(positions) if p in row_index]
        assert list(zip(held.tolist(), local.tolist())) == expected
        for i in held.tolist():
            assert i not in owners
            owners[i] = rank
    assert sorted(owners) == list(range(len(positions)))  # every position on exactly one rank


def test_no_local_token_holds_nothing():
    held, local = local_positions(np.zeros(0, dtype=np.int64), np.array([3, 5]))
    assert held.size == 0 and local.size == 0


# The engine's generation against the simplest loop: each step packs every sample's tokens so far
# anew, as the trainer packs, runs one pass and reads each sample's last position.

MODEL = TinyMoE(vocab_size=48)
ROW, SAMPLES, MAX_NEW = 64, 8, 6


def _reference_generate(engine, prompts, iteration):
    sampling = engine.sampling
    device = engine.rows.device
    uniforms = sampling_uniforms(sampling.seed, iteration, parallel_state.get_data_parallel_rank(), sampling.max_new_tokens,
                                 len(prompts)).to(device)
    tokens, active = [list(map(int, p)) for p in prompts], [True] * len(prompts)

    def last_positions(index, batch, logits):
        ends = np.cumsum(np.concatenate([[0], batch.padded_lens[:-1]])) + np.asarray(batch.sample_lens) - 1
        held, local = local_positions(batch.row_index.numpy(), ends)
        rows = torch.zeros((len(ends), logits.shape[-1]), device=logits.device)
        rows[torch.from_numpy(held)] = logits[0, torch.from_numpy(local)].float()
        return no_loss({"rows": rows}, logits)

    for step in range(sampling.max_new_tokens):
        if not any(active):
            break
        samples = [RolloutSample(token_ids=np.array(t), loss_mask=np.zeros(len(t), bool)) for t in tokens]
        outputs = run_pass(engine.chunks, engine.pipeline.prepare(samples), last_positions).outputs
        drawn = torch.zeros(len(tokens), dtype=torch.int64, device=device)
        if parallel_state.is_pipeline_last_stage():
            logits = gather_vocab_parallel(sum_over_context_parallel(torch.cat([o["rows"] for o in outputs])))
            drawn = sample_tokens(logits, uniforms[step], sampling.temperature)
        drawn = broadcast_from_last_stage(drawn).tolist()
        for i in np.flatnonzero(active):
            tokens[i].append(drawn[i])
            active[i] = drawn[i] != sampling.stop_token
    return tokens


def _generation_worker(layout, stop_token):
    device = init_parallel(layout)
    try:
        # fp32 engine chunks: the two loops pack the samples differently (a generation row holds
        # several trainer rows), which may move fp32 logits by a few ulps; a draw flips only
        # when its uniform lies that close to a boundary of the cumulative distribution.
        config, policy = build_gpt(layout, MODEL, seed=4, device=device, flags=["--moe-enable-routing-replay"])
        rows = RowLayout(RankLayout.of_this_rank(config.sequence_parallel), config, ROW, 2, device)
        engine = RolloutEngine(
            lambda: build_gpt(layout, MODEL, seed=4, device=device, flags=["--moe-enable-routing-replay"])[1],
            policy, RoutingSpec.from_config(config), rows, SamplingParams(1.0, MAX_NEW, stop_token, seed=11),
            staleness=0, cuda_graphs=False)
        rng = np.random.default_rng(5)  # the same prompts on every rank: one replica
        prompts = [rng.integers(1, MODEL.vocab_size, size=int(n)) for n in rng.integers(1, 12, size=SAMPLES)]
        got = [s.token_ids.tolist() for s in engine.generate(prompts, iteration=3)]
        return {"prompt_lens": [len(p) for p in prompts], "got": got,
                "reference": _reference_generate(engine, prompts, iteration=3)}
    finally:
        parallel_state.destroy_model_parallel()


GENERATION_LAYOUTS = {
    "single": Layout(), "cp2": Layout(cp=2), "pp2": Layout(pp=2), "tp2-sp": Layout(tp=2, sp=True),
}


@pytest.mark.parametrize("layout", sorted(GENERATION_LAYOUTS))
def test_generation_in_fixed_slots_draws_the_tokens_of_packing_each_step_anew(layout):
    layout = GENERATION_LAYOUTS[layout]

    def generate(stop_token):
        results = run_workers(_generation_worker, layout.world_size, layout, stop_token, backend="gloo")
        for result in results:
            assert result["got"] == result["reference"]
            assert result["got"] == results[0]["got"]  # every rank of the replica
        return results[0]["prompt_lens"], results[0]["got"]

    prompt_lens, endless = generate(stop_token=-1)
    completions = [t[n:] for t, n in zip(endless, prompt_lens)]
    assert all(len(c) == MAX_NEW for c in completions)
    # A stop token some samples draw before their last step: they end there, the others go on.
    stop = int(np.bincount([t for c in completions for t in c[:-1]]).argmax())
    prompt_lens, stopped = generate(stop_token=stop)
    completions = [t[n:] for t, n in zip(stopped, prompt_lens)]
    ends = [c.index(stop) + 1 if stop in c else MAX_NEW for c in completions]
    assert [len(c) for c in completions] == ends and min(ends) < MAX_NEW


# Every sample drawing the stop token at one step: the engine stops there, a GPU one pass later
# (it reads whether any sample is active one step late, so the device never waits on that check).

STOP_AT = 2


def _early_stop_worker(stop_everywhere):
    from megatron_r3.rl.rollout import engine as rollout_engine

    device = init_parallel(Layout())
    try:
        config, policy = build_gpt(Layout(), MODEL, seed=4, device=device, flags=["--moe-enable-routing-replay"])
        rows = RowLayout(RankLayout.of_this_rank(config.sequence_parallel), config, ROW, 2, device)
        engine = RolloutEngine(
            lambda: build_gpt(Layout(), MODEL, seed=4, device=device, flags=["--moe-enable-routing-replay"])[1],
            policy, RoutingSpec.from_config(config), rows,
            SamplingParams(1.0, MAX_NEW, MODEL.vocab_size - 1, seed=11), staleness=0)
        passes, real_sample_tokens = [], rollout_engine.sample_tokens

        def sample_tokens(logits, uniforms, temperature):
            stop = engine.sampling.stop_token
            drawn = real_sample_tokens(logits, uniforms, temperature)
            drawn = torch.where(drawn == stop, 0, drawn)  # no sample stops by chance
            passes.append(len(passes))
            if stop_everywhere and len(passes) > STOP_AT:
                drawn = torch.full_like(drawn, stop)
            return drawn

        rollout_engine.sample_tokens = sample_tokens
        rng = np.random.default_rng(5)
        prompts = [rng.integers(1, MODEL.vocab_size - 1, size=int(n)) for n in rng.integers(1, 12, size=SAMPLES)]
        got = [s.token_ids[len(p):].tolist() for s, p in zip(engine.generate(prompts, iteration=3), prompts)]
        return {"device": device.type, "passes": len(passes), "completions": got}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_a_rollout_where_every_sample_stops_early_ends_there(backend):
    (endless,) = run_workers(_early_stop_worker, 1, False, backend=backend)
    (stopped,) = run_workers(_early_stop_worker, 1, True, backend=backend)
    stop = MODEL.vocab_size - 1
    assert endless["passes"] == MAX_NEW and all(len(c) == MAX_NEW for c in endless["completions"])
    # Each completion: the draws before the step, then the stop token; no token after it is kept.
    assert stopped["completions"] == [c[:STOP_AT] + [stop] for c in endless["completions"]]
    lag = 1 if stopped["device"] == "cuda" else 0
    assert stopped["passes"] == STOP_AT + 1 + lag
