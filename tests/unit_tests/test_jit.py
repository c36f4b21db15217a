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
    code = ("import sys, megatron.core, megatron.core.models.gpt, megatron.core.transformer.moe.router, "
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
