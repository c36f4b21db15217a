"""launch/pretrain_gpt_r3.py: the embedded R3 loop and dump mode, under parallel layouts, replay on and off.

Most runs are in-process gloo workers (``run_workers``) on a small model; one runs
the launcher as a real ``torchrun --nproc-per-node 2`` subprocess with its defaults.
"""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from megatron_r3.rl.trainer.metrics import metric_keys
from tests.support.launcher import WorkerError, run_workers
from tools.synthetic_rollout_dump import write_synthetic_dump

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERTS, TOPK, VOCAB = 4, 2, 64
GPT_LAYERS = ["--num-layers", "4", "--moe-layer-freq", "0,1,0,1"]
SMALL_MODEL = GPT_LAYERS + [
    "--hidden-size", "32", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--num-experts", str(EXPERTS),
    "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", "32", "--normalization", "LayerNorm",
    "--init-method-std", "0.02",
    # The local layers and GeLU on every machine (the launcher's GPU default is SwiGLU): the tests of
    # TransformerEngine's choose theirs.
    "--transformer-impl", "local", "--no-swiglu",
]
DUMP_FLAGS = SMALL_MODEL + ["--vocab-size", str(VOCAB), "--seq-length", "96", "--micro-batch-size", "2",
                            "--rollouts-per-prompt", "2", "--lr", "1e-3"]
EMBEDDED_FLAGS = SMALL_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4", "--rollouts-per-prompt", "2",
                                "--task-max-symbols", "4", "--train-iters", "1"]


def write_dump(path, routed=True):
    """Six samples of 9-40 tokens with rewards; every token but the last routed, or none."""
    return write_synthetic_dump(str(path), num_samples=6, num_layers=4, moe_layer_freq=[0, 1, 0, 1],
                                num_experts=EXPERTS, topk=TOPK, vocab_size=VOCAB, routed_fraction=float(routed))


def train_worker(argv):
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.run import train

    settings = run_settings(parse_args(argv))
    device = initialize(settings)  # the process group exists: parallel state and seeds
    lines = []
    try:
        history = train(settings, device, log=lines.append)
    finally:
        parallel_state.destroy_model_parallel()
    return {"history": history, "lines": lines}


def run(dump, ranks, *flags, iters=3):
    argv = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", str(iters), *flags]
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
def test_dump_training_runs_and_learns_under_layouts(tmp_path, layout):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    results = run(dump, 2, "--moe-enable-routing-replay", *LAYOUTS[layout], iters=6)
    history = results[0]["history"]
    assert [h["loss"] for h in history] == [h["loss"] for h in results[1]["history"]], "ranks disagree"
    assert all(math.isfinite(h["loss"]) and h["tokens"] > 0 for h in history)
    # The dump is re-read from the start: iterations 1 and 4 (then 2 and 5, ...) see the same samples,
    # and the policy-gradient loss of the same samples falls as the policy follows their advantages.
    assert history[3]["loss"] < history[0]["loss"] and history[4]["loss"] < history[1]["loss"]
    assert 0 < history[0]["mismatch/replay/logp_abs_diff"] and 0 <= history[0]["mismatch/replay/frac_abs_gt_ln2"] <= 1
    assert history[0]["mismatch/live/k3_kl"] is None  # no --r3-compare with a dump by default
    assert 0 <= history[0]["reward/mean"] <= 1
    lines = results[1]["lines"]
    # Start-up says what runs (layers, update pass) and where its seconds went, then one line per iteration.
    assert lines[0] == " layers: Megatron's local layers in fp32; experts: torch's grouped GEMM (GroupedGemmExperts)"
    assert lines[1] == " update pass: eager (a CPU)"
    assert lines[2].startswith(" time to build the policy, its training stack and the rollout source (seconds): ")
    assert len(lines) == 9 and lines[3].startswith(" iteration        1/       6 | consumed samples: ")


