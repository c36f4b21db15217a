"""A tiny MoE GPT (dense and MoE layers) built for any layout from one seed."""

import dataclasses
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.specs import get_gpt_decoder_block_r3_spec
from tests.support.parallel import Layout
from tests.support.weights import init_from_seed


@dataclasses.dataclass(frozen=True)
class TinyMoE:
    """Model hyper-parameters; every layout of one test uses the same values.

    The defaults give 4 layers, dense-MoE-dense-MoE, 4 experts, top-2, grouped-query
    attention (4 heads, 2 groups), RoPE, fp32, no dropout, no load-balancing loss.
    Linear layers have no biases by default, as in most MoE models; with
    ``add_bias_linear`` (Megatron supports MoE biases only with expert-TP 1) they do.
    """

    num_layers: int = 4
    moe_layer_freq: tuple = (0, 1, 0, 1)
    hidden_size: int = 32
    ffn_hidden_size: int = 64
    moe_ffn_hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    num_experts: int = 4
    topk: int = 2
    vocab_size: int = 64
    max_sequence_length: int = 64
    normalization: str = "LayerNorm"
    add_bias_linear: bool = False
    router_logit_std: float = 2.0

    @property
    def moe_layers(self) -> list[int]:
        """0-based indices of the MoE layers."""
        return [i for i, is_moe in enumerate(self.moe_layer_freq) if is_moe]


def make_config(layout: Layout, model: TinyMoE = TinyMoE(), **overrides) -> TransformerConfig:
    """The ``TransformerConfig`` of ``model`` under ``layout``.

    Args:
        layout: The parallel layout.
        model: The model hyper-parameters.
        **overrides: Extra ``TransformerConfig`` fields (router score function,
            routing replay options, ...); they win over the defaults here.
    """
    recompute = {}
    if layout.recompute == "full":
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    elif layout.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        normalization=model.normalization,
        add_bias_linear=model.add_bias_linear,
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.topk,
        moe_layer_freq=list(model.moe_layer_freq),
        moe_token_dispatcher_type=layout.dispatcher,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.sp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        # Megatron marks TP-split weights (partition_dim) while initialising them;
        # build_gpt then overwrites the values from the seed.
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Sum of per-token losses, no averaging: gradients add up across ranks and
        # microbatches exactly like the single-rank reference's.
        calculate_per_token_loss=True,
        # Batched p2p posts both directions to the same peer in one batch; with PP=2
        # the peer is the same rank both ways and gloo pairs the messages by order,
        # swapping activations and gradients. Separate isend/irecv use one group
        # per direction (Megatron's _p2p_ops).
        batch_p2p_comm=False,
        **recompute,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt(
    config: TransformerConfig,
    model: TinyMoE = TinyMoE(),
    seed: int = 0,
    device: Optional[torch.device] = None,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), weights from ``seed``.

    Every parameter is the slice this rank owns of a full tensor generated from
    ``seed`` and the parameter's single-rank name (see ``weights.init_from_seed``),
    so any layout and the single-rank reference hold the same full weights.

    Args:
        config: From :func:`make_config`; the parallel state must be initialised.
        model: The hyper-parameters ``config`` was made from.
        seed: Weight seed.
        device: Where the chunks live; defaults to the CPU.
    """
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp) if vp else [None]:
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_decoder_block_r3_spec(config, vp_stage=vp_stage),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        )
        chunks.append(chunk)
    init_from_seed(chunks, seed, router_logit_std=model.router_logit_std)
    return [chunk.to(device or torch.device("cpu")) for chunk in chunks]
