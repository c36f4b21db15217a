# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""jit: torch.compile fused functions on first call, not at import.

Importing Megatron-Core must not import TorchDynamo or TorchInductor (decorating used to look
up the compile backend); a decorated function is compiled once, when first called.
"""

import subprocess
import sys

import torch

from megatron.core import jit


def test_importing_megatron_core_does_not_import_the_compiler():
    # TransformerEngine imports TorchDynamo itself: it is hidden (Megatron imports without it),
    # so that the check is of Megatron's own decorators on a machine with TE too.
    code = ("import sys; sys.modules['transformer_engine'] = None; import megatron.core, megatron.core.models.gpt, megatron.core.transformer.moe.router, "
            "megatron.core.fusions.fused_bias_geglu; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_a_decorated_function_is_compiled_once_on_its_first_call(monkeypatch):
    compiled = []

    def fake_compile(func):
        compiled.append(func)
        return lambda *args, **kwargs: func(*args, **kwargs) + 1  # marks the compiled function's results

    monkeypatch.setattr(torch, "compile", fake_compile)

    def double(x):
        """Doubles."""
        return 2 * x

    fused = jit.compile_on_first_call(double)
    assert compiled == [] and fused.__name__ == "double" and fused.__doc__ == "Doubles."
    assert fused(3) == 7 and fused(x=4) == 9
    assert compiled == [double]



def _expert_bias_updates(fields, flags):
    """How many times one forward of a tiny MoE GPT calls the router's compiled expert-bias update."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter

    from tests.support.launcher import worker_device
    from tests.support.parallel import Layout, init_parallel
    from tests.support.tiny_moe import build_gpt

    calls = []
    original = TopKRouter._apply_expert_bias
    TopKRouter._apply_expert_bias = lambda self, *args, **kwargs: calls.append(self)
    init_parallel(Layout())
    try:
        _, (chunk,) = build_gpt(Layout(), seed=0, flags=flags, **fields)
        device = worker_device()
        tokens = torch.randint(64, (1, 16), device=device)
        chunk(input_ids=tokens, position_ids=torch.arange(16, device=device)[None], attention_mask=None)
        return len(calls)
    finally:
        TopKRouter._apply_expert_bias = original
        parallel_state.destroy_model_parallel()


def test_the_compiled_expert_bias_update_runs_only_with_an_expert_bias():
    from tests.support.launcher import run_workers

    sigmoid = ["--moe-router-score-function", "sigmoid"]
    assert run_workers(_expert_bias_updates, 1, {}, sigmoid) == [0]
    with_bias = {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-3}
    assert run_workers(_expert_bias_updates, 1, with_bias, sigmoid) == [2]  # one per MoE layer of the tiny model
