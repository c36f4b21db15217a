# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""tensor_parallel: do not mark expert row-parallel biases sequence-parallel.

Under SP, finalize_model_grads all-reduces over TP every gradient marked
``sequence_parallel``. A dense row-parallel bias needs that (each TP rank saw a slice of
the sequence); an expert's bias must not get it, since with EP across the TP ranks
``local_experts.0`` on two TP ranks are two different experts. The end-to-end check (the
gradients of every expert bias equal a single-rank run's under TP2+SP+EP2) is
tests/test_layouts.py::test_layout_with_biases_matches_single_rank.
"""

import torch

from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class TestRowParallelBiasSequenceParallel:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @staticmethod
    def _linear(is_expert):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            use_cpu_initialization=True,
            num_moe_experts=2 if is_expert else None,
        )
        config.sequence_parallel = True  # the attribute under test; TP 1 keeps the test local
        return RowParallelLinear(
            16,
            16,
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
        )

    def test_dense_bias_is_reduced_over_tp_under_sp(self):
        assert self._linear(is_expert=False).bias.sequence_parallel

    def test_expert_bias_is_not(self):
        assert not self._linear(is_expert=True).bias.sequence_parallel
