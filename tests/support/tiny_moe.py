"""A tiny MoE GPT (dense and MoE layers) built for any layout from one seed, by the launcher's model factory.

:class:`TinyMoE` and :class:`~tests.support.parallel.Layout` become the launcher's flags;
:func:`build_gpt` parses them with :func:`megatron_r3.rl.arguments.parse_args`, takes their
:func:`~megatron_r3.rl.arguments.model_settings` and builds through :mod:`megatron_r3.rl.model.factory`, so the tests run the model the launcher runs.
"""

import argparse
import dataclasses
from typing import Optional, Sequence

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.moe_layers import hybrid_moe_layers
from megatron_r3.rl.arguments import model_settings, parse_args
from megatron_r3.rl.model.factory import build_model, transformer_config
from tests.support.parallel import Layout
from tests.support.weights import init_from_seed


@dataclasses.dataclass(frozen=True)
class TinyMoE:
    """Model hyper-parameters; every layout of one test uses the same values.

    The defaults give 4 layers, dense-MoE-dense-MoE, 4 experts, top-2, grouped-query
    attention (4 heads, 2 groups), RoPE, GeLU MLPs and experts (on every device: the launcher's
    own default is SwiGLU on GPUs), fp32, no dropout, no load-balancing loss.
    Linear layers have no biases by default, as in most MoE models; with
    ``add_bias_linear`` (Megatron supports MoE biases only with expert-TP 1) they do.
    With ``hybrid_layer_pattern`` the model is a HybridModel of that pattern
    (``--hybrid-layer-pattern``) instead of a GPTModel of ``num_layers`` and ``moe_layer_freq``.
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
    swiglu: bool = False
    router_logit_std: float = 2.0
    hybrid_layer_pattern: Optional[str] = None

    @property
    def moe_layers(self) -> list[int]:
        """0-based indices of the MoE layers."""
        if self.hybrid_layer_pattern is not None:
            return [n - 1 for n in hybrid_moe_layers(self.hybrid_layer_pattern)]
        return [i for i, is_moe in enumerate(self.moe_layer_freq) if is_moe]

    @property
    def flags(self) -> list[str]:
        """The launcher's flags for these hyper-parameters (``router_logit_std`` is the weights', not a flag)."""
        if self.hybrid_layer_pattern is not None:
            layers = ["--hybrid-layer-pattern", self.hybrid_layer_pattern]
        else:
            layers = ["--num-layers", str(self.num_layers), "--moe-layer-freq", ",".join(map(str, self.moe_layer_freq))]
        return [
            *layers,
            "--hidden-size", str(self.hidden_size), "--ffn-hidden-size", str(self.ffn_hidden_size),
            "--moe-ffn-hidden-size", str(self.moe_ffn_hidden_size),
            "--num-attention-heads", str(self.num_attention_heads), "--num-query-groups", str(self.num_query_groups),
            "--num-experts", str(self.num_experts), "--moe-router-topk", str(self.topk),
            "--vocab-size", str(self.vocab_size), "--max-position-embeddings", str(self.max_sequence_length),
            "--normalization", self.normalization,
            "--add-bias-linear" if self.add_bias_linear else "--disable-bias-linear",
            "--swiglu" if self.swiglu else "--no-swiglu",
        ]


def launcher_args(layout: Layout, model: TinyMoE = TinyMoE(), flags: Sequence[str] = ()) -> argparse.Namespace:
    """The launcher's parsed flags for ``model`` under ``layout``, then ``flags``.

    Rows of the model's full length, one sample each, and no comparison pass: the run's
    other settings do not reach the model. The local layers unless ``flags`` say
    ``--transformer-impl transformer_engine``.
    """
    return parse_args([*layout.flags, *model.flags, "--seq-length", str(model.max_sequence_length),
                       "--micro-batch-size", "1", "--no-r3-compare", "--transformer-impl", "local", *flags])


def build_gpt(
    layout: Layout,
    model: TinyMoE = TinyMoE(),
    seed: int = 0,
    device: Optional[torch.device] = None,
    flags: Sequence[str] = (),
    **fields,
) -> tuple[TransformerConfig, list[GPTModel]]:
    """This rank's config and model chunks (one per virtual pipeline stage), weights from ``seed``.

    Every parameter is the slice this rank owns of a full tensor generated from
    ``seed`` and the parameter's single-rank name (see ``weights.init_from_seed``),
    so any layout and the single-rank reference hold the same full weights.

    Args:
        layout: The parallel layout; the parallel state must be initialised for it.
        model: The hyper-parameters.
        seed: Weight seed.
        device: Where the chunks live; defaults to the CPU.
        flags: More launcher flags, e.g. ``--moe-enable-routing-replay``.
        **fields: ``TransformerConfig`` fields no flag sets (router variants, aux losses, ...),
            as :func:`megatron_r3.rl.model.factory.transformer_config` takes them.
    """
    device = device or torch.device("cpu")
    settings = model_settings(launcher_args(layout, model, flags))
    config = transformer_config(settings, device, **fields)
    chunks = build_model(settings, config, device)
    init_from_seed(chunks, seed, router_logit_std=model.router_logit_std)
    return config, chunks
