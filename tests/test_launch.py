"""launch/pretrain_gpt_r3.py: its training loop under parallel layouts, replay on and off, and its errors.

The loop runs in gloo workers; the CPU RNG tracker is test scaffolding (on GPUs
``initialize`` seeds Megatron's CUDA tracker instead).
"""

import math

import pytest
from megatron.core import parallel_state

from tests.support.cpu_rng import install_cpu_rng
from tests.support.launcher import WorkerError, run_workers, worker_device
from tools.synthetic_rollout_dump import write_synthetic_dump

EXPERTS, TOPK, VOCAB = 4, 2, 64
MODEL_FLAGS = [
    "--num-layers", "4", "--moe-layer-freq", "0,1,0,1", "--hidden-size", "32", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--num-experts", str(EXPERTS),
    "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", "32", "--vocab-size", str(VOCAB),
    "--normalization", "LayerNorm", "--seq-length", "96", "--micro-batch-size", "2", "--lr", "1e-3",
]


def write_dump(path, routed=True):
    """Six samples of 9-40 tokens; every token but the last routed, or none."""
    return write_synthetic_dump(str(path), num_samples=6, num_layers=4, moe_layer_freq=[0, 1, 0, 1],
                                num_experts=EXPERTS, topk=TOPK, vocab_size=VOCAB, routed_fraction=float(routed))


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


def routes_taken_worker(argv):
    """Trains one iteration and compares, per MoE layer, the experts taken with those replayed."""
    from launch import pretrain_gpt_r3 as launcher

    routings = []

    def keep(*args, **kwargs):
        routings.append(make_routing(*args, **kwargs))
        return routings[-1]

    make_routing, launcher.moe_routing_for_chunk = launcher.moe_routing_for_chunk, keep
    try:
        train_worker(argv)
    finally:
        launcher.moe_routing_for_chunk = make_routing
    given = [r.expert_ids for r in routings if r.layer_numbers]
    taken = [r.recorded_expert_ids() for r in routings if r.layer_numbers]
    replayed = [ids[..., 0] >= 0 for ids in given]
    return {
        "replayed_rows": sum(int(m.sum()) for m in replayed),
        "live_rows": sum(int((~m).sum()) for m in replayed),
        "mismatched_rows": sum(int((g != t).any(-1)[m].sum()) for g, t, m in zip(given, taken, replayed)),
    }


@pytest.mark.parametrize("layout", ["ep2", "cp2", "tp2-sp"])
def test_replayed_routes_are_the_routes_taken(tmp_path, layout):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    argv = MODEL_FLAGS + ["--rollout-dump", dump, "--train-iters", "1", "--moe-enable-routing-replay", *LAYOUTS[layout]]
    for result in run_workers(routes_taken_worker, 2, argv, backend="gloo"):
        assert result["mismatched_rows"] == 0
        assert result["replayed_rows"] > 0 and result["live_rows"] > 0  # padding and last tokens route live


def test_tokens_without_routes_train_like_live_routing(tmp_path):
    routed = write_dump(tmp_path / "routed.r3dump", routed=True)
    unrouted = write_dump(tmp_path / "unrouted.r3dump", routed=False)
    layout = LAYOUTS["ep2"]
    live = [h["loss"] for h in run(routed, 2, *layout, iters=2)[0]["history"]]
    no_routes = [h["loss"] for h in run(unrouted, 2, "--moe-enable-routing-replay", *layout, iters=2)[0]["history"]]
    assert no_routes == pytest.approx(live, rel=1e-6, abs=1e-6)


def test_dump_for_another_model_is_refused(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    other = [f if f != "0,1,0,1" else "1" for f in MODEL_FLAGS]
    with pytest.raises(WorkerError, match=r"does not fit the model: MoE layers: the dump holds routes for MoE "
                                          r"layers \(2, 4\), the model's MoE layers are \(1, 2, 3, 4\)"):
        run_workers(train_worker, 1, other + ["--rollout-dump", dump, "--train-iters", "1"], backend="gloo")


def test_dump_with_tokens_the_model_cannot_take_is_refused(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")  # token ids up to 63, samples of 9-40 tokens
    with pytest.raises(WorkerError, match=r"does not fit the model: vocab: the dump holds token id \d+, the model's "
                                          r"--vocab-size is 8; seq-length: sample \d+ has \d+ tokens, the model's "
                                          r"--seq-length is 8"):
        run(dump, 1, "--vocab-size", "8", "--seq-length", "8", iters=1)


def test_microbatch_that_does_not_fit_the_row_is_refused(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    with pytest.raises(WorkerError, match="--seq-length is 40: raise it or lower --micro-batch-size"):
        run(dump, 1, "--seq-length", "40", iters=1)
