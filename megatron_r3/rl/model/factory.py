"""The policy's (and the rollout engine's) TransformerConfig and model chunks, from :class:`ModelSettings`.

The one place a model is made from settings: the launcher, the benchmarks and the tests
(``tests/support/tiny_moe.py``, through the same flags and
:func:`megatron_r3.rl.arguments.model_settings`) build theirs here, so all of them run the
same layers under the same settings: TransformerEngine's through Megatron's TE specs, or the
local ones (:mod:`megatron_r3.layers.transformer_impl`, ``--transformer-impl``). The model is a
GPTModel, or with ``--hybrid-layer-pattern`` a HybridModel of that pattern.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.hybrid_pattern import hybrid_num_layers
from megatron_r3.layers.moe_layers import hybrid_moe_layers, model_moe_layers
from megatron_r3.layers.transformer_impl import (
    TE_ONLY_FLAGS,
    decoder_block_spec,
    hybrid_stack_spec,
    resolve_grouped_gemm_impl,
    resolve_rope_fusion,
    resolve_transformer_impl,
    te_grouped_gemm_problem,
)
from megatron_r3.routing_replay import RoutingReplaySettings


@dataclass(frozen=True)
class ParallelSettings:
    """Megatron's parallel sizes (named as ``TransformerConfig``'s fields; the parallel-size flags).

    Attributes:
        virtual_pipeline_model_parallel_size: Virtual pipeline stages per pipeline rank, or None.
        num_layers_in_first_pipeline_stage: Layers of the first stage where it differs, or None.
        num_layers_in_last_pipeline_stage: Layers of the last stage where it differs, or None.
        expert_tensor_parallel_size: None: the tensor-parallel size.
    """

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None


@dataclass(frozen=True)
class RecomputeSettings:
    """Activation recomputation (``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``).

    Attributes:
        granularity: ``"full"``, ``"selective"`` or None (no recomputation).
        method: ``"uniform"`` or ``"block"`` (full recomputation only).
        num_layers: Layers per recomputed unit (full recomputation only).
    """

    granularity: Optional[str] = None
    method: str = "uniform"
    num_layers: int = 1

    def config_kwargs(self) -> dict:
        """The ``TransformerConfig`` fields."""
        if self.granularity == "full":
            return dict(recompute_granularity="full", recompute_method=self.method,
                        recompute_num_layers=self.num_layers)
        if self.granularity == "selective":
            return dict(recompute_granularity="selective")
        return {}


@dataclass(frozen=True)
class ModelSettings:
    """What the model is, where the flags decide it (:func:`megatron_r3.rl.arguments.model_settings`).

    The fields named as ``TransformerConfig``'s mean what they mean there. The others:

    Attributes:
        moe_layer_freq: Megatron's ``moe_layer_freq`` (every Nth layer, or one 0/1 per layer);
            a HybridModel's MoE layers are its pattern's ``E`` layers.
        hybrid_layer_pattern: Build a HybridModel of this pattern (Megatron-LM's syntax), not a GPTModel.
        moe_grouped_gemm_impl: Who runs grouped experts with TransformerEngine's layers (None: TE's).
        transformer_impl: ``"transformer_engine"``, ``"local"`` or None (TransformerEngine's where it runs).
        cp_comm_type, moe_permute_fusion, moe_router_fusion, apply_rope_fusion: TransformerEngine's
            layers only (``apply_rope_fusion`` None: on with them).
        swiglu: Gated SiLU MLPs and experts, else GeLU.
        bf16: bf16 parameters and activations; None: with TransformerEngine's layers only.
        vocab_size: The embedding's and output layer's rows.
        max_sequence_length: The longest sequence the position embedding serves.
        routing_replay: Whether the policy's routers take a ``MoERouting``, and the replay checks.
        moe_router_dtype: The routers' logits and scores in ``"fp32"`` or ``"fp64"``; None: in the
            activations' dtype (Megatron's ``moe_router_dtype``).
        moe_allgather_static_shapes: The allgather dispatcher with no shape set by the routes
            (:mod:`megatron_r3.layers.static_allgather`).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int]
    num_moe_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_layer_freq: Union[int, tuple[int, ...]]
    hybrid_layer_pattern: Optional[str]
    moe_router_score_function: str
    moe_token_dispatcher_type: str
    moe_allgather_static_shapes: bool
    moe_grouped_gemm: bool
    moe_grouped_gemm_impl: Optional[str]
    transformer_impl: Optional[str]
    cp_comm_type: str
    moe_permute_fusion: bool
    moe_router_fusion: bool
    apply_rope_fusion: Optional[bool]
    swiglu: bool
    normalization: str
    init_method_std: float
    add_bias_linear: bool
    vocab_size: int
    max_sequence_length: int
    bf16: Optional[bool]
    parallel: ParallelSettings
    recompute: RecomputeSettings
    routing_replay: RoutingReplaySettings
    moe_router_dtype: Optional[str] = None

    def __post_init__(self):
        if self.moe_allgather_static_shapes and self.moe_token_dispatcher_type != "allgather":
            raise ValueError("--moe-allgather-static-shapes needs --moe-token-dispatcher-type allgather")
        if self.hybrid_layer_pattern is not None and hybrid_num_layers(self.hybrid_layer_pattern) != self.num_layers:
            raise ValueError(f"num_layers {self.num_layers} does not match hybrid_layer_pattern "
                             f"{self.hybrid_layer_pattern!r} ({hybrid_num_layers(self.hybrid_layer_pattern)} layers)")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The model's MoE layers (global 1-based numbers): a HybridModel's ``E`` layers, or a GPTModel's
        from ``moe_layer_freq``."""
        if self.hybrid_layer_pattern is not None:
            return tuple(hybrid_moe_layers(self.hybrid_layer_pattern))
        return tuple(model_moe_layers(self.num_layers, self._megatron_layer_freq))

    @property
    def _megatron_layer_freq(self) -> Union[int, list[int]]:
        return self.moe_layer_freq if isinstance(self.moe_layer_freq, int) else list(self.moe_layer_freq)

    @property
    def te_only_options(self) -> dict[str, Optional[bool]]:
        """The options only TransformerEngine's layers run, by name (refused with the local layers where
        set; None: the default)."""
        return {name: getattr(self, name) for name in TE_ONLY_FLAGS}


def transformer_config(model: ModelSettings, device: torch.device, *, rollout_engine: bool = False,
                       **fields) -> TransformerConfig:
    """The model's ``TransformerConfig``.

    Args:
        model: The settings (:func:`megatron_r3.rl.arguments.model_settings` reads them from the flags).
        device: Where the model computes.
        rollout_engine: The rollout engine's config: bf16 and grouped-GEMM experts, as an inference
            engine runs, and routers that take a ``MoERouting`` whatever the training settings say (the
            engine records its routes).
        **fields: ``TransformerConfig`` fields ``model`` does not set (router variants the launcher does
            not offer, ``recompute_modules``, ...); they replace the fixed choices here (no
            load-balancing loss, no dropout, no fusions but TE's that the flags ask for). A field
            ``model`` sets is refused: set it there.

    Raises:
        ValueError: ``fields`` names a field ``model`` sets, or the layers asked for cannot run here
            (:func:`~megatron_r3.layers.transformer_impl.resolve_transformer_impl`).
    """
    transformer_impl = resolve_transformer_impl(model.transformer_impl, device, model.te_only_options)
    resolve_grouped_gemm_impl(model.moe_grouped_gemm_impl, transformer_impl)  # refused here, before building
    te_fields = {}
    if transformer_impl == "transformer_engine":
        te_fields = dict(model.te_only_options, cp_comm_type=model.cp_comm_type,
                         apply_rope_fusion=resolve_rope_fusion(model.apply_rope_fusion, transformer_impl))
    bf16 = rollout_engine or (model.bf16 if model.bf16 is not None else transformer_impl == "transformer_engine")
    dtype = torch.bfloat16 if bf16 else torch.float32
    routing_replay = model.routing_replay
    if rollout_engine:  # the engine records its routes
        routing_replay = dataclasses.replace(routing_replay, enabled=True)
    from_settings = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        normalization=model.normalization,
        init_method_std=model.init_method_std,
        add_bias_linear=model.add_bias_linear,
        num_moe_experts=model.num_moe_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_layer_freq=model._megatron_layer_freq,
        is_hybrid_model=model.hybrid_layer_pattern is not None,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_dtype=model.moe_router_dtype,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_grouped_gemm=model.moe_grouped_gemm or rollout_engine,
        **dataclasses.asdict(model.parallel),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        **routing_replay.config_kwargs(),
        **model.recompute.config_kwargs(),
        transformer_impl=transformer_impl,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        **te_fields,
    )
    set_here = sorted(fields.keys() & from_settings.keys())
    if set_here:
        raise ValueError(f"TransformerConfig fields {set_here} come from the model's settings (the flags): "
                         f"set them there instead")
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
        persist_layer_norm=False,
        # The loss is a sum over tokens; the step divides by the iteration's token count.
        calculate_per_token_loss=True,
        # Point-to-point messages carry no tags: gloo and NCCL pair one batch's sends and receives
        # to the same peer by order, and at PP=2 the interleaved schedule batches an activation
        # and a gradient to that one peer, which then land in each other's buffers (Megatron-LM
        # #750). Megatron's separate isend/irecv send the two directions on different groups.
        batch_p2p_comm=False,
    )
    return TransformerConfig(**from_settings, **{**fixed, **fields})


def experts_grouped_gemm_impl(model: ModelSettings, config: TransformerConfig) -> str:
    """Who runs the grouped experts of a model of ``config``: ``--moe-grouped-gemm-impl``, except for
    the rollout engine's grouped experts over a policy of ``SequentialMLP`` experts (TE's layers
    with ``--no-moe-grouped-gemm``): there torch's grouped GEMMs, whose parameters are
    ``SequentialMLP``'s (``local_experts.<i>.linear_fc1.weight``), so the engine's lagged weights
    copy over one to one; ``TEGroupedMLP``'s are ``linear_fc1.weight<i>``."""
    requested = model.moe_grouped_gemm_impl
    if config.moe_grouped_gemm and not model.moe_grouped_gemm:
        requested = "torch"
    return resolve_grouped_gemm_impl(requested, config.transformer_impl)


