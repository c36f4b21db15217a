"""MoE layer numbering, and the layers each pipeline chunk builds (Megatron's split, checked by hand)."""

import pytest

from megatron_r3.layers.moe_layers import chunk_layers, chunk_vp_stages, model_moe_layers, moe_layer_pattern
from tests.support.pipeline import pipeline_config


def test_moe_layer_freq_int_and_list():
    assert model_moe_layers(6, 1) == (1, 2, 3, 4, 5, 6)
    assert model_moe_layers(6, 2) == (1, 3, 5)  # layer index 0 is MoE, like Megatron's specs
    assert model_moe_layers(5, [0, 0, 1, 1, 1]) == (3, 4, 5)  # dense-first
    with pytest.raises(ValueError):
        moe_layer_pattern(4, [1, 1, 1])
    with pytest.raises(ValueError):
        moe_layer_pattern(4, 0)


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
def test_chunks_build_every_layer_once_in_pipeline_order(case):
    """Chunks in schedule order (virtual stage, then pipeline rank) build layers 1..n, each once, in order."""
    n, pp, vp, first, last, embed, loss = case
    config = pipeline_config(n, pp, vp, first, last, account_for_embedding_in_pipeline_split=embed,
                             account_for_loss_in_pipeline_split=loss)
    built = [n for stage in chunk_vp_stages(config) for rank in range(pp) for n in chunk_layers(config, rank, stage)]
    assert built == list(range(1, n + 1))


def test_uneven_stages_with_interleaving_by_hand():
    # 12 layers, pp=4, vp=2, 2 on the first and 2 on the last rank: per virtual stage 1 + 2 + 2 + 1 layers.
    config = pipeline_config(12, pp=4, vp=2, first=2, last=2)
    got = {(p, v): list(chunk_layers(config, p, v)) for p in range(4) for v in range(2)}
    assert got == {(0, 0): [1], (1, 0): [2, 3], (2, 0): [4, 5], (3, 0): [6],
                   (0, 1): [7], (1, 1): [8, 9], (2, 1): [10, 11], (3, 1): [12]}
    # 14 layers, pp=4, vp=2, 2 on the last rank: the middle 12 split 2 per chunk over ranks 0-2.
    config = pipeline_config(14, pp=4, vp=2, last=2)
    got = {(p, v): list(chunk_layers(config, p, v)) for p in range(4) for v in range(2)}
    assert got == {(0, 0): [1, 2], (1, 0): [3, 4], (2, 0): [5, 6], (3, 0): [7],
                   (0, 1): [8, 9], (1, 1): [10, 11], (2, 1): [12, 13], (3, 1): [14]}
    # 10 layers, pp=4, 1 on the first and 3 on the last rank, no interleaving.
    config = pipeline_config(10, pp=4, first=1, last=3)
    assert [list(chunk_layers(config, p)) for p in range(4)] == [[1], [2, 3, 4], [5, 6, 7], [8, 9, 10]]


def test_interleaved_chunks_by_hand():
    # Stage 0: layers [1,2] [5,6]; stage 1: [3,4] [7,8].
    config = pipeline_config(8, pp=2, vp=2)
    assert chunk_vp_stages(config) == [0, 1]
    got = {(p, v): list(chunk_layers(config, p, v)) for p in range(2) for v in range(2)}
    assert got == {(0, 0): [1, 2], (1, 0): [3, 4], (0, 1): [5, 6], (1, 1): [7, 8]}
    assert chunk_vp_stages(pipeline_config(8)) == [None] and chunk_layers(pipeline_config(8), 0) == range(1, 9)


def test_chunks_outside_the_pipeline_are_errors():
    config = pipeline_config(8, pp=2, vp=2)
    with pytest.raises(ValueError, match="pp_rank 2"):
        chunk_layers(config, 2, 0)
    with pytest.raises(ValueError, match="vp_stage 2"):
        chunk_layers(config, 0, 2)


def test_custom_pipeline_layout_by_hand(monkeypatch):
    from megatron.core import parallel_state

    # pp=2, vp=2: stages in order (pp0,vp0) (pp1,vp0) (pp0,vp1) (pp1,vp1); 9 decoder layers, uneven.
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)  # not the rank asked about
    config = pipeline_config(9, pp=2, pipeline_model_parallel_layout="Ett|ttt|t|tttL")
    got = {(p, v): list(chunk_layers(config, p, v)) for p in range(2) for v in range(2)}
    assert got == {(0, 0): [1, 2], (1, 0): [3, 4, 5], (0, 1): [6], (1, 1): [7, 8, 9]}


def test_moe_layer_freq_flag_parses_like_megatron():
    from megatron_r3.layers.moe_layers import parse_moe_layer_freq

    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("0,1,1,1") == [0, 1, 1, 1]
    assert parse_moe_layer_freq("[0,1]") == [0, 1]
    with pytest.raises(ValueError, match="--moe-layer-freq must be an int or comma-separated"):
        parse_moe_layer_freq("[0]*3+[1]")
