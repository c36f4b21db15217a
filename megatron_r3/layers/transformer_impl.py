"""Which layers a model is built from: TransformerEngine's, through Megatron's own TE specs, or the local ones.

``transformer_engine`` is what Megatron MoE training runs on GPUs: Megatron's
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` (TE attention with THD
rows and context parallelism, TE's fused norm and linear layers, ``TEGroupedMLP`` experts
with ``moe_grouped_gemm``). ``local`` is :func:`~megatron_r3.layers.specs.get_gpt_decoder_block_r3_spec`:
Megatron's local modules with this package's norm, attention and grouped experts, which run
every layout without TransformerEngine, on CPUs too.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.specs import get_gpt_decoder_block_r3_spec

TRANSFORMER_IMPLS = ("transformer_engine", "local")
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


def decoder_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """The decoder-block spec of this rank's stage ``vp_stage`` for ``config.transformer_impl``."""
    if config.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    return get_gpt_decoder_block_r3_spec(config, vp_stage=vp_stage)