def layers_summary(model: ModelSettings, config: TransformerConfig) -> str:
    """One start-up line: the layers and experts a model of ``config`` runs, and why, where a default chose
    torch's grouped GEMM over TransformerEngine's."""
    layers = ("TransformerEngine's layers (Megatron's TE specs)" if config.transformer_impl == "transformer_engine"
              else "Megatron's local layers")
    if config.apply_rope_fusion:
        layers += " with fused RoPE"
    if not config.moe_grouped_gemm:
        experts = "SequentialMLP (GEMMs per expert)"
    elif experts_grouped_gemm_impl(model, config) == "transformer_engine":
        experts = "TransformerEngine's TEGroupedMLP"
    else:
        experts = "torch's grouped GEMM (GroupedGemmExperts)"
        if model.moe_grouped_gemm_impl is None and config.transformer_impl == "transformer_engine":
            experts += (f", as TEGroupedMLP would issue one GEMM per expert here ({te_grouped_gemm_problem()}; "
                        f"--moe-grouped-gemm-impl transformer_engine takes it)")
    return f" layers: {layers} in {'bf16' if config.bf16 else 'fp32'}; experts: {experts}"


def build_model(model: ModelSettings, config: TransformerConfig,
                device: torch.device) -> list[Union[GPTModel, HybridModel]]:
    """This rank's model chunks, one per virtual pipeline stage: GPTModels, or HybridModels of
    ``model.hybrid_layer_pattern`` (each chunk builds its ``|`` segment); ``config`` from
    :func:`transformer_config`."""
    vp = config.virtual_pipeline_model_parallel_size
    grouped_gemm_impl = experts_grouped_gemm_impl(model, config)
    pattern = model.hybrid_layer_pattern
    chunks = []
    for vp_stage in range(vp) if vp else [None]:
        common = dict(
            config=config,
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        )
        if pattern is None:
            spec = decoder_block_spec(config, vp_stage=vp_stage, grouped_gemm_impl=grouped_gemm_impl,
                                      static_allgather=model.moe_allgather_static_shapes)
            chunk = GPTModel(transformer_layer_spec=spec, **common)
        else:
            spec = hybrid_stack_spec(config, pattern, grouped_gemm_impl=grouped_gemm_impl,
                                     static_allgather=model.moe_allgather_static_shapes)
            chunk = HybridModel(hybrid_stack_spec=spec, hybrid_layer_pattern=pattern, **common)
        chunks.append(chunk.to(device))
    return chunks
