"""GPT layer and decoder-block specs that run every parallel layout without TransformerEngine."""

from functools import partial
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_r3.layers.core_attention import ContextParallelDotProductAttention
from megatron_r3.layers.grouped_experts import GroupedGemmExperts
from megatron_r3.layers.moe_layers import chunk_layers, moe_layer_pattern
from megatron_r3.layers.norm import SequenceParallelNorm


class _LocalGroupedGemmSpecProvider(LocalSpecProvider):
    """Megatron's local modules; with ``moe_grouped_gemm`` the experts are :class:`GroupedGemmExperts`
    (Megatron's local provider gives ``SequentialMLP`` either way: its grouped experts need
    TransformerEngine)."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        sequential = super().grouped_mlp_modules(moe_use_grouped_gemm)  # SequentialMLP with its submodules
        if not moe_use_grouped_gemm:
            return sequential
        return partial(GroupedGemmExperts, *sequential.args, **sequential.keywords)


def grouped_gemm_experts_spec():
    """The builder of :class:`~megatron_r3.layers.grouped_experts.GroupedGemmExperts` (Megatron's local
    expert linears), for any MoE layer spec."""
    return _LocalGroupedGemmSpecProvider().grouped_mlp_modules(True)


def get_gpt_layer_r3_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
) -> ModuleSpec:
    """A GPT transformer-layer spec built from Megatron-Core modules and megatron_r3's.

    The same layer as Megatron's ``get_gpt_layer_local_spec``, with two modules
    swapped so that tensor parallelism with sequence parallelism, context
    parallelism (BSHD zigzag) and packed THD sequences run without
    TransformerEngine, on CPU process groups included:

    * norms: :class:`~megatron_r3.layers.norm.SequenceParallelNorm` (LayerNorm or RMSNorm
      per ``config.normalization``), whose parameters are marked for the TP
      all-reduce of sequence-parallel gradients;
    * core attention:
      :class:`~megatron_r3.layers.core_attention.ContextParallelDotProductAttention`.

    Args:
        num_experts: ``None`` for a dense MLP layer; the number of experts for a MoE
            layer (Megatron's local MoE module: router, token dispatcher per
            ``config.moe_token_dispatcher_type``, ``SequentialMLP`` experts).
        moe_grouped_gemm: The same experts run as grouped GEMMs
            (:class:`~megatron_r3.layers.grouped_experts.GroupedGemmExperts`).
        qk_layernorm: Normalise queries and keys (per head) before attention.

    Returns:
        A ``ModuleSpec`` of ``TransformerLayer``, usable as ``transformer_layer_spec``
        of ``GPTModel`` (every layer the same) or as an entry of a block spec.
    """
    if num_experts is None:
        mlp = ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    else:
        mlp = get_moe_module_spec_for_backend(
            backend=_LocalGroupedGemmSpecProvider(),
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
        )
    qk_norm = SequenceParallelNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ContextParallelDotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=SequenceParallelNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # Checkpoints stay interchangeable with TE specs, as in get_gpt_layer_local_spec.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def get_gpt_decoder_block_r3_spec(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> TransformerBlockSubmodules:
    """The decoder-block spec of one pipeline stage: dense and MoE layers from the config.

    Follows ``get_gpt_decoder_block_spec``: the layer pattern comes from
    ``config.moe_layer_freq`` and the stage keeps the layers that
    ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` assign to it
    (uneven first/last stages and virtual pipeline stages included), through
    :func:`~megatron_r3.layers.moe_layers.chunk_layers`, the function the routing
    plans ask which layers a chunk builds. The final
    norm is a :class:`~megatron_r3.layers.norm.SequenceParallelNorm`.

    Args:
        config: Transformer config of the model.
        vp_stage: Virtual pipeline stage of the model chunk being built.
        pp_rank: Pipeline rank; defaults to this process's.

    Returns:
        ``TransformerBlockSubmodules`` to pass as ``transformer_layer_spec`` of ``GPTModel``.
    """
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError("pipeline_model_parallel_layout is not supported by this spec")
    dense = get_gpt_layer_r3_spec(qk_layernorm=config.qk_layernorm)
    moe = get_gpt_layer_r3_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
    )
    if config.num_moe_experts is None:
        pattern = [False] * config.num_layers
    else:
        pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    layer_specs = [moe if is_moe else dense for is_moe in pattern]
    built = chunk_layers(config, pp_rank=pp_rank, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=layer_specs[built.start - 1 : built.stop - 1], layer_norm=SequenceParallelNorm
    )
