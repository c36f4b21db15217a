"""optimizer: where TransformerEngine or Apex is installed, CPU parameters and gradients still
take torch's optimizers and the local multi-tensor ops (patch cpu/0020).

TE's fused Adam/SGD and multi-tensor kernels take CUDA tensors only: on CPU tensors they raise
("No CUDA GPUs are available") or read host pointers on the device (an illegal memory access, a
norm of 0). This machine has no TE, so the tests put stand-ins in their place that fail the same
way whenever they are handed a CPU tensor; a gloo rank on a GPU node with TE met the real ones.
"""

import pytest
import torch

import megatron.core.optimizer as megatron_optimizer
from megatron.core.optimizer import clip_grads, distrib_optimizer
from megatron.core.optimizer import optimizer as optimizer_module
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.optimizer import test_optimizer_on_cpu as on_cpu
from tests.unit_tests.optimizer.test_optimizer_on_cpu import _model_and_optimizer, _step, _TwoLayers
from tests.unit_tests.test_utilities import Utils


def _cuda_only(*args, **kwargs):
    raise AssertionError("a CUDA-only kernel was handed CPU tensors")


class _CudaOnlyOptimizer:
    def __init__(self, params, **kwargs):
        raise AssertionError("a fused CUDA optimizer was built for CPU parameters")


@pytest.fixture
def cuda_only_kernels(monkeypatch):
    """Megatron's optimizer modules as they are where TE is installed, with failing kernels."""
    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(megatron_optimizer, "Adam", _CudaOnlyOptimizer)
    monkeypatch.setattr(megatron_optimizer, "SGD", _CudaOnlyOptimizer)
    for name in ("multi_tensor_applier", "l2_norm_impl", "multi_tensor_scale_impl",
                 "multi_tensor_scale_tensor_impl"):
        monkeypatch.setattr(clip_grads, name, _cuda_only)
    monkeypatch.setattr(optimizer_module, "multi_tensor_applier", _cuda_only)
    # The distributed optimizer's view: TE's FusedAdam, which keeps one "step" per param group.
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    monkeypatch.setattr(distrib_optimizer, "Adam", _CudaOnlyOptimizer)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_cpu_gradients_are_clipped(cuda_only_kernels, as_tensor):
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    total_norm = torch.tensor(13.0) if as_tensor else 13.0
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total_norm)
    scale = 1.0 / (13.0 + 1e-6)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]) * scale)
    torch.testing.assert_close(params[1].grad, torch.tensor([12.0]) * scale)


class TestOptimizersAndNormsOfCpuTensors:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_the_gradient_norm_of_cpu_gradients_is_the_norm(self, cuda_only_kernels):
        norm = get_grad_norm_fp32([torch.tensor([3.0, 4.0]), torch.tensor([12.0])])
        assert norm == pytest.approx(13.0)

    @pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
    def test_adam_is_torchs_and_steps_with_clipping(self, cuda_only_kernels, bf16):
        model, optimizer = _model_and_optimizer(bf16=bf16, clip_grad=1e-3)
        assert type(optimizer.optimizer) is torch.optim.AdamW
        before = [p.detach().clone() for p in model.parameters()]
        update_successful, grad_norm, _ = _step(model, optimizer, torch.randn(3, 8))
        assert update_successful and grad_norm > 0
        assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    def test_sgd_is_torchs(self, cuda_only_kernels):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), _TwoLayers(config))
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1e-2), [model])
        assert type(optimizer.optimizer) is torch.optim.SGD


def test_the_float16_optimizers_copy_of_cpu_tensors(cuda_only_kernels):
    this, that = [torch.arange(3.0), torch.ones(2)], [torch.zeros(3), torch.zeros(2)]
    optimizer_module._multi_tensor_copy_this_to_that(this, that, torch.zeros(1, dtype=torch.int))
    assert all(torch.equal(a, b) for a, b in zip(this, that))


@pytest.mark.usefixtures("cuda_only_kernels")
class TestDistributedOptimizerCheckpointOfTorchsAdamWhereTeIsInstalled(
        on_cpu.TestDistributedOptimizerCheckpointWithTorchOptim):
    """The distributed optimizer saves and loads torch's per-parameter "step" of the torch AdamW it
    runs for CPU parameters, not TE's per-group one (on 2 x H200 with TE: KeyError 'step')."""
