"""launch/pretrain_gpt_r3.py checkpoints: --save/--save-interval/--load resume bit-exactly, load
under another layout, and carry a torchrun restart after a killed rank with no step lost or repeated.

The runs use the distributed optimizer: its state is sharded over the data-parallel ranks, and a
checkpoint holds it per parameter, so it loads under any layout.
"""

import os
import signal
import sys

import pytest
import torch

from tests.support.launcher import run_workers
from tests.support.torchrun import children, descendants, metrics_rows, run_and_act
from tests.test_launch import DUMP_FLAGS, EMBEDDED_FLAGS, LAYOUTS, REPO, train_worker, write_dump

# What decides an iteration's numbers: all of them must come out the same after a resume.
COMPARED = ("loss", "reward/mean", "tokens", "consumed_samples", "mismatch/replay/k3_kl", "mismatch/live/k3_kl",
            "routing/agreement")


def numbers(history):
    return [(h["iteration"], *(h[key] for key in COMPARED)) for h in history]


# gloo on CPUs, and NCCL with one GPU a rank (the GPU suite: two GPUs).
BACKENDS = ["gloo", pytest.param("nccl", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
])]


def assert_same_numbers(history, reference, backend):
    """Bit for bit on CPUs. On GPUs the MoE layers' scatter-adds (unpermutation, the embedding's
    backward) use atomics, whose fp32 sums may come out in another order: within 1e-5 relative."""
    if backend == "gloo":
        assert numbers(history) == numbers(reference)
        return
    for got, want in zip(numbers(history), numbers(reference), strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (got, want)


def embedded(tmp_path, *flags):
    # Staleness 1: the engine's lagging weights are part of what a checkpoint must restore.
    return EMBEDDED_FLAGS + ["--moe-enable-routing-replay", "--rollout-staleness", "1", "--use-distributed-optimizer",
                             *flags]


@pytest.mark.parametrize("backend", BACKENDS)
def test_interrupted_run_resumed_from_its_checkpoint_matches_an_uninterrupted_one(tmp_path, backend):
    whole = run_workers(train_worker, 2, embedded(tmp_path, "--train-iters", "4"), backend=backend)
    ckpt = str(tmp_path / "ckpt")
    first = run_workers(train_worker, 2, embedded(tmp_path, "--train-iters", "2", "--save", ckpt), backend=backend)
    rest = run_workers(train_worker, 2, embedded(tmp_path, "--train-iters", "4", "--load", ckpt), backend=backend)
    assert any("resumed from" in line and "at iteration 2" in line for line in rest[1]["lines"])
    for rank in range(2):
        assert_same_numbers(first[rank]["history"] + rest[rank]["history"], whole[rank]["history"], backend)


# Metrics that depend on the wall clock; every other metric must come out the same after a resume.
TIMED = ("tokens_per_s", "elapsed_s", "eta_s", "time/", "host_syncs/")


def deterministic(history):
    return [{key: value for key, value in h.items() if not key.startswith(TIMED)} for h in history]


def runs_worker(argvs):
    """``train_worker`` for each argv in turn, in this worker (one process group, a fresh parallel state each)."""
    return [train_worker(argv) for argv in argvs]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_dump_run_resumed_at_any_iteration_reads_the_records_an_uninterrupted_one_reads(tmp_path, ranks):
    """Six records, four a global batch: iteration 1 reads records 0-3, 2 reads 4, 5, 0, 1, 3 reads 2-5. A resumed
    run that started the dump again (its read position not restored) would train iteration 2 on records 0-3."""
    dump = write_dump(tmp_path / "rollouts.r3dump")
    ckpt = tmp_path / "ckpt"
    flags = DUMP_FLAGS + ["--rollout-dump", dump, "--moe-enable-routing-replay", "--global-batch-size", "4"]
    whole, interrupted, *resumed = run_workers(runs_worker, ranks, [
        flags + ["--train-iters", "3"],
        flags + ["--train-iters", "2", "--save", str(ckpt), "--save-interval", "1"],
        *[flags + ["--train-iters", "3", "--load", str(ckpt / f"iter_000000{point}")] for point in (1, 2)],
    ], backend="gloo")[-1]
    assert [h["iteration"] for h in whole["history"]] == [1, 2, 3]
    for point, rest in zip((1, 2), resumed):
        assert f" resumed from {ckpt} at iteration {point} ({4 * point} samples consumed)" in rest["lines"]
        assert deterministic(interrupted["history"][:point] + rest["history"]) == deterministic(whole["history"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["tp2-sp", "dp1"])
def test_checkpoint_saved_under_ep2_loads_under_another_layout(tmp_path, layout, backend):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    ckpt = str(tmp_path / "ckpt")

    def argv(layout, iters, *flags):
        return DUMP_FLAGS + ["--rollout-dump", dump, "--moe-enable-routing-replay", "--global-batch-size", "4",
                             "--use-distributed-optimizer", "--train-iters", str(iters), *LAYOUTS.get(layout, []),
                             *flags]

    run_workers(train_worker, 2, argv("ep2", 2, "--save", ckpt), backend=backend)
    same = run_workers(train_worker, 2, argv("ep2", 4, "--load", ckpt), backend=backend)[-1]
    other = run_workers(train_worker, 1 if layout == "dp1" else 2, argv(layout, 4, "--load", ckpt), backend=backend)[-1]
    # Two more iterations on the same global batches from the same weights and optimizer state:
    # the layouts differ only in summation order. Iteration 4 runs on the weights of a step that
    # used the loaded Adam moments and step count.
    for a, b in zip(same["history"], other["history"], strict=True):
        assert a["iteration"] == b["iteration"] and a["consumed_samples"] == b["consumed_samples"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["mismatch/replay/k3_kl"] == pytest.approx(a["mismatch/replay/k3_kl"], rel=1e-3)
    assert [h["iteration"] for h in other["history"]] == [3, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchrun_restart_after_a_killed_rank_continues_from_the_latest_checkpoint(tmp_path, backend):
    iters = 8
    flags = embedded(tmp_path, "--train-iters", str(iters))
    reference = run_workers(train_worker, 2, flags, backend=backend)[1]["history"]

    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "metrics.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the launcher takes the GPUs where it sees them
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "launch/pretrain_gpt_r3.py", *flags, "--save", ckpt, "--load", ckpt, "--load-optional",
               "--save-interval", "1", "--metrics-file", metrics]
    log = tmp_path / "torchrun.log"

    def kill_a_worker(agent):
        workers = children(agent.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        return descendants(workers[0])

    agent = run_and_act(command, REPO, env, log, metrics, 3, kill_a_worker)
    output = log.read_text()
    assert agent.returncode == 0, output[-3000:]
    assert "resumed from" in output  # the restarted workers loaded a checkpoint
    rows = metrics_rows(metrics)
    assert [r["iteration"] for r in rows] == list(range(1, iters + 1))  # none lost, none repeated
    assert_same_numbers(rows, reference, backend)