def wrong_counts_worker(argv):
    """``train_worker`` with rank 0's host token counts of its first MoE layer swapped at two experts:
    right in sum (the dispatch runs), wrong per expert."""
    from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange

    gather = ExpertCountExchange.gather_batch

    def swapped(self, local, num_layers):
        microbatches = gather(self, local, num_layers)
        chunks = microbatches[0]  # the batch's first microbatch
        if torch.distributed.get_rank() == 0 and chunks[0] is not None:
            counts = chunks[0][0, 0]  # this rank's row (one rank per tp_ep group), first layer
            most, least = int(counts.argmax()), int(counts.argmin())
            counts[[most, least]] = counts[[least, most]]
        return microbatches

    ExpertCountExchange.gather_batch = swapped
    return train_worker(argv)


def test_a_wrong_host_count_stops_the_step_on_every_rank_naming_layer_expert_and_rank(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    argv = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "1", "--moe-enable-routing-replay",
                         *LAYOUTS["dp2"]]
    with pytest.raises(WorkerError) as failure:
        run_workers(wrong_counts_worker, 2, argv, backend="gloo")
    report = str(failure.value)
    # The rank whose counts were wrong names them; its peer stops too, in the same step, before the
    # optimizer steps: no device-side assert, the processes end with a Python error.
    assert re.search(r"rank 0 raised:.*ValueError: MoERouting.host_tokens_per_expert is wrong at MoE layer 2, "
                     r"expert \d+, tp_ep rank 0: the routes send \d+ tokens there, the counts say \d+", report, re.S)
    assert re.search(r"rank 1 raised:.*RuntimeError: another rank found wrong routes", report, re.S)


def capture_passes():
    """Records every model pass the trainer and the engine run, and the engine's samples.

    Returns the list the passes land in: per pass its owner, kind, and per microbatch and chunk
    the routes given (None: live) and taken.
    """
    from megatron_r3.rl.rollout import engine as rollout_engine
    from megatron_r3.rl.trainer import policy_trainer, update_graphs

    passes = []

    def wrap(owner, original):
        def run_pass(chunks, microbatches, loss_fn, **kwargs):
            # Record every pass (also those the loop does not record) to see the routes taken.
            result = original(chunks, microbatches, loss_fn, **{**kwargs, "record": True})
            passes.append({
                "owner": owner, "record": kwargs.get("record", False),
                "forward_only": kwargs.get("forward_only", True),
                "given": [[None if r is None or r.expert_ids is None else r.expert_ids.cpu() for r in per_chunk]
                          for per_chunk in result.routings],
                "taken": [[None if r is None else r.recorded_expert_ids().cpu() for r in per_chunk]
                          for per_chunk in result.routings],
                "host_split_microbatches": result.host_split_microbatches,
                "fillers": [[None if i is None or i.filler_rows is None else i.filler_rows for i in per_chunk]
                            for per_chunk in result.items],
            })
            return result
        return run_pass

    policy_trainer.run_pass = wrap("trainer", policy_trainer.run_pass)
    update_graphs.run_pass = wrap("trainer", update_graphs.run_pass)  # the update pass, eager where no graph applies
    rollout_engine.run_pass = wrap("engine", rollout_engine.run_pass)
    generate = rollout_engine.RolloutEngine.generate

    def keep_samples(self, prompts, iteration):
        samples = generate(self, prompts, iteration)
        passes.append({"owner": "engine", "samples": [
            (s.token_ids, s.logprobs, s.loss_mask, s.routes.to_int64()) for s in samples]})
        return samples

    rollout_engine.RolloutEngine.generate = keep_samples
    return passes


def passes_worker(argv):
    passes = capture_passes()
    result = train_worker(argv)
    return {**result, "passes": passes}


def mismatched_rows(given, taken, fillers=None):
    """Rows (token, layer) with a route in ``given`` that ``taken`` differs from, and how many had one.

    With ``fillers`` (per microbatch and chunk, the filler rows), filler routes do not count.
    """
    bad = rows = 0
    fillers = fillers or [[None] * len(g) for g in given]
    for g_chunks, t_chunks, f_chunks in zip(given, taken, fillers):
        for g, t, f in zip(g_chunks, t_chunks, f_chunks):
            if g is None or g.shape[0] == 0:
                continue
            replayed = g[..., 0] >= 0
            if f is not None:
                replayed &= ~torch.from_numpy(f)
            rows += int(replayed.sum())
            bad += int((g != t).any(-1)[replayed].sum())
    return bad, rows


def update_pass(passes):
    return next(p for p in passes if p.get("owner") == "trainer" and not p["forward_only"])


