"""get_gpt_layer_r3_spec and the MoE layer pattern of the decoder-block spec."""

import pytest
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.core_attention import ContextParallelDotProductAttention
from megatron_r3.layers.norm import SequenceParallelNorm
from megatron_r3.layers.specs import get_gpt_decoder_block_r3_spec, get_gpt_layer_r3_spec


def _config(**fields):
    return TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, **fields)


def test_dense_and_moe_layer_specs():
    dense = get_gpt_layer_r3_spec()
    moe = get_gpt_layer_r3_spec(num_experts=4)
    for spec in (dense, moe):
        assert spec.submodules.input_layernorm is SequenceParallelNorm
        assert spec.submodules.pre_mlp_layernorm is SequenceParallelNorm
        attention = spec.submodules.self_attention.submodules
        assert attention.core_attention is ContextParallelDotProductAttention
    assert dense.submodules.mlp.module is MLP
    assert moe.submodules.mlp.func is MoELayer  # 0.19 builds MoE layers from a partial
    qk = get_gpt_layer_r3_spec(qk_layernorm=True).submodules.self_attention.submodules
    assert qk.q_layernorm is SequenceParallelNorm and qk.k_layernorm is SequenceParallelNorm


def _mlp_kinds(config):
    """Each layer's MLP in the block spec, "moe" (a partial of MoELayer) or "dense"."""
    block = get_gpt_decoder_block_r3_spec(config, pp_rank=0)
    mlps = [layer.submodules.mlp for layer in block.layer_specs]
    return ["moe" if getattr(mlp, "func", None) is MoELayer else "dense" for mlp in mlps]


def test_decoder_block_follows_the_moe_layer_pattern():
    assert _mlp_kinds(_config()) == ["dense"] * 4
    assert _mlp_kinds(_config(num_moe_experts=4, moe_layer_freq=2)) == ["moe", "dense", "moe", "dense"]
    pattern = [0, 1, 1, 0]
    assert _mlp_kinds(_config(num_moe_experts=4, moe_layer_freq=pattern)) == ["dense", "moe", "moe", "dense"]


def test_decoder_block_rejects_a_bad_moe_layer_list():
    config = _config(num_moe_experts=4, moe_layer_freq=[0, 1, 2, 0])
    with pytest.raises(ValueError, match="moe_layer_freq"):
        get_gpt_decoder_block_r3_spec(config, pp_rank=0)
