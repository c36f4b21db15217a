"""Which model layers are MoE layers, and which of them a pipeline chunk builds.

Layer numbers here are Megatron's: global and 1-based, as
``TransformerLayer.layer_number``. Dense layers have no router, so they have no
routes; a routing container keeps one row per MoE layer only.

The pipeline arithmetic follows Megatron-Core 0.16.1's
``get_transformer_layer_offset`` and ``get_num_layers_to_build`` (even split,
``num_layers_in_first/last_pipeline_stage``, interleaved virtual stages,
``account_for_embedding/loss_in_pipeline_split`` and a custom
``pipeline_model_parallel_layout``); tests compare it with Megatron itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union


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


def moe_layer_numbers(num_layers: int, moe_layer_freq: Union[int, Sequence[int]]) -> tuple[int, ...]:
    """Global 1-based layer numbers of the MoE layers, increasing."""
    return tuple(i + 1 for i, is_moe in enumerate(moe_layer_pattern(num_layers, moe_layer_freq)) if is_moe)


@dataclass(frozen=True)
class PipelineSplit:
    """How Megatron splits decoder layers over pipeline (and virtual) stages.

    Field names and meaning are those of ``TransformerConfig``.
    """

    num_layers: int
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Custom layout: per pp rank, per vp stage, the number of decoder layers.
    decoder_layers_per_stage: Optional[tuple[tuple[int, ...], ...]] = None

    @classmethod
    def from_config(cls, config: Any) -> "PipelineSplit":
        """Reads the split from a Megatron ``TransformerConfig`` (or any object with its fields)."""
        layout = getattr(config, "pipeline_model_parallel_layout", None)
        per_stage = None
        if layout is not None:
            from megatron.core.transformer.enums import LayerType

            per_stage = tuple(
                tuple(chunk.count(LayerType.decoder) for chunk in stage) for stage in layout.layout
            )
        return cls(
            num_layers=config.num_layers,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage,
            account_for_embedding_in_pipeline_split=bool(
                config.account_for_embedding_in_pipeline_split
            ),
            account_for_loss_in_pipeline_split=bool(config.account_for_loss_in_pipeline_split),
            decoder_layers_per_stage=per_stage,
        )

    def layer_range(self, pp_rank: int = 0, vp_stage: Optional[int] = None) -> range:
        """0-based decoder layer indices that chunk (pp_rank, vp_stage) builds.

        Equals ``range(offset, offset + n)`` with Megatron's
        ``get_transformer_layer_offset`` and ``get_num_layers_to_build``.
        """
        pp = self.pipeline_model_parallel_size
        vp = self.virtual_pipeline_model_parallel_size
        if not 0 <= pp_rank < pp:
            raise ValueError(f"pp_rank {pp_rank} outside [0, {pp})")
        if vp is not None and pp > 1 and (vp_stage is None or not 0 <= vp_stage < vp):
            raise ValueError(f"vp_stage must be in [0, {vp}) with virtual pipeline size {vp}")
        if self.decoder_layers_per_stage is not None:
            stage = 0 if vp_stage is None else vp_stage
            counts = self.decoder_layers_per_stage
            offset = sum(counts[p][v] for v in range(stage + 1) for p in range(pp if v < stage else pp_rank))
            return range(offset, offset + counts[pp_rank][stage])
        return range(self._offset(pp_rank, vp_stage), self._offset(pp_rank, vp_stage) + self._count(pp_rank, vp_stage))

    def _uneven(self) -> bool:
        return (
            self.num_layers_in_first_pipeline_stage is not None
            or self.num_layers_in_last_pipeline_stage is not None
        )

    def _count(self, pp_rank: int, vp_stage: Optional[int]) -> int:
        pp, vp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if self._uneven():
            if self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split:
                raise ValueError("uneven pipeline stages exclude account_for_embedding/loss_in_pipeline_split")
            rest = self.num_layers - (first or 0) - (last or 0)
            stages_left = pp - (first is not None) - (last is not None)
            if stages_left > 0 and rest % stages_left:
                raise ValueError("with uneven pipelining the middle layers must divide over the middle stages")
            per_rank = rest // stages_left if stages_left > 0 else 0
            if pp_rank == 0 and first is not None:
                per_rank = first
            if pp_rank == pp - 1 and last is not None:
                per_rank = last
        else:
            total = self.num_layers + self.account_for_embedding_in_pipeline_split + self.account_for_loss_in_pipeline_split
            if total % pp:
                raise ValueError(f"{total} layers do not divide over {pp} pipeline stages")
            per_rank = total // pp
        if vp is not None and pp > 1:
            if per_rank % vp:
                raise ValueError(f"{per_rank} layers per pipeline rank do not divide over {vp} virtual stages")
            count = per_rank // vp
        else:
            count = per_rank
        first_chunk = vp is None or pp == 1 or vp_stage == 0
        last_chunk = vp is None or pp == 1 or vp_stage == vp - 1
        if self.account_for_embedding_in_pipeline_split and pp_rank == 0 and first_chunk:
            count -= 1
        if self.account_for_loss_in_pipeline_split and pp_rank == pp - 1 and last_chunk:
            count -= 1
        if count < 0:
            raise ValueError("not enough layers for the embedding/loss pipeline stage")
        return count

    def _offset(self, pp_rank: int, vp_stage: Optional[int]) -> int:
        pp, vp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if pp == 1:
            return 0
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if self._uneven():
            middle_stages = pp - (first is not None) - (last is not None)
            middle_layers = self.num_layers - (first or 0) - (last or 0)
            middle_rank = pp_rank if first is None else pp_rank - 1
            if vp is not None:
                first_chunk = (first or 0) // vp
                middle_chunk = middle_layers // vp
                chunk_total = first_chunk + middle_chunk + (last or 0) // vp
                if pp_rank == 0:
                    return vp_stage * chunk_total
                return vp_stage * chunk_total + first_chunk + middle_rank * (middle_chunk // middle_stages)
            per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
            return 0 if pp_rank == 0 else middle_rank * per_rank + (first or 0)
        total = self.num_layers + self.account_for_embedding_in_pipeline_split + self.account_for_loss_in_pipeline_split
        per_rank = total // pp
        if vp is not None:
            offset = vp_stage * (total // vp) + pp_rank * (per_rank // vp)
            first_chunk = vp_stage == 0
        else:
            offset = pp_rank * per_rank
            first_chunk = True
        if self.account_for_embedding_in_pipeline_split and not (first_chunk and pp_rank == 0):
            offset -= 1
        return offset


def chunk_moe_layer_numbers(
    moe_numbers: Sequence[int], split: PipelineSplit, pp_rank: int = 0, vp_stage: Optional[int] = None
) -> tuple[int, ...]:
    """MoE layer numbers (1-based, increasing) built by pipeline chunk (pp_rank, vp_stage).

    This is the ``layer_numbers`` list that orders dim 0 of the router's
    ``expert_ids`` input on that chunk.
    """
    built = split.layer_range(pp_rank, vp_stage)
    return tuple(n for n in moe_numbers if (n - 1) in built)


def config_moe_layer_numbers(config: Any) -> tuple[int, ...]:
    """All MoE layer numbers of a Megatron ``TransformerConfig`` (MTP layers excluded)."""
    return moe_layer_numbers(config.num_layers, config.moe_layer_freq)
