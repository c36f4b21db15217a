"""A HybridModel stack spec that runs without TransformerEngine: attention, MLP and MoE layers.

Megatron's own hybrid specs (``hybrid_layer_specs.py``) are TransformerEngine-only. This
one builds the hybrid stack's layers from Megatron's local modules and megatron_r3's, as
:func:`~megatron_r3.layers.specs.get_gpt_layer_r3_spec` does for GPT layers, so the layer
patterns without Mamba, gated-delta or MLA layers (``*``, ``-``, ``E``, with ``|`` stage
splits and MTP after ``/``) run on CPU process groups and under every parallel layout.
"""

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_r3.layers.hybrid_pattern import LAYER_NAMES, check_hybrid_layer_pattern, first_symbol_outside
from megatron_r3.layers.norm import SequenceParallelNorm
from megatron_r3.layers.specs import get_gpt_layer_r3_spec

LOCAL_HYBRID_LAYERS = (Symbols.ATTENTION, Symbols.MLP, Symbols.MOE)
"""The layer symbols this spec builds."""


def get_hybrid_stack_r3_spec(
    hybrid_layer_pattern: str, num_experts: int, moe_grouped_gemm: bool = False, qk_layernorm: bool = False
) -> ModuleSpec:
    """The ``hybrid_stack_spec`` of a HybridModel whose layers are ``*`` (attention), ``-`` (MLP)
    and ``E`` (MoE).

    The layers are the halves of the GPT layer of
    :func:`~megatron_r3.layers.specs.get_gpt_layer_r3_spec`: attention with its input norm,
    and the MLP or MoE with its pre-MLP norm (Megatron's local MoE module: router, token
    dispatcher, ``SequentialMLP`` or :class:`~megatron_r3.layers.grouped_experts.GroupedGemmExperts`
    experts). Norms, the final norm included, are
    :class:`~megatron_r3.layers.norm.SequenceParallelNorm`; MTP depths get the same norms and a
    local ``eh_proj``.

    Args:
        hybrid_layer_pattern: The model's pattern, checked here
            (:func:`~megatron_r3.layers.hybrid_pattern.check_hybrid_layer_pattern`): another layer
            symbol would otherwise build an ``IdentityOp`` that silently skips the layer.
        num_experts: Routed experts of the MoE layers.
        moe_grouped_gemm: Grouped-GEMM experts.
        qk_layernorm: Normalise queries and keys (per head) before attention.

    Raises:
        ValueError: naming the first symbol this spec cannot build and its position.
    """
    check_hybrid_layer_pattern(hybrid_layer_pattern)
    unsupported = first_symbol_outside(hybrid_layer_pattern, set(LOCAL_HYBRID_LAYERS))
    if unsupported is not None:
        position, symbol = unsupported
        raise ValueError(
            f"hybrid layer pattern {hybrid_layer_pattern!r}: {symbol!r} ({LAYER_NAMES[symbol]}) at position "
            f"{position}: the local hybrid layers are only {list(LOCAL_HYBRID_LAYERS)} (Mamba, gated-delta, "
            "MLA and DSA layers need TransformerEngine's: --transformer-impl transformer_engine)"
        )
    attention = get_gpt_layer_r3_spec(qk_layernorm=qk_layernorm).submodules
    dense = get_gpt_layer_r3_spec().submodules
    moe = get_gpt_layer_r3_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm).submodules
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=attention.input_layernorm,
                    self_attention=attention.self_attention,
                    self_attn_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=dense.pre_mlp_layernorm,
                    mlp=dense.mlp,
                    mlp_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
                ),
            ),
            moe_layer=ModuleSpec(
                module=MoETransformerLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=get_bias_dropout_add
                ),
            ),
            final_norm=SequenceParallelNorm,
            mtp_block_spec=_mtp_block_spec(),
        ),
    )


def _mtp_block_spec() -> ModuleSpec:
    """Norms and projection of each MTP depth; its layers come from the hybrid stack spec."""
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=SequenceParallelNorm,
            hnorm=SequenceParallelNorm,
            eh_proj=ColumnParallelLinear,
            mtp_model_layer=None,
            layer_norm=SequenceParallelNorm,
        ),
    )
    return ModuleSpec(
        module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer])
    )
