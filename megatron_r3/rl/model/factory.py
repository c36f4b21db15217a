"""The policy's (and the rollout engine's) TransformerConfig and model chunks, from the flags.

The one place a model is made from settings: the launcher, the benchmarks and the tests
(``tests/support/tiny_moe.py``, through the same flags) build theirs here, so all of them
run the same layers under the same settings: TransformerEngine's through Megatron's TE specs,
or the local ones (:mod:`megatron_r3.layers.transformer_impl`, ``--transformer-impl``). The
model is a GPTModel, or with ``--hybrid-layer-pattern`` a HybridModel of that pattern.
"""

from __future__ import annotations

import argparse
from typing import Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.transformer_impl import (
    TE_ONLY_FLAGS,
    decoder_block_spec,
    hybrid_stack_spec,
    resolve_grouped_gemm_impl,
    resolve_transformer_impl,
)
from megatron_r3.rl.arguments import layer_freq, virtual_pipeline_stages
from megatron_r3.routing_replay import routing_replay_check_kwargs


def routers_take_moe_routing(args: argparse.Namespace) -> bool:
    """Whether the policy's routers take a per-microbatch ``MoERouting`` (``moe_enable_routing_replay``).

    ``--moe-enable-routing-replay`` trains on replayed routes, so its update passes (and R2's
    old-log-prob pass) need them. ``--r3-compare`` needs them too, for its extra pass in the
    other routing mode: training live, that pass replays the rollout's routes; training with
    replay, it records the routes the routers choose. Routers built so route live in a pass
    that gives them no routes, so a live update pass is unchanged by it.
    """
    return args.moe_enable_routing_replay or args.r3_compare


def transformer_config(args: argparse.Namespace, device: torch.device, *, rollout_engine: bool = False,
                       **fields) -> TransformerConfig:
    """The model's ``TransformerConfig`` from the flags.

    Args:
        args: The flags (:func:`megatron_r3.rl.arguments.parse_args`).
        device: Where the model computes.
        rollout_engine: The rollout engine's config: bf16 and grouped-GEMM experts, as an inference
            engine runs, and routers that take a ``MoERouting`` whatever the training flags say (the
            engine records its routes).
        **fields: ``TransformerConfig`` fields no flag sets (router variants the launcher does not
            offer, ``recompute_modules``, ...); they replace the fixed choices here (no
            load-balancing loss, no dropout, no fusions). A field a flag sets is refused: pass the flag.

    Raises:
        ValueError: ``fields`` names a field a flag sets, or the layers asked for cannot run here
            (:func:`~megatron_r3.layers.transformer_impl.resolve_transformer_impl`).
    """
    transformer_impl = resolve_transformer_impl(
        args.transformer_impl, device, {name: getattr(args, name) for name in TE_ONLY_FLAGS})
    resolve_grouped_gemm_impl(args.moe_grouped_gemm_impl, transformer_impl)  # refused here, before building
    te_fields = {}
    if transformer_impl == "transformer_engine":
        te_fields = dict(cp_comm_type=args.cp_comm_type, moe_permute_fusion=args.moe_permute_fusion,
                         moe_router_fusion=args.moe_router_fusion)
    bf16 = rollout_engine or (args.bf16 if args.bf16 is not None else transformer_impl == "transformer_engine")
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute = {}
    if args.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective")
    from_flags = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        normalization=args.normalization,
        init_method_std=args.init_method_std,
        add_bias_linear=args.add_bias_linear,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_layer_freq=layer_freq(args),
        is_hybrid_model=args.hybrid_layer_pattern is not None,
        moe_router_score_function=args.moe_router_score_function,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm or rollout_engine,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_stages(args),
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        moe_enable_routing_replay=rollout_engine or routers_take_moe_routing(args),
        **routing_replay_check_kwargs(args),
        **recompute,
        transformer_impl=transformer_impl,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        **te_fields,
    )
    flagged = sorted(fields.keys() & from_flags.keys())
    if flagged:
        raise ValueError(f"TransformerConfig fields {flagged} come from flags: pass the flags instead")
    fixed = dict(
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # The loss is a sum over tokens; the step divides by the iteration's token count.
        calculate_per_token_loss=True,
        # gloo (CPU) pairs batched sends and receives by order and swaps them when both go to
        # the same peer (PP=2); separate isend/irecv are right on every backend.
        batch_p2p_comm=device.type == "cuda",
    )
    return TransformerConfig(**from_flags, **{**fixed, **fields})


def build_model(args: argparse.Namespace, config: TransformerConfig,
                device: torch.device) -> list[Union[GPTModel, HybridModel]]:
    """This rank's model chunks, one per virtual pipeline stage: GPTModels, or HybridModels of
    ``--hybrid-layer-pattern`` (each chunk builds its ``|`` segment)."""
    vp = config.virtual_pipeline_model_parallel_size
    grouped_gemm_impl = resolve_grouped_gemm_impl(args.moe_grouped_gemm_impl, config.transformer_impl)
    pattern = args.hybrid_layer_pattern
    chunks = []
    for vp_stage in range(vp) if vp else [None]:
        common = dict(
            config=config,
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings or args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        )
        if pattern is None:
            spec = decoder_block_spec(config, vp_stage=vp_stage, grouped_gemm_impl=grouped_gemm_impl)
            chunk = GPTModel(transformer_layer_spec=spec, **common)
        else:
            spec = hybrid_stack_spec(config, pattern, grouped_gemm_impl=grouped_gemm_impl)
            chunk = HybridModel(hybrid_stack_spec=spec, hybrid_layer_pattern=pattern, **common)
        chunks.append(chunk.to(device))
    return chunks
