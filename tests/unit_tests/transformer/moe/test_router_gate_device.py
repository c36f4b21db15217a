# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""moe router: keep the gate and its buffers on the input's device.

The host-created gate moves to its input's accelerator on first use, as upstream's does;
nothing else is moved silently. On a CPU-only host the "meta" device stands in for an
accelerator (a second device the gate or its input can be on).
"""

import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class TestRouterGateDevice:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _router(self):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=4,
            num_moe_experts=4,
            moe_router_topk=2,
            use_cpu_initialization=True,
            add_bias_linear=True,
        )
        router = TopKRouter(config, pg_collection=moe_utils.get_default_pg_collection())
        router.set_layer_number(1)
        return router

    @pytest.mark.gpu
    def test_a_host_gate_moves_to_its_inputs_accelerator_on_first_use(self):
        router = self._router()
        router.gating(torch.randn(3, 2, 16, device="cuda"))
        assert router.weight.is_cuda and router.bias.is_cuda

    def test_a_gate_held_by_ddp_is_not_moved(self):
        router = self._router()
        router.weight.main_grad = torch.zeros_like(router.weight)  # as DDP's buffers set it
        weight = router.weight.data_ptr()
        with pytest.raises(RuntimeError, match="DistributedDataParallel holds it"):
            router.gating(torch.randn(3, 2, 16, device="meta"))
        assert router.weight.data_ptr() == weight

    def test_a_gate_on_another_device_than_its_input_is_not_moved(self):
        router = self._router().to("meta")
        with pytest.raises(RuntimeError, match="weight is on meta but its input is on cpu"):
            router.gating(torch.randn(3, 2, 16))
        assert router.weight.device.type == "meta"

    def test_a_cpu_run_moves_nothing(self):
        router = self._router()
        weight = router.weight.data_ptr()
        router.gating(torch.randn(3, 2, 16))
        assert router.weight.data_ptr() == weight
