"""Which layers a model is built from: TransformerEngine's, through Megatron's own TE specs, or the local ones.

``transformer_engine`` is what Megatron MoE training runs on GPUs: Megatron's
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` (TE attention with THD
rows and context parallelism, TE's fused norm and linear layers, ``TEGroupedMLP`` experts
with ``moe_grouped_gemm``). ``local`` is :func:`~megatron_r3.layers.specs.get_gpt_decoder_block_r3_spec`:
Megatron's local modules with this package's norm, attention and grouped experts, which run
every layout without TransformerEngine, on CPUs too. A HybridModel's stack
(:func:`hybrid_stack_spec`) comes from Megatron's TE hybrid spec or from
:func:`~megatron_r3.layers.hybrid_specs.get_hybrid_stack_r3_spec` the same way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from functools import partial
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.hybrid_pattern import check_hybrid_layer_pattern
from megatron_r3.layers.hybrid_specs import get_hybrid_stack_r3_spec
from megatron_r3.layers.specs import get_gpt_decoder_block_r3_spec, grouped_gemm_experts_spec
from megatron_r3.layers.static_allgather import StaticShapeMoELayer

TRANSFORMER_IMPLS = ("transformer_engine", "local")
# Who runs grouped experts: TransformerEngine's TEGroupedMLP (host split sizes, one GEMM set-up
# per expert on the host), or torch's grouped GEMM with device offsets (GroupedGemmExperts).
GROUPED_GEMM_IMPLS = ("transformer_engine", "torch")
# TransformerEngine's switch for GroupedLinear's grouped-tensor GEMM (its one-kernel grouped GEMM).
TE_FUSED_GROUPED_GEMM_ENV = "NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM"
# Flags whose feature exists only in TransformerEngine's layers.
TE_ONLY_FLAGS = ("moe_permute_fusion", "moe_router_fusion", "apply_rope_fusion")


def transformer_engine_installed() -> bool:
    """Whether TransformerEngine's PyTorch extension can be imported (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None and (
        importlib.util.find_spec("transformer_engine_torch") is not None
    )


def resolve_rope_fusion(requested: Optional[bool], transformer_impl: str) -> bool:
    """Whether the rotary embedding runs TransformerEngine's fused kernel: ``--apply-rope-fusion`` /
    ``--no-rope-fusion``, or ``None`` for the default, on with TransformerEngine's layers (Megatron-LM's
    default; one kernel per packed row, faster on a GPU: docs/benchmarks.md) and off with the local ones."""
    return transformer_impl == "transformer_engine" if requested is None else requested


def resolve_transformer_impl(requested: Optional[str], device: torch.device, te_only: dict) -> str:
    """The layers a model on ``device`` is built from.

    Args:
        requested: ``--transformer-impl``, or ``None`` for the default: TransformerEngine's
            layers on a GPU where TransformerEngine is installed, else the local ones.
        device: Where the model computes.
        te_only: ``{flag name: value}`` of the options that need TransformerEngine's layers.

    Raises:
        ValueError: TransformerEngine's layers are asked for on a CPU or where TransformerEngine
            is not installed, or a TE-only option is set with the local layers.
    """
    if requested is None:
        on_gpu_with_te = device.type == "cuda" and transformer_engine_installed()
        requested = "transformer_engine" if on_gpu_with_te else "local"
    if requested not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl must be one of {TRANSFORMER_IMPLS}, got {requested!r}")
    if requested == "transformer_engine":
        if device.type != "cuda":
            raise ValueError("--transformer-impl transformer_engine needs a GPU: TransformerEngine's layers run "
                             "on CUDA only (use --transformer-impl local on CPUs)")
        if not transformer_engine_installed():
            raise ValueError("--transformer-impl transformer_engine: TransformerEngine is not installed ("
                             "`make install` on a CUDA machine installs it; --transformer-impl local runs without)")
    else:
        set_flags = [name for name, value in te_only.items() if value]
        if set_flags:
            flags = ", ".join("--" + name.replace("_", "-") for name in set_flags)
            raise ValueError(f"{flags} needs TransformerEngine's layers (--transformer-impl transformer_engine)")
    return requested


def te_grouped_gemm_problem() -> Optional[str]:
    """Why TransformerEngine's grouped experts (``TEGroupedMLP``) would issue one GEMM per expert from the
    host here, or None where TE runs each grouped linear as one cuBLASLt grouped GEMM.

    TE's ``GroupedLinear`` takes its grouped-tensor GEMM only where TE's own capability check
    (``is_module_grouped_tensor_path_supported``: cuBLASLt >= 13.3, >= 13.4 on Hopper) passes and the
    path is switched on (``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=1``; megatron-core 0.19.2's
    ``TEGroupedMLP`` does not ask for it); otherwise it loops over the experts on several streams.
    """
    import transformer_engine
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.module import grouped_linear

    version = transformer_engine.__version__
    supported = getattr(grouped_linear, "is_module_grouped_tensor_path_supported", None)
    if supported is None:
        return f"TransformerEngine {version} has no grouped-tensor GEMM"
    cublaslt = tex.get_cublasLt_version()
    cublaslt = f"{cublaslt // 10000}.{cublaslt // 100 % 100}.{cublaslt % 100}"
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    if not supported(None, torch.bfloat16):
        return (f"TransformerEngine {version}'s grouped GEMM needs cuBLASLt >= 13.3 (>= 13.4 on compute capability "
                f"9.0); this node has cuBLASLt {cublaslt} on compute capability {capability}")
    if os.environ.get(TE_FUSED_GROUPED_GEMM_ENV) != "1":
        return (f"TransformerEngine {version} runs its grouped GEMM only with {TE_FUSED_GROUPED_GEMM_ENV}=1, "
                f"which megatron-core's TEGroupedMLP does not set")
    return None


