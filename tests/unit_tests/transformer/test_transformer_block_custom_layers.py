# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""transformer, gpt: custom layer and MoE classes written against upstream's signatures.

The decoder block hands ``moe_routing`` on only when a microbatch has routes: a layer class
or a MoE MLP that does not know the argument keeps working in every other forward.
"""

import copy
import functools

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.test_utilities import Utils


class UpstreamSignatureLayer(TransformerLayer):
    """A custom layer with upstream's forward keywords (no moe_routing): a stand-in."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        context=None,
        context_mask=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        padding_mask=None,
    ):
        return hidden_states * 2, context


class UpstreamSignatureMoE(MoELayer):
    """A MoE MLP with upstream MoELayer.forward's keywords (no moe_routing): a stand-in."""

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        return hidden_states + 1, None


RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
}


class TestTransformerBlockWithCustomLayers:

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _block(self, spec, **config):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **config,
        )
        # A layer spec alone gets TE's final norm wherever TE is installed, a CUDA-only kernel; the
        # block's final norm is the local spec's, as its layers' norms.
        block_spec = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers,
                                                layer_norm=spec.submodules.input_layernorm)
        return TransformerBlock(config, block_spec)

    @pytest.mark.parametrize("recompute", ["none", "full"])
    def test_a_layer_class_without_moe_routing(self, recompute):
        spec = copy.deepcopy(get_gpt_layer_local_spec())
        spec.module = UpstreamSignatureLayer
        block = self._block(spec, **RECOMPUTE[recompute])
        hidden = torch.randn(8, 2, 32, requires_grad=True)
        out = block(hidden, attention_mask=None)
        assert torch.allclose(out, block.final_layernorm(hidden * 4))

    @pytest.mark.parametrize("recompute", ["none", "selective_mlp"])
    def test_a_moe_class_without_moe_routing(self, recompute):
        spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False))
        moe = spec.submodules.mlp
        assert moe.func is MoELayer
        spec.submodules.mlp = functools.partial(UpstreamSignatureMoE, *moe.args, **moe.keywords)
        block = self._block(
            spec,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            add_bias_linear=False,
            **RECOMPUTE[recompute],
        )
        assert all(isinstance(layer.mlp, UpstreamSignatureMoE) for layer in block.layers)
        hidden = torch.randn(8, 2, 32, requires_grad=True)
        block(hidden, attention_mask=None).sum().backward()
        assert hidden.grad is not None
