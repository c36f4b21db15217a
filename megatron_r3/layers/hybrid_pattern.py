"""``--hybrid-layer-pattern``: a HybridModel's layers in Megatron-LM's syntax, checked symbol by symbol.

One symbol per decoder layer (``megatron.core.models.hybrid.hybrid_layer_allocation.Symbols``):
``*`` attention, ``-`` MLP, ``E`` MoE, ``M`` Mamba, ``G`` gated delta net, ``+`` MLA, ``D``
DeepSeek sparse attention; ``|`` between pipeline segments (``pp`` of them, or ``pp`` times the
virtual stages); after ``/`` the layers of one MTP depth, repeated per depth (``*E*E/*E/*E``: two
depths). Megatron's own parser names a bad symbol but not where it is; these checks name both.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

LAYER_NAMES = {
    Symbols.ATTENTION: "attention",
    Symbols.MLP: "MLP",
    Symbols.MOE: "MoE",
    Symbols.MAMBA: "Mamba",
    Symbols.GDN: "gated delta net",
    Symbols.MLA: "MLA",
    Symbols.DS_ATTENTION: "DeepSeek sparse attention",
}


def check_hybrid_layer_pattern(pattern: str, name: str = "hybrid layer pattern") -> None:
    """Refuses a pattern Megatron's HybridModel cannot build, naming the first bad symbol and its position.

    ``name`` starts each message (the launcher's flag name, say).

    Raises:
        ValueError: an unknown symbol, a ``|`` after ``/``, no decoder layer, MTP depths that
            differ, or attention mixed with MLA or DSA layers (Megatron's rule); positions count
            characters of ``pattern`` from 1.
    """
    main, *depths = pattern.split(Symbols.MTP_SEPARATOR)
    for position, symbol in enumerate(pattern, start=1):
        if symbol in Symbols.VALID_LAYERS or symbol == Symbols.MTP_SEPARATOR:
            continue
        if symbol == Symbols.PIPE and position <= len(main):
            continue
        where = "MTP layers (after '/') take no pipeline split" if symbol == Symbols.PIPE else "not a layer symbol"
        raise ValueError(f"{name} {pattern!r}: {symbol!r} at position {position}: {where} "
                         f"(layers: {_symbols_help()}; '|' splits pipeline stages, '/' starts each MTP depth)")
    if not main.replace(Symbols.PIPE, ""):
        raise ValueError(f"{name} {pattern!r} has no decoder layer before its first '/'")
    for depth, layers in enumerate(depths[1:], start=2):
        if layers != depths[0]:
            raise ValueError(f"{name} {pattern!r}: MTP depth {depth} is {layers!r}, depth 1 "
                             f"{depths[0]!r}: every MTP depth has the same layers")
    if Symbols.ATTENTION in pattern and (Symbols.MLA in pattern or Symbols.DS_ATTENTION in pattern):
        raise ValueError(f"{name} {pattern!r} mixes attention ('*') with MLA ('+') or DSA ('D') "
                         "layers, which Megatron's HybridModel does not support")


def first_symbol_outside(pattern: str, symbols: set[str]) -> Optional[tuple[int, str]]:
    """``(position from 1, symbol)`` of the first layer symbol of ``pattern`` not in ``symbols``, or None."""
    for position, symbol in enumerate(pattern, start=1):
        if symbol in Symbols.VALID_LAYERS and symbol not in symbols:
            return position, symbol
    return None


def hybrid_num_layers(pattern: str) -> int:
    """The decoder layers of ``pattern`` (MTP layers excluded): Megatron's ``num_layers`` for it."""
    return len(pattern.split(Symbols.MTP_SEPARATOR)[0].replace(Symbols.PIPE, ""))


def hybrid_pipeline_segments(pattern: str) -> int:
    """The ``|``-delimited segments of the decoder pattern (1 without a split)."""
    return pattern.split(Symbols.MTP_SEPARATOR)[0].count(Symbols.PIPE) + 1


def hybrid_mtp_depths(pattern: str) -> int:
    """The MTP depths of ``pattern``: the non-empty parts after its first ``/``."""
    return sum(1 for depth in pattern.split(Symbols.MTP_SEPARATOR)[1:] if depth)


def hybrid_virtual_stages(pattern: str, pipeline_model_parallel_size: int) -> Optional[int]:
    """The virtual pipeline stages per rank a pattern's segments make, as Megatron-LM derives them.

    ``None`` (no interleaving) for a pattern without ``|`` or with one segment per pipeline
    rank; else ``segments / pp``.

    Raises:
        ValueError: the segments do not divide evenly over the pipeline ranks.
    """
    segments = hybrid_pipeline_segments(pattern)
    if segments == 1:
        return None
    if segments % pipeline_model_parallel_size:
        raise ValueError(f"hybrid layer pattern {pattern!r} has {segments} '|' segments, not a multiple of "
                         f"--pipeline-model-parallel-size {pipeline_model_parallel_size} (each pipeline rank "
                         "builds the same number of segments, one per virtual stage)")
    stages = segments // pipeline_model_parallel_size
    return stages if stages > 1 else None


def _symbols_help() -> str:
    return ", ".join(f"{symbol!r} {name}" for symbol, name in LAYER_NAMES.items())
