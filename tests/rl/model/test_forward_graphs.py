"""megatron_r3.rl.model.forward_graphs: forward-only passes that route live as CUDA graph replays.

A replay must give the eager forward's logits (and, recording, the routes taken) bit for
bit, for every batch of the captured shape (other sample lengths, so other ``cu_seqlens``,
attention masks and RoPE angles), with the weights as they are at the replay, for the
engine's bf16 model and a bf16 trainer's; the launcher must sample the same tokens and
train the same with and without graphs. Where graphs do not apply (a CPU, a layout of
several ranks per replica, experts that need host token counts, fp32 experts on a GPU) the
forward runs eagerly.
"""

import dataclasses

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from megatron_r3.dataplane.device.microbatches import pack_rollout_microbatch
from megatron_r3.dataplane.device.plan import RankLayout
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.rl.model import forward_graphs
from megatron_r3.rl.model.forward_graphs import ForwardGraphs, forward_model, rope_table_length
from megatron_r3.rl.trainer import update_graphs
from megatron_r3.routing_replay import moe_routing_for_chunk
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt
from tests.test_launch import EMBEDDED_FLAGS, train_worker

MODEL = TinyMoE(hidden_size=32, moe_ffn_hidden_size=32, num_experts=4, max_sequence_length=128)
ENGINE_FLAGS = ["--bf16", "--moe-grouped-gemm", "--moe-enable-routing-replay"]  # the engine's kind of model
TRAINER_FLAGS = ["--moe-enable-routing-replay"]  # the trainer's: fp32 with the local layers, grouped experts
BF16_TRAINER_FLAGS = TRAINER_FLAGS + ["--bf16"]
STATIC_ALLGATHER = ["--moe-token-dispatcher-type", "allgather", "--moe-allgather-static-shapes"]
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
                    got = graphs(chunk, batch)[0].clone()
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


def _recording_worker(flags):
    """Recording replays against eager recording forwards: logits and routes, and the routes an
    earlier replay handed back, read after later replays."""
    device = init_parallel(Layout())
    try:
        _, chunks = build_gpt(Layout(), MODEL, seed=2, device=device, flags=flags)
        (chunk,) = chunks
        graphs = ForwardGraphs(chunks)
        checks, kept = [], []
        with torch.no_grad():
            for i, batch in enumerate(_batches(5, device, seed=1)):
                if i == 3:
                    for param in chunk.parameters():
                        param.mul_(0.9)
                routing = moe_routing_for_chunk(chunk, record=True)
                want_logits = forward_model(chunk, batch, routing).clone()
                want_routes = routing.recorded_expert_ids()
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    logits, recorded = graphs(chunk, batch, record=True)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                checks.append((torch.equal(logits, want_logits), torch.equal(recorded.recorded_expert_ids(), want_routes),
                               recorded.layer_numbers == routing.layer_numbers))
                kept.append((recorded, want_routes))
        still = [torch.equal(recorded.recorded_expert_ids(), want) for recorded, want in kept]
        return {"enabled": graphs.enabled, "graphs": graphs.num_graphs, "equal": checks, "kept": still}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [ENGINE_FLAGS, BF16_TRAINER_FLAGS, ENGINE_FLAGS + STATIC_ALLGATHER],
                         ids=["engine-bf16", "trainer-bf16", "engine-bf16-static-allgather"])
def test_recording_replays_give_the_eager_logits_and_routes_bit_for_bit(flags):
    (result,) = run_workers(_recording_worker, 1, flags, backend="nccl")
    assert result == {"enabled": True, "graphs": 1, "equal": [(True, True, True)] * 5, "kept": [True] * 5}


def _enabled_worker(flags):
    device = init_parallel(Layout())
    try:
        _, chunks = build_gpt(Layout(), MODEL, seed=2, device=device, flags=flags)
        return ForwardGraphs(chunks).enabled
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [BF16_TRAINER_FLAGS + ["--no-moe-grouped-gemm"], TRAINER_FLAGS],
                         ids=["sequential-experts", "fp32-grouped-experts"])
def test_experts_that_need_host_counts_run_eagerly(flags):
    """SequentialMLP, and grouped experts in fp32 (SequentialMLP's forward on CUDA)."""
    assert run_workers(_enabled_worker, 1, flags, backend="nccl") == [False]


def _cpu_worker(layout):
    device = init_parallel(layout)
    try:
        _, chunks = build_gpt(layout, MODEL, seed=2, device=device, flags=ENGINE_FLAGS)
        graphs = ForwardGraphs(chunks)
        (batch,) = _batches(1, device)
        with torch.no_grad():
            same = torch.equal(graphs(chunks[0], batch)[0], forward_model(chunks[0], batch, None))
        return graphs.enabled, graphs.num_graphs, same
    finally:
        parallel_state.destroy_model_parallel()


