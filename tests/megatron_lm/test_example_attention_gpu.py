"""The train_rl example's training attention is causal attention (GPU, TransformerEngine).

The example names its backend with --attention-backend in launch/train_rl_common.sh's model flags; this runs TE's
attention under that choice on packed sequences (tests/support/te_attention_check.py) and compares
it with a causal reference. With `flash`, TE 2.20.2 and FlashAttention-4 4.0.0b36 the trainer's and
the engine's log-probs looked unrelated on 1 x H200 (docs/megatron_rl.md).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_the_examples_training_attention_is_causal():
    pytest.importorskip("transformer_engine.pytorch")
    model_flags = (ROOT / "launch" / "train_rl_common.sh").read_text()
    backend = re.search(r"^\s*--bf16 .*--attention-backend (\w+)", model_flags, re.M).group(1)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "te_attention_check.py"), backend],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