EMBEDDED_LAYOUTS = {name: LAYOUTS[name] for name in ("ep2", "tp2-sp", "cp2")}
EMBEDDED_LAYOUTS["pp2-vp2"] = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
# Experts whole on each rank (expert-TP 1), spread over the two TP ranks by EP.
EMBEDDED_LAYOUTS["tp2-sp-ep2-etp1"] = LAYOUTS["tp2-sp"] + ["--expert-model-parallel-size", "2",
                                                          "--expert-tensor-parallel-size", "1"]
EMBEDDED_LAYOUTS["pp2-uneven-recompute"] = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers",
                                            "1", "--decoder-last-pipeline-num-layers", "3",
                                            "--recompute-granularity", "full"]


# HybridModels of the same layers (attention then an MLP or MoE: dense, MoE, dense, MoE), the
# pipeline stages and virtual stages from the pattern's '|' segments.
HYBRID_EMBEDDED_LAYOUTS = {
    "hybrid-pp2-vp2": ["--hybrid-layer-pattern", "*-|*E|*-|*E", "--pipeline-model-parallel-size", "2"],
    "hybrid-ep2": ["--hybrid-layer-pattern", "*-*E*-*E", "--expert-model-parallel-size", "2"],
}


@pytest.mark.parametrize("layout", sorted(EMBEDDED_LAYOUTS) + sorted(HYBRID_EMBEDDED_LAYOUTS))
def test_the_trainer_replays_the_routes_the_engine_took_under_layouts(layout):
    if layout in HYBRID_EMBEDDED_LAYOUTS:
        argv = EMBEDDED_FLAGS[len(GPT_LAYERS):] + ["--moe-enable-routing-replay", *HYBRID_EMBEDDED_LAYOUTS[layout]]
    else:
        argv = EMBEDDED_FLAGS + ["--moe-enable-routing-replay", *EMBEDDED_LAYOUTS[layout]]
    results = run_workers(passes_worker, 2, argv, backend="gloo")
    replayed_rows = 0  # under PP2+VP2 one rank builds only the dense layers
    for result in results:
        passes = result["passes"]
        recording = next(p for p in passes if p.get("owner") == "engine" and p.get("record"))
        update = update_pass(passes)
        # Every route the trainer replays is the one the engine's recording pass took for that
        # token, chunk and layer (same packing, same layout), and the trainer's routers took it.
        bad, replayed = mismatched_rows(update["given"], recording["taken"], update["fillers"])
        assert bad == 0
        replayed_rows += replayed
        assert mismatched_rows(update["given"], update["taken"])[0] == 0  # fillers too
        # The final tokens and the padding get filler routes: every microbatch is sync-free.
        assert update["host_split_microbatches"] == len(update["given"])
        # Like vLLM, the engine gives no route to the final sampled token, and to none other.
        samples = next(p["samples"] for p in passes if "samples" in p)
        for tokens, logprobs, loss_mask, routes in samples:
            routed = routes[:, 0, 0] >= 0
            assert not routed[-1] and routed[:-1].all()
            assert loss_mask.sum() >= 1 and not loss_mask[0] and (logprobs[1:][loss_mask[1:]] <= 0).all()
        history = result["history"][0]
        assert history["routing/replayed_tokens"] > 0 and history["routing/filler_tokens"] > 0
        assert history["routing/live_tokens"] == 0 and history["routing/host_split_microbatches"] == 1.0
        assert history["mismatch/replay/logp_abs_diff"] > 0  # the engine runs bf16, the trainer fp32
    assert replayed_rows > 0
    ours, theirs = ([p["samples"] for p in r["passes"] if "samples" in p][0] for r in results)
    if not layout.endswith("ep2"):  # one replica: its ranks hold the same samples
        for a, b in zip(ours, theirs):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    else:  # EP2 on two ranks is two data-parallel replicas: each completes its own prompt
        assert ours[0][0].tolist() != theirs[0][0].tolist()


