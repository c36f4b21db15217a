"""megatron_r3.rl.trainer.metrics and routing_agreement: sums to metrics, exact keys, progress line, JSONL."""

import json
import math
import time

import numpy as np
import pytest
import torch

from megatron_r3.rl.metrics_file import MetricsFile
from megatron_r3.rl.profiling.phase_timer import PhaseTimer
from megatron_r3.rl.trainer.metrics import iteration_metrics, metric_keys, progress_line, zero_sums
from megatron_r3.rl.trainer.routing_agreement import routing_agreement_counts

LAYERS = (2, 4)


def filled_sums(live_measured=True):
    sums = {k: v.numpy() for k, v in zero_sums(len(LAYERS), torch.device("cpu")).items()}
    sums["loss"][:] = [-3.0, 60]
    sums["mismatch/replay"][:] = [60, 0.6, 0.06, 0.03, 0, 0]
    if live_measured:
        sums["mismatch/live"][:] = [60, 6.0, 6.0, 3.0, 6, 3]
    sums["agreement"][:] = [[90, 40], [100, 50]]
    sums["tokens"][:] = 150
    sums["routing/replayed_tokens"][:] = 140
    sums["routing/live_tokens"][:] = 10
    sums["samples"][:] = 10
    sums["reward"][:] = [4.0, 10]
    return sums


def test_metrics_are_sums_divided_and_have_exactly_the_keys():
    metrics = iteration_metrics(filled_sums(), LAYERS, iteration=3, consumed_samples=30, tokens_per_s=12.5,
                                elapsed_s=6.0, eta_s=14.0)
    assert list(metrics) == metric_keys(LAYERS)
    assert metrics["loss"] == -0.05 and metrics["reward/mean"] == 0.4 and metrics["tokens"] == 150
    assert metrics["mismatch/replay/logp_abs_diff"] == pytest.approx(0.01)
    assert metrics["mismatch/live/k3_kl"] == pytest.approx(0.05)
    assert metrics["mismatch/live/frac_abs_gt_ln2"] == pytest.approx(0.1)
    assert metrics["mismatch/live/frac_abs_gt_ln5"] == pytest.approx(0.05)
    assert metrics["routing/agreement"] == pytest.approx(130 / 150)
    assert metrics["routing/agreement/layer_2"] == 0.9 and metrics["routing/agreement/layer_4"] == 0.8
    assert (metrics["routing/replayed_tokens"], metrics["routing/live_tokens"]) == (140, 10)


def test_the_steps_learning_rate_and_gradient_norm_are_reported():
    sums = {**filled_sums(), "lr": np.array([1e-4]), "grad_norm": np.array([2.5])}
    metrics = iteration_metrics(sums, LAYERS, iteration=3, consumed_samples=30, tokens_per_s=12.5, elapsed_s=6.0,
                                eta_s=14.0)
    assert metrics["lr"] == 1e-4 and metrics["grad_norm"] == 2.5
    assert "| reward: 0.4000 | lr: 1.000E-04 | grad norm: 2.500 |" in progress_line(metrics, 40)


def test_unmeasured_values_are_none_and_the_progress_line_leaves_them_out(tmp_path):
    sums = filled_sums(live_measured=False)
    sums["agreement"][:] = 0
    metrics = iteration_metrics(sums, LAYERS, iteration=3, consumed_samples=30, tokens_per_s=12.5,
                                elapsed_s=6.0, eta_s=3725.0)
    assert metrics["mismatch/live/k3_kl"] is None and metrics["routing/agreement"] is None
    assert metrics["lr"] is None and metrics["grad_norm"] is None
    line = progress_line(metrics, 40)
    assert line.startswith(" iteration        3/      40 | consumed samples:         30 | loss: -5.000000E-02")
    assert "k3 replay: 5.000E-04" in line and "k3 live" not in line
    assert "agreement: n/a" in line and "tokens/s: 12.5" in line and line.endswith("ETA: 1:02:05")
    assert "lr:" not in line

    path = tmp_path / "metrics.jsonl"
    out = MetricsFile(str(path))
    out.write(metrics)
    out.write({**metrics, "iteration": 4, "loss": math.nan})
    out.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [3, 4] and rows[1]["loss"] is None and rows[0] == metrics


def test_agreement_counts_engine_routed_pairs_where_the_trainer_chose_the_same_set():
    engine = torch.tensor([[[0, 1], [2, 3], [-1, -1]],      # layer 2: two routed tokens, one without
                           [[1, 0], [3, 2], [0, 1]]])       # layer 4: three routed tokens
    trainer = torch.tensor([[[1, 0], [2, 1], [0, 1]],
                            [[0, 1], [2, 3], [1, 2]]])
    counts = routing_agreement_counts(engine, trainer, [2, 4], (2, 4, 6))
    # Layer 2: {0,1} = {1,0} agrees, {2,3} != {2,1}; layer 4: first two agree as sets, third does not.
    np.testing.assert_array_equal(counts.numpy(), [[1, 2, 0], [2, 3, 0]])


def test_a_chunk_without_moe_layers_counts_nothing():
    empty = torch.empty((0, 3, 2), dtype=torch.int64)
    assert routing_agreement_counts(empty, empty, [], (2,)).sum() == 0


def test_phase_timer_adds_up_phases_and_the_progress_line_shows_them():
    timer = PhaseTimer(torch.device("cpu"), count_host_syncs=True)
    for _ in range(2):
        with timer.phase("pass/update"):
            time.sleep(0.01)
    with timer.phase("rollout"):
        pass
    assert timer.seconds["pass/update"] >= 0.02 and set(timer.seconds) == {"pass/update", "rollout"}
    assert timer.host_syncs == {"pass/update": 0, "rollout": 0}  # nothing waits on a CPU
    sums = zero_sums(1, torch.device("cpu"))
    sums = {name: value.numpy() for name, value in sums.items()}
    metrics = iteration_metrics(sums, (2,), iteration=1, consumed_samples=4, tokens_per_s=1.0, elapsed_s=1.0,
                                eta_s=0.0, seconds=timer.seconds, host_syncs=timer.host_syncs)
    assert metrics["time/pass/update_s"] == timer.seconds["pass/update"] and metrics["time/optimizer_s"] is None
    line = progress_line(metrics, 10, timers=True)
    assert "pass/update 0.0" in line and "(0 syncs)" in line and "optimizer" not in line
    assert "pass/update" not in progress_line(metrics, 10)
    timer.reset()
    assert timer.seconds == {} and timer.host_syncs == {}
