"""launch/pretrain_gpt_r3.py: its training loop under parallel layouts, replay on and off, and its errors.

The loop runs in gloo workers; the CPU RNG tracker is test scaffolding (on GPUs
``initialize`` seeds Megatron's CUDA tracker instead).
"""

import math

import numpy as np
import pytest
from megatron.core import parallel_state

from megatron_r3.routes import RolloutRoutes
from megatron_r3.rollout_dump import RolloutDumpWriter, RolloutSample
from tests.support.cpu_rng import install_cpu_rng
from tests.support.launcher import WorkerError, run_workers, worker_device

MOE_LAYERS = (2, 4)
EXPERTS, TOPK, VOCAB = 4, 2, 64
MODEL_FLAGS = [
    "--num-layers", "4", "--moe-layer-freq", "0,1,0,1", "--hidden-size", "32", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--num-experts", str(EXPERTS),
    "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", "32", "--vocab-size", str(VOCAB),
    "--normalization", "LayerNorm", "--seq-length", "96", "--micro-batch-size", "2", "--lr", "1e-3",
]


def write_dump(path, num_samples=6, routed=True, seed=0):
    """Samples of 9-40 tokens: a prompt, then a trained response with rollout log-probs and routes."""
    rng = np.random.default_rng(seed)
    with RolloutDumpWriter(path, num_experts=EXPERTS, topk=TOPK, layer_numbers=MOE_LAYERS) as writer:
        for _ in range(num_samples):
            n = int(rng.integers(9, 41))
            mask = np.arange(n) >= n // 3
            ids = np.argsort(rng.random((n, len(MOE_LAYERS), EXPERTS)), axis=2)[:, :, :TOPK]
            valid = np.full(n, routed)
            valid[-1] = False  # the final sampled token was never run by the engine
            routes = RolloutRoutes.from_ids(ids, num_experts=EXPERTS, layer_numbers=MOE_LAYERS, valid=valid)
            writer.write(RolloutSample(rng.integers(0, VOCAB, n), mask, -rng.random(n).astype(np.float32), routes))
    return str(path)


def train_worker(argv):
    from launch import pretrain_gpt_r3 as launcher

    args = launcher.parse_args(argv)
    launcher.init_model_parallel(args)
    install_cpu_rng(args.seed)
    device = worker_device()
    config = launcher.transformer_config(args, device)
    chunks = launcher.build_model(args, config, device)
    lines = []
    try:
        history = launcher.train(args, config, chunks, device, log=lines.append)
    finally:
        parallel_state.destroy_model_parallel()
    return {"history": history, "lines": lines}


def run(dump, ranks, *flags, iters=3):
    argv = MODEL_FLAGS + ["--rollout-dump", dump, "--train-iters", str(iters), *flags]
    return run_workers(train_worker, ranks, argv, backend="gloo")


LAYOUTS = {
    "ep2": ["--expert-model-parallel-size", "2"],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2": ["--context-parallel-size", "2"],
    "pp2-vp2": ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                "--global-batch-size", "4"],
    "dp2": ["--global-batch-size", "4"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replay_training_runs_and_learns_under_layouts(tmp_path, layout):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    results = run(dump, 2, "--moe-enable-routing-replay", *LAYOUTS[layout], iters=6)
    history = results[0]["history"]
    assert [h["loss"] for h in history] == [h["loss"] for h in results[1]["history"]], "ranks disagree"
    assert all(math.isfinite(h["loss"]) and h["tokens"] > 0 for h in history)
    # The dump is re-read from the start: iterations 1 and 4 (then 2 and 5, ...) see the same samples.
    assert history[3]["loss"] < history[0]["loss"] and history[4]["loss"] < history[1]["loss"]
    assert 0 < history[0]["logp_abs_diff"] and 0 <= history[0]["ratio_outside_frac"] <= 1
    lines = results[1]["lines"]
    assert len(lines) == 6 and lines[0].startswith(" iteration      1/6 | loss ")


def test_replay_uses_the_dump_routes_and_tokens_without_routes_route_live(tmp_path):
    routed = write_dump(tmp_path / "routed.r3dump", routed=True)
    unrouted = write_dump(tmp_path / "unrouted.r3dump", routed=False)
    layout = LAYOUTS["ep2"]
    live = run(routed, 2, *layout, iters=1)[0]["history"][0]["loss"]
    replayed = run(routed, 2, "--moe-enable-routing-replay", *layout, iters=1)[0]["history"][0]["loss"]
    no_routes = run(unrouted, 2, "--moe-enable-routing-replay", *layout, iters=1)[0]["history"][0]["loss"]
    assert no_routes == pytest.approx(live, rel=1e-6, abs=1e-6)
    assert abs(replayed - live) > 1e-4


def test_dump_for_another_model_is_refused(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    other = [f if f != "0,1,0,1" else "1" for f in MODEL_FLAGS]
    with pytest.raises(WorkerError, match=r"has routes for \(experts, top-k, MoE layers\) = \(4, 2, \(2, 4\)\); "
                                          r"the model has \(4, 2, \(1, 2, 3, 4\)\)"):
        run_workers(train_worker, 1, other + ["--rollout-dump", dump, "--train-iters", "1"], backend="gloo")


def test_microbatch_that_does_not_fit_the_row_is_refused(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    with pytest.raises(WorkerError, match="--seq-length is 40: raise it or lower --micro-batch-size"):
        run(dump, 1, "--seq-length", "40", iters=1)
