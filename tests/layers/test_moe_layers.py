"""MoE layer numbering and pipeline chunk ranges, checked against Megatron itself."""

import itertools

import pytest
import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_r3.layers.moe_layers import (
    PipelineSplit,
    chunk_moe_layer_numbers,
    config_moe_layer_numbers,
    moe_layer_numbers,
    moe_layer_pattern,
)


def test_moe_layer_freq_int_and_list():
    assert moe_layer_numbers(6, 1) == (1, 2, 3, 4, 5, 6)
    assert moe_layer_numbers(6, 2) == (1, 3, 5)  # layer index 0 is MoE, like Megatron's specs
    assert moe_layer_numbers(5, [0, 0, 1, 1, 1]) == (3, 4, 5)  # dense-first
    with pytest.raises(ValueError):
        moe_layer_pattern(4, [1, 1, 1])
    with pytest.raises(ValueError):
        moe_layer_pattern(4, 0)


def _config(**kw):
    base = dict(num_layers=kw.pop("num_layers"), hidden_size=64, num_attention_heads=4,
                pipeline_dtype=torch.float32, num_moe_experts=4, moe_router_topk=2)
    base.update(kw)
    return TransformerConfig(**base)


def _cases():
    # (num_layers, pp, vp, first, last, embed, loss)
    for n, pp, vp in [(8, 2, None), (8, 2, 2), (8, 4, 2), (12, 3, None), (12, 3, 2), (16, 4, 4), (24, 4, 3)]:
        yield n, pp, vp, None, None, False, False
    for n, pp, vp, first, last in [
        (10, 4, None, 1, 3), (10, 4, None, None, 4), (9, 4, None, 3, None), (7, 2, None, 3, None),
        (12, 4, 2, 2, 2), (16, 4, 2, 4, None), (8, 3, None, 2, 2), (14, 4, 2, None, 2),
    ]:
        yield n, pp, vp, first, last, False, False
    for n, pp, vp, embed, loss in [(8, 2, None, True, True), (6, 4, None, True, True), (11, 4, None, True, False),
                                   (14, 4, 2, True, True), (9, 2, None, False, True)]:
        yield n, pp, vp, None, None, embed, loss


@pytest.mark.parametrize("case", list(_cases()))
def test_pipeline_ranges_match_megatron(case):
    n, pp, vp, first, last, embed, loss = case
    config = _config(
        num_layers=n, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=embed, account_for_loss_in_pipeline_split=loss,
    )
    split = PipelineSplit.from_config(config)
    covered = []
    for pp_rank, vp_stage in itertools.product(range(pp), range(vp) if vp else [None]):
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        assert split.layer_range(pp_rank, vp_stage) == range(offset, offset + count), (pp_rank, vp_stage)
        covered.extend(split.layer_range(pp_rank, vp_stage))
    assert sorted(covered) == list(range(n))


def test_chunk_layer_numbers_skip_dense_layers():
    config = _config(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                     moe_layer_freq=[0, 1, 0, 1, 1, 1, 0, 1])
    split = PipelineSplit.from_config(config)
    moe = config_moe_layer_numbers(config)
    assert moe == (2, 4, 5, 6, 8)
    chunks = {(p, v): chunk_moe_layer_numbers(moe, split, p, v) for p in range(2) for v in range(2)}
    # Stage 0: layers [1,2] [5,6]; stage 1: [3,4] [7,8].
    assert chunks == {(0, 0): (2,), (1, 0): (4,), (0, 1): (5, 6), (1, 1): (8,)}


def test_custom_pipeline_layout_matches_megatron(monkeypatch):
    from types import SimpleNamespace

    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    # pp=2, vp=2: stages in order (pp0,vp0) (pp1,vp0) (pp0,vp1) (pp1,vp1); 9 decoder layers, uneven.
    layout = PipelineParallelLayerLayout("Ett|ttt|t|tttL", pipeline_model_parallel_size=2)
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
    config = SimpleNamespace(
        num_layers=9, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        pipeline_model_parallel_layout=layout,
    )
    split = PipelineSplit.from_config(config)
    covered = []
    for pp_rank in range(2):
        for vp_stage in range(2):
            offset = layout.get_layer_offset(vp_stage=vp_stage, pp_rank=pp_rank)
            count = layout.get_num_layers_to_build(vp_stage=vp_stage, pp_rank=pp_rank)
            assert split.layer_range(pp_rank, vp_stage) == range(offset, offset + count)
            covered.extend(split.layer_range(pp_rank, vp_stage))
    assert sorted(covered) == list(range(9))


def test_moe_layer_freq_flag_parses_like_megatron():
    from megatron_r3.layers.moe_layers import parse_moe_layer_freq

    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("0,1,1,1") == [0, 1, 1, 1]
    assert parse_moe_layer_freq("[0,1]") == [0, 1]
    with pytest.raises(ValueError, match="--moe-layer-freq must be an int or comma-separated"):
        parse_moe_layer_freq("[0]*3+[1]")
