"""The example's warm start on a GPU: launch/countdown_sft_r3.sh trains the example's model on the
countdown corpus with Megatron-LM's pretrain_gpt.py, and train_rl.py starts from those weights
(INIT=...) and replays its engine's routes.

Needs what tests/megatron_lm/test_train_rl_gpu.py needs (a checkout with both series at $MEGATRON,
`make megatron-rl-deps`). A few minutes on one H200.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from bench.megatron_rl import replay_metrics

ROOT = Path(__file__).resolve().parents[2]
LM_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([\d.E+-]+)")


@pytest.mark.gpu
def test_train_rl_starts_from_the_warm_start_and_replays(tmp_path):
    megatron = Path(os.environ.get("MEGATRON", ROOT / "build" / "megatron-lm"))
    if not (megatron / "megatron" / "rl" / "routing_replay.py").is_file():
        pytest.skip(f"no Megatron-LM checkout with both series at {megatron}: make megatron-lm-checkout")
    env = dict(os.environ, MEGATRON=str(megatron), NPROC="1", SEQ_LEN="384")
    sft = subprocess.run(["bash", str(ROOT / "launch" / "countdown_sft_r3.sh"), str(tmp_path / "sft")],
                         env=dict(env, SFT_ITERS="60", SFT_DOCUMENTS="4000"), capture_output=True, text=True,
                         timeout=500)
    log = sft.stdout + sft.stderr
    assert sft.returncode == 0, log[-8000:]
    losses = {int(it): float(loss) for it, loss in LM_LOSS.findall(log)}
    # Megatron logs the first iteration and every --log-interval (10) after it.
    assert sorted(losses) == [1, 10, 20, 30, 40, 50, 60], losses
    assert losses[60] < 0.5 * losses[1], losses
    assert (tmp_path / "sft" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "60"

    rl = subprocess.run(["bash", str(ROOT / "launch" / "train_rl_r3.sh"), str(tmp_path / "rl")],
                        env=dict(env, ITERS="1", INIT=str(tmp_path / "sft" / "checkpoints")),
                        capture_output=True, text=True, timeout=500)
    log = rl.stdout + rl.stderr
    assert rl.returncode == 0, log[-8000:]
    assert "attempting to finetune with checkpoint in" in log, log[-8000:]  # Megatron's --pretrained-checkpoint
    (row,) = replay_metrics(log)
    assert row["routes_used_differ"] == 0 and row["rows_without_routes"] == 0, row
