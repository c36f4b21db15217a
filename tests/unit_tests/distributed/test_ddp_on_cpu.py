# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""distributed: DDP's param and grad buffers on get_current_device.

Without CUDA, DistributedDataParallel keeps its buffers on the CPU and reduces them with gloo:
the gradients it hands on are autograd's, with or without overlapped, bucketed reduction and
the distributed optimizer's reduce-scatter. Two ranks and the whole training stack:
tests/rl/trainer/test_training_stack.py.
"""

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class _TwoLayers(MegatronModule):
    def __init__(self, config):
        super().__init__(config)
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)


class TestDistributedDataParallelOnCPU:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["allreduce", "reduce-scatter"])
    @pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["sync", "overlap"])
    def test_buffers_on_the_cpu_hold_autograds_gradients(self, use_distributed_optimizer, overlap_grad_reduce):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        torch.manual_seed(0)
        module = _TwoLayers(config)
        reference = {name: p.detach().clone().requires_grad_() for name, p in module.named_parameters()}
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
            bucket_size=40,  # one bucket per parameter or two
        )
        model = DistributedDataParallel(config, ddp_config, module)
        assert {buffer.grad_data.device.type for buffer in model.buffers} == {"cpu"}

        x = torch.randn(3, 8)
        model.zero_grad_buffer()
        model(x).square().sum().backward()
        model.finish_grad_sync()

        weight0, bias0, weight1, bias1 = reference.values()
        torch.nn.functional.linear(torch.nn.functional.linear(x, weight0, bias0), weight1, bias1).square().sum().backward()
        for name, param in module.named_parameters():
            torch.testing.assert_close(param.main_grad, reference[name].grad, rtol=0, atol=0, msg=name)
