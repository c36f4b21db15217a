"""Megatron-LM's train_rl.py with routing replay, a few iterations on a GPU (launch/train_rl_r3.sh).

Needs a Megatron-LM main checkout with both series at $MEGATRON (default build/megatron-lm,
made by `make megatron-lm-checkout`) and train_rl.py's dependencies (`make megatron-rl-deps`).
Every rollout collection's replayed old-log-prob pass records the routes it took and compares
them, token by token and layer by layer, with the routes the engine recorded (as placed in the
packed bin): none may differ. The trainer's own router must agree with the engine's routes far
more often than with the same routes moved one token (the alignment), and replay must lower k3.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from bench.megatron_rl import replay_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_train_rl_replays_the_routes_its_engine_recorded(tmp_path, nproc, graphs):
    """graphs: the engine decodes under its CUDA graphs (GRAPHS=1), recording the routes into static
    buffers; its step lines (--inference-logging-step-interval 1) must show graphed decode steps."""
    import torch

    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    megatron = Path(os.environ.get("MEGATRON", ROOT / "build" / "megatron-lm"))
    if not (megatron / "megatron" / "rl" / "routing_replay.py").is_file():
        pytest.skip(f"no Megatron-LM checkout with both series at {megatron}: make megatron-lm-checkout")
    env = dict(os.environ, MEGATRON=str(megatron), NPROC=str(nproc), ITERS="3", REPLAY="1", METRICS="1",
               GRAPHS=str(int(graphs)), EXTRA_ARGS="--inference-logging-step-interval 1")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "train_rl_r3.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    graphed_steps = len(re.findall(r"\+ cuda graph (?!OFF)", log))
    assert (graphed_steps > 0) == graphs, f"{graphed_steps} engine steps under CUDA graphs"
    rows = replay_metrics(log)
    assert len(rows) == 3, log[-8000:]
    for row in rows:
        assert row["routes_used_differ"] == 0, row
        assert row["rows_without_routes"] == 0 and row["routed_fraction"] > 0.99, row
        assert row["agreement"] > 2 * row["agreement_moved_one_token"], row
        assert row["k3_replay"] < row["k3_live"], row