def resolve_grouped_gemm_impl(requested: Optional[str], transformer_impl: str) -> str:
    """Who runs grouped experts: ``requested`` (``--moe-grouped-gemm-impl``), or by default with TE's
    layers TE's ``TEGroupedMLP`` where it runs one grouped GEMM per linear (:func:`te_grouped_gemm_problem`),
    else torch's grouped GEMM, which always does (and the only one with the local layers).

    Raises:
        ValueError: ``transformer_engine`` asked for with the local layers, or an unknown value.
    """
    if requested is None:
        te_grouped = transformer_impl == "transformer_engine" and te_grouped_gemm_problem() is None
        return "transformer_engine" if te_grouped else "torch"
    if requested not in GROUPED_GEMM_IMPLS:
        raise ValueError(f"--moe-grouped-gemm-impl must be one of {GROUPED_GEMM_IMPLS}, got {requested!r}")
    if requested == "transformer_engine" and transformer_impl != "transformer_engine":
        raise ValueError("--moe-grouped-gemm-impl transformer_engine needs TransformerEngine's layers "
                         "(--transformer-impl transformer_engine)")
    return requested


def decoder_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None,
                       grouped_gemm_impl: str = "transformer_engine",
                       static_allgather: bool = False) -> TransformerBlockSubmodules:
    """The decoder-block spec of this rank's stage ``vp_stage`` for ``config.transformer_impl``.

    With TE's layers and ``grouped_gemm_impl="torch"``, grouped experts are
    :class:`~megatron_r3.layers.grouped_experts.GroupedGemmExperts` instead of ``TEGroupedMLP``;
    ``static_allgather`` builds the MoE layers as :func:`with_static_allgather` does.
    """
    if config.transformer_impl != "transformer_engine":
        block = get_gpt_decoder_block_r3_spec(config, vp_stage=vp_stage)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
        if config.moe_grouped_gemm and grouped_gemm_impl == "torch":
            block = with_experts(block, grouped_gemm_experts_spec())
    return with_static_allgather(block) if static_allgather else block


def hybrid_stack_spec(config: TransformerConfig, hybrid_layer_pattern: str,
                      grouped_gemm_impl: str = "transformer_engine", static_allgather: bool = False) -> ModuleSpec:
    """The ``hybrid_stack_spec`` of a HybridModel of ``hybrid_layer_pattern`` for ``config.transformer_impl``.

    The local layers are :func:`~megatron_r3.layers.hybrid_specs.get_hybrid_stack_r3_spec`
    (``*``, ``-``, ``E``); TransformerEngine's are Megatron's ``hybrid_stack_spec`` (every layer
    symbol), whose MoE layers get the experts ``config`` asks for: ``TEGroupedMLP`` (or, with
    ``grouped_gemm_impl="torch"``, :class:`~megatron_r3.layers.grouped_experts.GroupedGemmExperts`)
    with ``moe_grouped_gemm``, else ``SequentialMLP`` of TE linears (Megatron's spec always has
    grouped experts). ``static_allgather`` builds the MoE layers as :func:`with_static_allgather` does.
    """
    if config.transformer_impl != "transformer_engine":
        stack = get_hybrid_stack_r3_spec(hybrid_layer_pattern, config.num_moe_experts,
                                         moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=config.qk_layernorm)
        moe = stack.submodules.moe_layer.submodules.mlp
    else:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as stack

        check_hybrid_layer_pattern(hybrid_layer_pattern)
        moe = get_moe_module_spec(use_te=True, num_experts=config.num_moe_experts,
                                  moe_grouped_gemm=config.moe_grouped_gemm)
        if config.moe_grouped_gemm and grouped_gemm_impl == "torch":
            moe = _with_experts(moe, grouped_gemm_experts_spec())
    if static_allgather:
        moe = _static_allgather(moe)
    moe_layer = stack.submodules.moe_layer
    moe_layer = dataclasses.replace(moe_layer, submodules=dataclasses.replace(moe_layer.submodules, mlp=moe))
    return dataclasses.replace(stack, submodules=dataclasses.replace(stack.submodules, moe_layer=moe_layer))


def with_experts(block: TransformerBlockSubmodules, experts) -> TransformerBlockSubmodules:
    """``block`` with the experts of every MoE layer built by ``experts`` (the rest unchanged)."""
    return _map_moe_layers(block, lambda moe: _with_experts(moe, experts))


def with_static_allgather(block: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """``block`` with every MoE layer a :class:`~megatron_r3.layers.static_allgather.StaticShapeMoELayer`
    (``--moe-allgather-static-shapes``), its submodules unchanged."""
    return _map_moe_layers(block, _static_allgather)


def _static_allgather(moe: partial) -> partial:
    """The MoE layer builder ``moe`` (a ``partial`` of ``MoELayer``) building a ``StaticShapeMoELayer``."""
    return partial(StaticShapeMoELayer, *moe.args, **moe.keywords)


def _map_moe_layers(block: TransformerBlockSubmodules, change) -> TransformerBlockSubmodules:
    """``block`` with the builder of every MoE layer (a ``partial`` of ``MoELayer``) replaced by ``change(it)``."""
    layers = []
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        if isinstance(mlp, partial) and mlp.func is MoELayer:
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=change(mlp)))
        layers.append(spec)
    return dataclasses.replace(block, layer_specs=layers)


def _with_experts(moe: partial, experts) -> partial:
    """The MoE layer builder ``moe`` (a ``partial`` of ``MoELayer``) with its experts built by ``experts``."""
    submodules = dataclasses.replace(moe.keywords["submodules"], experts=experts)
    return partial(MoELayer, *moe.args, **{**moe.keywords, "submodules": submodules})