def test_r2_update_pass_replays_the_routes_of_the_old_logprob_pass():
    argv = EMBEDDED_FLAGS + ["--moe-enable-routing-replay", "--routing-replay-mode", "r2", "--no-r3-compare",
                             *LAYOUTS["tp2-sp"]]
    for result in run_workers(passes_worker, 2, argv, backend="gloo"):
        trainer = [p for p in result["passes"] if p.get("owner") == "trainer"]
        assert [(p["record"], p["forward_only"]) for p in trainer] == [(True, True), (False, False)]
        old, update = trainer
        for old_chunks, given_chunks, taken_chunks in zip(old["taken"], update["given"], update["taken"]):
            for recorded, given, taken in zip(old_chunks, given_chunks, taken_chunks):
                assert torch.equal(given, recorded) and torch.equal(taken, recorded)
        history = result["history"][0]
        # Agreement compares the trainer with the engine's routes, which R2 does not use.
        assert history["routing/agreement"] is None
        assert history["routing/live_tokens"] == 0 and history["mismatch/live/k3_kl"] is None


def test_live_training_with_compare_reports_both_modes():
    argv = EMBEDDED_FLAGS + ["--train-iters", "2"]  # no --moe-enable-routing-replay: the trainer routes live
    for result in run_workers(passes_worker, 2, argv, backend="gloo"):
        trainer = [p for p in result["passes"] if p.get("owner") == "trainer"]
        compare, update = trainer[:2]
        assert all(g is None for per_chunk in update["given"] for g in per_chunk)  # the update routes live
        assert mismatched_rows(compare["given"], compare["taken"])[1] > 0  # the compare pass replays
        for history in result["history"]:
            assert history["routing/replayed_tokens"] == 0 and history["routing/live_tokens"] == history["tokens"]
            assert history["mismatch/live/k3_kl"] > 0 and history["mismatch/replay/k3_kl"] > 0
            assert 0 < history["routing/agreement"] <= 1


def test_dump_routes_replayed_are_the_routes_taken(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    argv = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "1", "--moe-enable-routing-replay",
                         *LAYOUTS["cp2"]]
    for result in run_workers(passes_worker, 2, argv, backend="gloo"):
        update = update_pass(result["passes"])
        bad, replayed = mismatched_rows(update["given"], update["taken"])
        assert bad == 0 and replayed > 0


def test_dump_mode_runs_sync_free_with_the_loss_curve_of_the_live_tail(tmp_path):
    """A vLLM-shaped dump (every token routed but each sample's final one): with filler routes
    every update microbatch takes the host-split path, and the losses are those of routing the
    final tokens live (the expert GEMMs' token groups change: a tolerance of fp32 rounding)."""
    dump = write_dump(tmp_path / "rollouts.r3dump")
    flags = ["--moe-enable-routing-replay", *LAYOUTS["ep2"]]
    filled = run(dump, 2, *flags)[0]["history"]
    live_tail = run(dump, 2, *flags, "--no-filler-routes")[0]["history"]
    assert [h["routing/host_split_microbatches"] for h in filled] == [1.0] * 3
    assert [h["routing/host_split_microbatches"] for h in live_tail] == [0.0] * 3
    assert all(h["routing/filler_tokens"] > 0 for h in filled)
    assert all(h["routing/filler_tokens"] == 0 and h["routing/live_tokens"] > 0 for h in live_tail)
    assert [h["loss"] for h in filled] == pytest.approx([h["loss"] for h in live_tail], rel=1e-5, abs=1e-6)


def test_tokens_without_routes_train_like_live_routing(tmp_path):
    routed = write_dump(tmp_path / "routed.r3dump", routed=True)
    unrouted = write_dump(tmp_path / "unrouted.r3dump", routed=False)
    layout = LAYOUTS["ep2"]
    live = [h["loss"] for h in run(routed, 2, *layout, iters=2)[0]["history"]]
    no_routes = [h["loss"] for h in run(unrouted, 2, "--moe-enable-routing-replay", *layout, iters=2)[0]["history"]]
    assert no_routes == pytest.approx(live, rel=1e-6, abs=1e-6)


