"""A small TransformerConfig for tests that only need its pipeline split (which chunk builds which layers)."""

from typing import Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


def pipeline_config(
    num_layers: int,
    pp: int = 1,
    vp: Optional[int] = None,
    first: Optional[int] = None,
    last: Optional[int] = None,
    **fields,
) -> TransformerConfig:
    """``num_layers`` decoder layers over ``pp`` pipeline ranks of ``vp`` virtual stages each.

    Args:
        first, last: ``num_layers_in_first/last_pipeline_stage`` (uneven stages).
        fields: Any other ``TransformerConfig`` field.
    """
    return TransformerConfig(
        num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last, **fields,
    )
