"""Which model layers are MoE layers, and which layers a pipeline chunk builds.

Layer numbers here are Megatron's: global and 1-based, as
``TransformerLayer.layer_number``. Dense layers have no router, so they have no
routes; a routing container keeps one row per MoE layer only. Which layers a
chunk builds is Megatron's own answer (``get_transformer_layer_offset``,
``get_num_layers_to_build``), asked for any pipeline rank. A HybridModel's layers come
from its layer pattern instead (``*E-E``: ``E`` layers are MoE; ``|`` splits stages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def moe_layer_pattern(num_layers: int, moe_layer_freq: Union[int, Sequence[int]]) -> list[bool]:
    """Per-layer MoE flags, parsed like Megatron's GPT layer specs.

    Args:
        num_layers: Decoder layers in the model (MTP layers excluded).
        moe_layer_freq: An int N (layer i, 0-based, is MoE when ``i % N == 0``) or
            a list of 0/1 of length ``num_layers`` (dense-first models: ``[0]*k + [1]*m``).

    Returns:
        ``num_layers`` booleans, True for MoE layers.
    """
    if isinstance(moe_layer_freq, bool) or num_layers < 1:
        raise ValueError(f"invalid num_layers={num_layers} / moe_layer_freq={moe_layer_freq!r}")
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {moe_layer_freq}")
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    pattern = list(moe_layer_freq)
    if len(pattern) != num_layers or any(p not in (0, 1) for p in pattern):
        raise ValueError(
            f"moe_layer_freq list must hold {num_layers} entries of 0/1, got {moe_layer_freq!r}"
        )
    return [bool(p) for p in pattern]


def parse_moe_layer_freq(text: str) -> Union[int, list[int]]:
    """The ``--moe-layer-freq`` flag: ``"N"`` (every Nth layer) or ``"0,1,1,1"`` (one 0/1 per layer)."""
    values = text.strip("[] ")
    try:
        return [int(v) for v in values.split(",")] if "," in values else int(values)
    except ValueError:
        raise ValueError(f"--moe-layer-freq must be an int or comma-separated 0/1 per layer, got {text!r}") from None


def model_moe_layers(num_layers: int, moe_layer_freq: Union[int, Sequence[int]]) -> tuple[int, ...]:
    """The model's MoE layers: global 1-based layer numbers, increasing (MTP layers excluded)."""
    return tuple(i + 1 for i, is_moe in enumerate(moe_layer_pattern(num_layers, moe_layer_freq)) if is_moe)


def hybrid_moe_layers(hybrid_layer_pattern: str) -> tuple[int, ...]:
    """A HybridModel's MoE layers: the global 1-based numbers of the ``E`` layers of its main
    pattern, increasing (``|`` splits take no number; MTP layers after ``/`` are excluded)."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    main = (parse_hybrid_pattern(hybrid_layer_pattern).main_pattern or "").replace(Symbols.PIPE, "")
    return tuple(i + 1 for i, symbol in enumerate(main) if symbol == Symbols.MOE)


def mtp_moe_layers(
    num_layers: int, moe_layers: Sequence[int], mtp_num_layers: Optional[int] = None,
    hybrid_layer_pattern: Optional[str] = None,
) -> tuple[int, ...]:
    """The MoE layers of a model's MTP block, numbered as the routes number them (docs/routing_replay.md).

    GPTModel: depth k is layer ``num_layers + k``, built from the last decoder layer's spec
    (Megatron's ``gpt_builders``), so it is MoE when that layer is. HybridModel: layer j of depth
    k (the pattern after each ``/``) is ``num_layers + (k - 1) * len(depth) + j``, MoE where its
    symbol is ``E``.
    """
    if hybrid_layer_pattern is not None:
        main, *depths = hybrid_layer_pattern.split("/")
        depths = [d for d in depths if d]
        return tuple(num_layers + k * len(depth) + j + 1
                     for k, depth in enumerate(depths) for j, symbol in enumerate(depth) if symbol == "E")
    if not mtp_num_layers or num_layers not in set(moe_layers):
        return ()
    return tuple(num_layers + k for k in range(1, mtp_num_layers + 1))


def chunk_layers(
    config: TransformerConfig,
    pp_rank: Optional[int] = None,
    vp_stage: Optional[int] = None,
    hybrid_layer_pattern: Optional[str] = None,
) -> range:
    """Global 1-based numbers of the decoder layers (dense and MoE) model chunk (pp_rank, vp_stage) builds.

    Megatron's own ``get_transformer_layer_offset`` and ``get_num_layers_to_build``,
    the functions that build the chunk, called with an explicit ``pp_rank`` so that
    any chunk can be asked about without the parallel state. For a HybridModel whose
    pattern has ``|`` splits, the chunk is the pattern's segment ``vp_stage * pp + pp_rank``
    (how Megatron's ``select_pipeline_segment`` picks it, which reads the rank from a process
    group); a pattern without splits is cut like a GPT decoder of as many layers.

    Args:
        config: The model's ``TransformerConfig`` (its pipeline split: even, uneven
            first/last stage, interleaved virtual stages, a custom layout).
        pp_rank: Pipeline rank; defaults to this process's (Megatron's parallel state).
        vp_stage: Virtual pipeline stage; required with interleaving.
        hybrid_layer_pattern: The HybridModel's layer pattern; None for a GPTModel.
    """
    # Imported here: the rollout tools import this module and run without Megatron.
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if pp_rank is not None and not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} outside [0, {pp})")
    if vp_stage is not None and not 0 <= vp_stage < (vp or 1):
        raise ValueError(f"vp_stage {vp_stage} outside [0, {vp or 1})")
    if hybrid_layer_pattern is not None and "|" in hybrid_layer_pattern.split("/")[0]:
        return _hybrid_segment_layers(hybrid_layer_pattern, pp, vp_stage, pp_rank)
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        # Megatron's two functions drop pp_rank for a custom layout and read this process's;
        # the layout's own methods take it (and read the virtual pipeline size from the parallel state).
        offset = layout.get_layer_offset(LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        count = layout.get_num_layers_to_build(LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset + 1, offset + count + 1)


def _hybrid_segment_layers(hybrid_layer_pattern: str, pp: int, vp_stage: Optional[int], pp_rank: Optional[int]) -> range:
    """The layers of the ``|``-delimited segment chunk (pp_rank, vp_stage) builds."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    segments = parse_hybrid_pattern(hybrid_layer_pattern).main_pattern.split(Symbols.PIPE)
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    index = (vp_stage or 0) * pp + pp_rank
    if len(segments) % pp != 0 or index >= len(segments):
        raise ValueError(
            f"hybrid layer pattern {hybrid_layer_pattern!r} has {len(segments)} '|' segments: no segment for "
            f"pipeline rank {pp_rank} of {pp}, virtual stage {vp_stage} (Megatron needs pp * vp segments)"
        )
    offset = sum(len(segment) for segment in segments[:index])
    return range(offset + 1, offset + len(segments[index]) + 1)


def chunk_vp_stages(config: TransformerConfig) -> list[Optional[int]]:
    """The virtual pipeline stage of each model chunk on a pipeline rank: ``[None]`` without interleaving."""
    vp = config.virtual_pipeline_model_parallel_size
    return list(range(vp)) if vp is not None and config.pipeline_model_parallel_size > 1 else [None]

