# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""optimizer: run on CPU parameters, and only where the run computes on the CPU.

Parameters are told apart by dtype; a parameter that is not on the device the process
computes on (a CPU parameter in a GPU run) is refused. On a CPU-only host the run's device
is made "meta" to stand in for an accelerator.
"""

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from tests.unit_tests.test_utilities import Utils


def _float16_optimizer(params):
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16)
    return Float16OptimizerWithFloat16Params(
        torch.optim.Adam(params, lr=1e-3), config, grad_scaler=None, init_state_fn=None
    )


class TestOptimizerParamDevice:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_cpu_parameters_in_a_cpu_run(self):
        param = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
        optimizer = _float16_optimizer([param])
        assert optimizer.float16_groups == [[param]]

    def test_cpu_parameters_in_an_accelerator_run_are_refused(self, monkeypatch):
        monkeypatch.setattr(megatron_optimizer, "get_current_device", lambda: torch.device("meta"))
        param = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
        with pytest.raises(TypeError, match="must be on the device this process computes on"):
            _float16_optimizer([param])
