"""moe: where TransformerEngine is installed, a router on CPU tensors still computes its logits
and their gradients with torch (patch cpu/0020).

TE's GEMM takes CUDA tensors only ("CUDAGuardImpl initialized with non-CUDA DeviceType: cpu").
This machine has no TE, so a stand-in that fails on any call takes its place.
"""

import pytest
import torch

from megatron.core.transformer.moe import moe_utils


def _te_gemm(*args, **kwargs):
    raise AssertionError("TE's GEMM was handed CPU tensors")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("router_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_router_logits_and_gradients_are_torchs(monkeypatch, bias, router_dtype):
    monkeypatch.setattr(moe_utils, "te_general_gemm", _te_gemm)
    torch.manual_seed(0)
    inp = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(8, 16, requires_grad=True)
    bias_ = torch.randn(8, requires_grad=True) if bias else None
    logits = moe_utils.router_gating_linear(inp, weight, bias_, router_dtype)
    logits.square().sum().backward()

    params = [inp, weight] + ([bias_] if bias else [])
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    inp_, weight_ = inp.to(router_dtype).view(-1, 16), weight.to(router_dtype).t()
    expected = torch.addmm(bias_.to(router_dtype), inp_, weight_) if bias else inp_ @ weight_
    expected = expected.view(2, 5, 8)
    expected.square().sum().backward()

    assert logits.dtype == router_dtype
    torch.testing.assert_close(logits, expected)
    for got, param in zip(grads, params):
        torch.testing.assert_close(got, param.grad)
