"""Which layers a model is built from: TransformerEngine's, through Megatron's own TE specs, or the local ones.

``transformer_engine`` is what Megatron MoE training runs on GPUs: Megatron's
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` (TE attention with THD
rows and context parallelism, TE's fused norm and linear layers, ``TEGroupedMLP`` experts
with ``moe_grouped_gemm``). ``local`` is :func:`~megatron_r3.layers.specs.get_gpt_decoder_block_r3_spec`:
Megatron's local modules with this package's norm, attention and grouped experts, which run
every layout without TransformerEngine, on CPUs too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from functools import partial
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.specs import get_gpt_decoder_block_r3_spec, grouped_gemm_experts_spec

TRANSFORMER_IMPLS = ("transformer_engine", "local")
# Who runs grouped experts: TransformerEngine's TEGroupedMLP (host split sizes, one GEMM set-up
# per expert on the host), or torch's grouped GEMM with device offsets (GroupedGemmExperts).
GROUPED_GEMM_IMPLS = ("transformer_engine", "torch")
# Flags whose feature exists only in TransformerEngine's layers.
TE_ONLY_FLAGS = ("moe_permute_fusion", "moe_router_fusion")


def transformer_engine_installed() -> bool:
    """Whether TransformerEngine's PyTorch extension can be imported (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None and (
        importlib.util.find_spec("transformer_engine_torch") is not None
    )


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


def resolve_grouped_gemm_impl(requested: Optional[str], transformer_impl: str) -> str:
    """Who runs grouped experts: TE's ``TEGroupedMLP`` by default with TE's layers, torch's grouped GEMM
    (the only one) with the local layers.

    Raises:
        ValueError: ``transformer_engine`` asked for with the local layers, or an unknown value.
    """
    if requested is None:
        return "transformer_engine" if transformer_impl == "transformer_engine" else "torch"
    if requested not in GROUPED_GEMM_IMPLS:
        raise ValueError(f"--moe-grouped-gemm-impl must be one of {GROUPED_GEMM_IMPLS}, got {requested!r}")
    if requested == "transformer_engine" and transformer_impl != "transformer_engine":
        raise ValueError("--moe-grouped-gemm-impl transformer_engine needs TransformerEngine's layers "
                         "(--transformer-impl transformer_engine)")
    return requested


def decoder_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None,
                       grouped_gemm_impl: str = "transformer_engine") -> TransformerBlockSubmodules:
    """The decoder-block spec of this rank's stage ``vp_stage`` for ``config.transformer_impl``.

    With TE's layers and ``grouped_gemm_impl="torch"``, grouped experts are
    :class:`~megatron_r3.layers.grouped_experts.GroupedGemmExperts` instead of ``TEGroupedMLP``.
    """
    if config.transformer_impl != "transformer_engine":
        return get_gpt_decoder_block_r3_spec(config, vp_stage=vp_stage)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    if config.moe_grouped_gemm and grouped_gemm_impl == "torch":
        block = with_experts(block, grouped_gemm_experts_spec())
    return block


def with_experts(block: TransformerBlockSubmodules, experts) -> TransformerBlockSubmodules:
    """``block`` with the experts of every MoE layer built by ``experts`` (the rest unchanged)."""
    layers = []
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        if isinstance(mlp, partial) and mlp.func is MoELayer:
            submodules = dataclasses.replace(mlp.keywords["submodules"], experts=experts)
            mlp = partial(MoELayer, *mlp.args, **{**mlp.keywords, "submodules": submodules})
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
        layers.append(spec)
    return dataclasses.replace(block, layer_specs=layers)