def test_dump_for_another_model_is_refused(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    other = [f if f != "0,1,0,1" else "1" for f in DUMP_FLAGS]
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
    with pytest.raises(WorkerError, match=r"--seq-length 40 is too short: iteration 1 packs records \[0, 1\] of the "
                                          r"dump \(\[36, 40\] tokens\) .*; raise --seq-length or lower --micro-batch-size"):
        run(dump, 1, "--seq-length", "40", iters=1)


def test_dump_without_rewards_is_refused(tmp_path):
    path = write_synthetic_dump(str(tmp_path / "bare.r3dump"), num_samples=2, num_layers=4,
                                moe_layer_freq=[0, 1, 0, 1], num_experts=EXPERTS, topk=TOPK, vocab_size=VOCAB)
    from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
    from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter

    bare = str(tmp_path / "no-reward.r3dump")
    with RolloutDumpReader(path) as reader, RolloutDumpWriter(
            bare, num_experts=EXPERTS, topk=TOPK, layer_numbers=(2, 4)) as writer:
        for sample in reader:
            sample.meta = {}
            writer.write(sample)
    with pytest.raises(WorkerError, match=r"--rollout-dump .*no-reward\.r3dump: record 0 has neither 'reward' nor 'advantage'"):
        run(bare, 1, iters=1)


@pytest.fixture(scope="module")
def torchrun_default_run(tmp_path_factory):
    """The embedded default as a user runs it: torchrun, 2 ranks, only --moe-enable-routing-replay."""
    metrics = tmp_path_factory.mktemp("torchrun") / "metrics.jsonl"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # CPU and gloo, as on a machine without GPUs
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "launch/pretrain_gpt_r3.py", "--moe-enable-routing-replay",
               "--train-iters", "3", "--metrics-file", str(metrics)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return done.stdout, rows


def test_torchrun_default_run_logs_progress_and_metrics(torchrun_default_run):
    stdout, rows = torchrun_default_run
    # Start-up, once, from the last rank, before the first iteration: where its seconds went.
    startup = [line for line in stdout.splitlines() if line.startswith(" time to ")]
    assert len(startup) == 2 and stdout.index(startup[1]) < stdout.index(" iteration ")
    assert re.fullmatch(r" time to initialize \(seconds\): imports \d+\.\d \| distributed and devices \d+\.\d",
                        startup[0])
    assert re.fullmatch(r" time to build the policy, its training stack and the rollout source \(seconds\): "
                        r"\d+\.\d", startup[1])
    lines = [line for line in stdout.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == 3
    for i, line in enumerate(lines, 1):
        assert line.startswith(f" iteration {i:8d}/       3 | consumed samples: {32 * i:10d} | loss: ")
        for part in ("reward: ", "k3 replay: ", "k3 live: ", "agreement: ", "tokens/s: ", "ETA: "):
            assert part in line
    moe_layers = range(1, 9)  # the default: 8 layers, all MoE
    for i, row in enumerate(rows, 1):
        assert list(row) == metric_keys(moe_layers)
        assert row["iteration"] == i and row["consumed_samples"] == 32 * i and row["tokens"] > 32 * 5
        assert 0 <= row["reward/mean"] <= 1 and math.isfinite(row["loss"])
        assert 0 < row["routing/agreement"] < 1
        assert all(0 < row[f"routing/agreement/layer_{n}"] <= 1 for n in moe_layers)
        # Every token is replayed but the final sampled one of each of the 32 samples.
        # Each of the 32 samples' final token has no engine route: it replays a filler route.
        assert row["routing/filler_tokens"] == 32 and row["routing/replayed_tokens"] == row["tokens"] - 32
        assert row["routing/live_tokens"] == 0 and row["routing/host_split_microbatches"] == 1.0
        # Where the iteration's time went; R3 has no old-log-prob pass; syncs were not counted.
        assert all(row[f"time/{phase}_s"] > 0 for phase in ("rollout", "pass/compare", "pass/update", "optimizer"))
        assert row["time/pass/old_logprob_s"] is None and row["host_syncs/pass/update"] is None


def test_torchrun_default_run_shows_replay_lowering_the_mismatch(torchrun_default_run):
    _, rows = torchrun_default_run

    def mean(mode, name):
        return sum(r[f"mismatch/{mode}/{name}"] for r in rows) / len(rows)

    assert mean("replay", "k3_kl") < mean("live", "k3_kl") / 5
    assert mean("replay", "logp_abs_diff") < mean("live", "logp_abs_diff") / 1.5
    assert mean("live", "frac_abs_gt_ln2") > 0
    assert mean("replay", "frac_abs_gt_ln2") < mean("live", "frac_abs_gt_ln2") / 5