def test_on_a_cpu_the_forward_runs_eagerly():
    assert run_workers(_cpu_worker, 1, Layout(), backend="gloo") == [(False, 0, True)]  # gloo: GPUs hidden


def _counts_worker(flags):
    init_parallel(Layout())
    try:
        _, (chunk,) = build_gpt(Layout(), MODEL, seed=2, flags=flags)
        return forward_graphs.token_counts_stay_on_device(chunk)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("flags, on_device", [
    (ENGINE_FLAGS, True),
    (ENGINE_FLAGS + ["--moe-token-dispatcher-type", "allgather"], False),  # it reads them back: no capture
    (ENGINE_FLAGS + STATIC_ALLGATHER, True),  # sized for the most rows: nothing read back
    (["--bf16", "--no-moe-grouped-gemm", "--moe-enable-routing-replay"], False),  # SequentialMLP: host counts
], ids=["alltoall-grouped", "allgather", "allgather-static", "sequential"])
def test_graphs_need_moe_layers_that_keep_their_counts_on_the_device(flags, on_device):
    assert run_workers(_counts_worker, 1, flags, backend="gloo") == [on_device]


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
    """The launcher's metrics, and how many forward-only passes replayed a graph and how many update passes
    replayed Megatron's full-iteration graph (the pass that captures it replays it too)."""
    replays = {"forward": 0, "update": 0}
    forward_replay, update_run_through = forward_graphs._CapturedForward.replay, update_graphs.run_through

    def counting_forward(self, batch):
        replays["forward"] += 1
        return forward_replay(self, batch)

    def counting_update(wrapper, *args, **kwargs):
        # The wrapper's passes before its warm-up count run eagerly; from there on each one replays.
        replays["update"] += wrapper.curr_iter(update_graphs._STAGE) >= wrapper.cuda_graph_warmup_steps
        return update_run_through(wrapper, *args, **kwargs)

    forward_graphs._CapturedForward.replay = counting_forward
    update_graphs.run_through = counting_update
    timings = {"tokens_per_s", "elapsed_s", "eta_s"}
    history = train_worker(argv)["history"]
    return [{key: value for key, value in metrics.items() if key not in timings and not key.startswith("time/")}
            for metrics in history], replays


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [["--moe-enable-routing-replay"], ["--moe-enable-routing-replay",
                                                                     "--routing-replay-mode", "r2"]], ids=["r3", "r2"])
def test_the_launcher_trains_the_same_with_and_without_graphs(mode):
    """The engine's passes, the trainer's live forward-only passes (R3's comparison, R2's old log-probs) and
    its update passes: the same metrics (losses, gradient norms, mismatch) with graphs and without."""
    # One microbatch a pass; a bf16 trainer, whose grouped experts take device counts on a GPU. Three
    # iterations: Megatron's full-iteration graph runs the first update pass eagerly, captures the second
    # and replays it, and replays the third.
    argv = EMBEDDED_FLAGS + ["--train-iters", "3", "--micro-batch-size", "4", "--bf16", *mode]
    ((with_graphs, replays),) = run_workers(_counting_train_worker, 1, argv, backend="nccl")
    ((eager, no_replays),) = run_workers(_counting_train_worker, 1,
                                         argv + ["--no-rollout-cuda-graphs", "--no-trainer-cuda-graphs"], backend="nccl")
    ((engine_only, engine_replays),) = run_workers(_counting_train_worker, 1, argv + ["--no-trainer-cuda-graphs"],
                                                   backend="nccl")
    assert no_replays == {"forward": 0, "update": 0} and engine_replays["update"] == 0
    assert replays["forward"] > engine_replays["forward"] > 0  # the trainer's forward-only passes replayed too
    assert replays["update"] == 2  # every update pass after the wrapper's eager first one
    # A replayed update pass makes no host sync: it is on the sync-free path even where its routes carry
    # no host counts (R2's recorded routes), which the eager pass is not. The wrapper's eager first pass
    # reads its copies of the microbatch, which carry no host counts (they would be constants of the graph).
    sync_free = [metrics.pop("routing/host_split_microbatches") for metrics in with_graphs]
    eager_sync_free = [metrics.pop("routing/host_split_microbatches") for run in (eager, engine_only) for metrics in run]
    assert sync_free == [0.0, 1.0, 1.0]
    assert eager_sync_free == [1.0 if mode == ["--moe-enable-routing-replay"] else 0.0] * 6
    assert _differences(with_graphs, eager) == [] and _differences(engine_only, eager) == []


def _differences(history, reference):
    """(iteration, metric, value, reference value) wherever two runs' metrics differ."""
    assert len(history) == len(reference)
    return [(want["iteration"], key, got.get(key), want.get(key)) for got, want in zip(history, reference)
            for key in sorted(set(got) | set(want)) if got.get(key) != want.get(key)]
