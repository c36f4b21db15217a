# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""optimizer: Megatron's optimizers on CPU parameters; a non-finite gradient norm skips the update;
the distributed optimizer's checkpoints with torch.optim.

One rank here (a gloo group of one, so the distributed optimizer has a single shard and still
runs its reduce-scatter, all-gather and state gathers); two ranks, other layouts and the
launcher: tests/rl/trainer/test_training_stack.py and tests/rl/checkpoint/test_checkpointing.py.
"""

import math

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

# A fully reshardable checkpoint of the distributed optimizer: per-parameter tensors.
METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


class _TwoLayers(MegatronModule):
    def __init__(self, config):
        super().__init__(config)
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)


def _model_and_optimizer(seed=0, distributed=False, bf16=False, megatron_fsdp_branch=False,
                         **optimizer_config):
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=bf16, params_dtype=dtype)
    torch.manual_seed(seed)
    module = _TwoLayers(config).to(dtype)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config, ddp_config, module)
    # get_megatron_optimizer's Megatron-FSDP branch reads the flag and the chunk's buffers: set
    # after the wrap, it builds this chunk's optimizer the way it builds Megatron-FSDP's.
    ddp_config.use_megatron_fsdp = megatron_fsdp_branch
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16, params_dtype=dtype,
                        use_distributed_optimizer=distributed, **optimizer_config),
        [model],
        use_gloo_process_groups=False,
    )
    return model, optimizer


def _step(model, optimizer, x, poison=False):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(x.to(next(model.parameters()).dtype)).float().square().sum().backward()
    model.finish_grad_sync()
    if poison:
        next(model.parameters()).main_grad[0, 0] = float("nan")
    return optimizer.step()


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


class TestMegatronOptimizerOnCPU:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
    @pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
    def test_steps_like_torch_adamw_on_fp32_main_weights(self, distributed, bf16):
        model, optimizer = _model_and_optimizer(distributed=distributed, bf16=bf16, clip_grad=0.0)
        main = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
        adam = torch.optim.AdamW(main, lr=1e-2, weight_decay=0.01)
        x = torch.randn(3, 8)
        for _ in range(2):
            stepped, grad_norm, _ = _step(model, optimizer, x)
            assert stepped and grad_norm > 0
            for param, copy in zip(model.parameters(), main):
                copy.grad = param.main_grad.clone()
            adam.step()
        for param, copy in zip(model.parameters(), main):
            torch.testing.assert_close(param.float(), copy.detach().to(param.dtype).float(), rtol=0, atol=0)

    @pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
    def test_a_gradient_norm_that_is_not_finite_skips_the_update(self, distributed):
        model, optimizer = _model_and_optimizer(distributed=distributed, skip_non_finite_grad_norm=True)
        x = torch.randn(3, 8)
        _step(model, optimizer, x)
        weights, state = _weights(model), optimizer.state_dict()
        stepped, grad_norm, _ = _step(model, optimizer, x, poison=True)
        assert not stepped and math.isnan(grad_norm)
        assert all(torch.equal(a, b) for a, b in zip(weights, _weights(model)))
        assert repr(optimizer.state_dict()) == repr(state)  # the step count and the moments too
        stepped, _, _ = _step(model, optimizer, x)
        assert stepped and not any(torch.equal(a, b) for a, b in zip(weights, _weights(model)))

    def test_the_megatron_fsdp_branch_of_one_chunk_skips_too(self):
        """With one model chunk the Megatron-FSDP branch returned the chunk's optimizer bare,
        whose step() applied a NaN update whatever skip_non_finite_grad_norm said. (Its
        distributed optimizer needs Megatron-FSDP's own buffers: the plain one stands for it.)"""
        model, optimizer = _model_and_optimizer(megatron_fsdp_branch=True, skip_non_finite_grad_norm=True)
        x = torch.randn(3, 8)
        _step(model, optimizer, x)
        weights = _weights(model)
        stepped, grad_norm, _ = _step(model, optimizer, x, poison=True)
        assert not stepped and math.isnan(grad_norm)
        assert all(torch.equal(a, b) for a, b in zip(weights, _weights(model)))
        # Without the option the branch still returns the optimizer itself, as upstream does.
        _, plain = _model_and_optimizer(megatron_fsdp_branch=True)
        assert not isinstance(plain, ChainedOptimizer)

    def test_without_the_option_the_update_is_applied(self):
        model, optimizer = _model_and_optimizer()
        stepped, grad_norm, _ = _step(model, optimizer, torch.randn(3, 8), poison=True)
        assert stepped and math.isnan(grad_norm) and next(model.parameters()).isnan().any()


class TestDistributedOptimizerCheckpointWithTorchOptim:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_a_fresh_optimizer_loads_a_checkpoint_and_steps_on_from_it(self, tmp_path):
        x = torch.randn(3, 8)
        model, optimizer = _model_and_optimizer(distributed=True)
        for _ in range(2):
            _step(model, optimizer, x)
        state = {"model": model.module.sharded_state_dict()}
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=METADATA)
        dist_checkpointing.save(state, str(tmp_path))
        _step(model, optimizer, x)
        expected = _weights(model)

        fresh_model, fresh = _model_and_optimizer(seed=1, distributed=True)
        request = {"model": fresh_model.module.sharded_state_dict()}
        # Before its first step the torch optimizer has no state: it is at step 0.
        request["optimizer"] = fresh.sharded_state_dict(request["model"], is_loading=True, metadata=METADATA)
        loaded = dist_checkpointing.load(request, str(tmp_path))
        fresh_model.module.load_state_dict(loaded["model"])
        fresh.load_state_dict(loaded["optimizer"])
        steps = [s["step"] for inner in fresh.chained_optimizers for s in inner.optimizer.state.values()]
        assert [float(step) for step in steps] == [2.0] * len(steps)
        assert len({id(step) for step in steps}) == len(steps)  # each parameter counts its own steps
        _step(fresh_model, fresh, x)
        assert all(torch.equal(a, b) for a, b in zip(expected, _weights(fresh_model)))
