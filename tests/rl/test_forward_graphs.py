"""megatron_r3.rl.forward_graphs: the rollout engine's generation passes as CUDA graph replays.

A replay must give the eager forward's logits bit for bit, for every batch of the captured
shape (other sample lengths, so other ``cu_seqlens``, attention masks and RoPE angles), with
the weights as they are at the replay; the launcher must sample the same tokens with and
without graphs. Where graphs do not apply (a CPU, a layout of several ranks per replica)
the forward runs eagerly.
"""

import dataclasses

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from megatron_r3.dataplane.microbatches import pack_rollout_microbatch
from megatron_r3.dataplane.plan import RankLayout
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl import forward_graphs
from megatron_r3.rl.forward_graphs import ForwardGraphs, forward_model, rope_table_length
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt
from tests.test_launch import EMBEDDED_FLAGS, train_worker

MODEL = TinyMoE(hidden_size=32, moe_ffn_hidden_size=32, num_experts=4, max_sequence_length=128)
ENGINE_FLAGS = ["--bf16", "--moe-grouped-gemm", "--moe-enable-routing-replay"]  # the engine's kind of model
ROW = 128


def _batches(count, device, seed=0):
    """``count`` rows of 6 samples of random lengths each, packed like the engine's generation rows."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        samples = [RolloutSample(token_ids=rng.integers(0, MODEL.vocab_size, int(n)), loss_mask=np.zeros(int(n), bool))
                   for n in rng.integers(3, 20, size=6)]
        batches.append(pack_rollout_microbatch(samples, RankLayout(), ROW, device))
    return batches


def _graph_worker():
    device = init_parallel(Layout())
    try:
        _, chunks = build_gpt(Layout(), MODEL, seed=2, device=device, flags=ENGINE_FLAGS)
        (chunk,) = chunks
        chunk.eval()
        graphs = ForwardGraphs(chunks)
        batches = _batches(5, device)
        checks = []
        with torch.no_grad():
            for i, batch in enumerate(batches):
                if i == 3:  # the weights change in place, as the engine's do every iteration
                    for param in chunk.parameters():
                        param.mul_(0.9)
                want = forward_model(chunk, batch, None).clone()
                if i >= 2:  # captured by now: a replay may not wait for the device
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    got = graphs(chunk, batch).clone()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                checks.append(torch.equal(got, want))
        return {"enabled": graphs.enabled, "graphs": graphs.num_graphs, "equal": checks}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
def test_replays_give_the_eager_logits_bit_for_bit():
    (result,) = run_workers(_graph_worker, 1, backend="nccl")
    assert result == {"enabled": True, "graphs": 1, "equal": [True] * 5}


def _cpu_worker(layout):
    device = init_parallel(layout)
    try:
        _, chunks = build_gpt(layout, MODEL, seed=2, device=device, flags=ENGINE_FLAGS)
        graphs = ForwardGraphs(chunks)
        (batch,) = _batches(1, device)
        with torch.no_grad():
            same = torch.equal(graphs(chunks[0], batch), forward_model(chunks[0], batch, None))
        return graphs.enabled, graphs.num_graphs, same
    finally:
        parallel_state.destroy_model_parallel()


def test_on_a_cpu_the_forward_runs_eagerly():
    assert run_workers(_cpu_worker, 1, Layout()) == [(False, 0, True)]


def _rope_worker(lengths):
    """Max |logit difference| from the eager forward with each RoPE table length, on the CPU."""
    device = init_parallel(Layout())
    try:
        _, (chunk,) = build_gpt(Layout(), MODEL, seed=2, device=device, flags=ENGINE_FLAGS)
        (batch,) = _batches(1, device)
        with torch.no_grad():
            want = forward_model(chunk, batch, None)
            diffs = []
            for length in lengths:
                params = dataclasses.replace(batch.packed_seq_params, max_seqlen_q=length, max_seqlen_kv=length)
                got = forward_model(chunk, dataclasses.replace(batch, packed_seq_params=params), None)
                diffs.append(float((got.float() - want.float()).abs().max()))
        return diffs
    finally:
        parallel_state.destroy_model_parallel()


def test_the_graphs_rope_table_gives_every_position_its_eager_angles():
    """A graph serves rows whose longest sample changes: it takes a table longer than any sample."""
    graph_table, row_table = run_workers(_rope_worker, 1, [rope_table_length(ROW), ROW])[0]
    assert graph_table == 0.0
    assert row_table > 0.0  # negative control: a table as long as the row reads positions in the row


def _replica_worker(layout):
    init_parallel(layout)
    try:
        return forward_graphs.one_rank_per_replica()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("layout, one", [(Layout(), True), (Layout(dp=2), True), (Layout(pp=2), False),
                                         (Layout(tp=2), False), (Layout(ep=2, dp=2), False)],
                         ids=["single", "dp2", "pp2", "tp2", "ep2-dp2"])
def test_graphs_need_one_rank_per_model_replica(layout, one):
    assert run_workers(_replica_worker, layout.world_size, layout) == [one] * layout.world_size


def _counting_train_worker(argv):
    replays = []
    replay = forward_graphs._CapturedForward.replay

    def counting(self, batch):
        replays.append(1)
        return replay(self, batch)

    forward_graphs._CapturedForward.replay = counting
    timings = {"tokens_per_s", "elapsed_s", "eta_s"}
    history = train_worker(argv)["history"]
    return [{key: value for key, value in metrics.items() if key not in timings and not key.startswith("time/")}
            for metrics in history], len(replays)


@pytest.mark.gpu
def test_the_launcher_samples_the_same_rollouts_with_and_without_graphs():
    argv = EMBEDDED_FLAGS + ["--train-iters", "2", "--moe-enable-routing-replay"]
    ((with_graphs, replays),) = run_workers(_counting_train_worker, 1, argv, backend="nccl")
    ((eager, no_replays),) = run_workers(_counting_train_worker, 1, argv + ["--no-rollout-cuda-graphs"],
                                         backend="nccl")
    assert replays > 0 and no_replays == 0
    assert with_graphs == eager
