"""The Megatron-LM series' FP32 log-probs (patch 0003): the training step's selective_log_softmax of
bf16 logits is their FP32 log_softmax, as the engine's. ``megatron.rl.rl_utils`` imports only on
Python >= 3.12 (docs/megatron_rl.md, "Dependencies"), so the function is read from the checkout's
file and run alone; its upstream test (tests/unit_tests/rl/test_logprob_precision.py, in the patch)
runs with Megatron-LM's RL tests on a node with Python 3.12. Needs a checkout (MEGATRON_GIT)."""

import ast

import pytest
import torch

from tests.megatron_lm.test_train_rl_example import checkout  # noqa: F401


def function_from(path, name, **namespace):
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_training_log_probs_of_bf16_logits_are_their_fp32_log_softmax(checkout, batch_invariant):
    selective_log_softmax = function_from(checkout / "megatron" / "rl" / "rl_utils.py", "selective_log_softmax",
                                          torch=torch, is_batch_invariant_mode_enabled=lambda: batch_invariant)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 17, 102, generator=gen)).bfloat16()
    labels = torch.randint(0, 102, (3, 17), generator=gen)
    got = selective_log_softmax(logits, labels)
    want = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # The bf16 log_softmax the step took before: rounded to steps of up to 2**-4 here.
    rounded = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    assert (rounded - want).abs().max() > 1e-3
