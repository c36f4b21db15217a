"""The layers and MoE layers of each HybridModel chunk, from its layer pattern, against Megatron's own
segment selection (``select_pipeline_segment``) for every pipeline rank and virtual stage."""

import pytest
import torch

from megatron.core.models.hybrid import hybrid_layer_allocation
from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern, select_pipeline_segment
from megatron_r3.layers.moe_layers import chunk_layers, chunk_vp_stages, hybrid_moe_layers
from tests.support.pipeline import pipeline_config


def test_moe_layers_are_the_e_layers_of_the_main_pattern():
    assert hybrid_moe_layers("*E*E") == (2, 4)
    assert hybrid_moe_layers("*-|*E|E*|-E/*E/*E") == (4, 5, 8)  # '|' takes no number, MTP excluded
    assert hybrid_moe_layers("M*M-") == ()


def _megatron_segment(pattern, pp, pp_rank, vp_stage, monkeypatch):
    """Megatron's choice for one chunk: it reads the rank and size from the pipeline group (and logs
    through the default group, which this process has not started)."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: pp_rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: pp)
    for log in ("log_on_each_pipeline_stage", "log_single_rank"):
        monkeypatch.setattr(hybrid_layer_allocation, log, lambda *args, **kwargs: None)
    main = parse_hybrid_pattern(pattern).main_pattern
    types, offset = select_pipeline_segment(main, object(), vp_stage)
    return list(range(offset + 1, offset + len(types) + 1))


@pytest.mark.parametrize(
    "pattern, pp, vp",
    [("*E|-E", 2, None), ("*E-|E|*E|E-*E", 2, 2), ("E|*E|-|*E/*E", 4, None), ("*E|E*|E-|*E|-E|*", 2, 3),
     ("*E|-E", 1, 2)],
)
def test_chunks_build_the_segments_megatron_selects(pattern, pp, vp, monkeypatch):
    config = pipeline_config(len(parse_hybrid_pattern(pattern).main_pattern.replace("|", "")), pp=pp, vp=vp)
    for stage in chunk_vp_stages(config) if pp > 1 else ([None] if vp is None else list(range(vp))):
        for rank in range(pp):
            want = _megatron_segment(pattern, pp, rank, stage, monkeypatch)
            assert list(chunk_layers(config, rank, stage, hybrid_layer_pattern=pattern)) == want, (rank, stage)


def test_a_pattern_without_splits_is_cut_like_a_gpt_decoder(monkeypatch):
    config = pipeline_config(8, pp=2)
    for rank in range(2):
        want = _megatron_segment("*E*E*E*E", 2, rank, None, monkeypatch)
        assert list(chunk_layers(config, rank, hybrid_layer_pattern="*E*E*E*E")) == want


def test_too_few_segments_for_the_pipeline_are_an_error():
    with pytest.raises(ValueError, match="3 '\\|' segments: no segment for pipeline rank 1 of 2"):
        chunk_layers(pipeline_config(6, pp=2), 1, hybrid_layer_pattern="*E|*E|*E")
