"""RolloutRoutes: compact dtypes, per-token validity, layer selection, concatenation checks."""

import numpy as np
import pytest
import torch

from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.dataplane.routes import RolloutRoutes, concat_routes, id_dtype, layer_index


def test_id_dtype_is_never_wider_than_needed():
    assert id_dtype(1) == np.uint8 and id_dtype(256) == np.uint8
    assert id_dtype(257) == np.int16 and id_dtype(32768) == np.int16
    with pytest.raises(ValueError):
        id_dtype(40000)


def test_from_ids_compacts_and_keeps_tokens_without_route():
    ids = torch.tensor([[[3, 1], [7, 2]], [[-1, -1], [-1, -1]], [[255, 0], [4, 5]]])
    r = RolloutRoutes.from_ids(ids, num_experts=256, layer_numbers=(2, 4))
    assert r.ids.dtype == np.uint8 and r.valid.tolist() == [True, False, True]
    assert not r.ids[1].any()  # a token without a route holds zeros, never read as a route
    assert r.to_int64().tolist() == ids.tolist()
    assert r.nbytes == r.ids.nbytes + r.num_tokens == 12 + 3  # one validity byte per token


def test_a_token_replays_at_every_layer_or_at_none():
    ids = np.array([[[3, 1], [7, 2], [0, 1]], [[1, 2], [-1, -1], [-1, -1]], [[-1, -1], [5, 6], [-1, -1]]])
    with pytest.raises(
        RoutingValidationError,
        match=r"sample 4: token 1, layer 4: no route \(a row of -1\) at this layer but routes at others; "
        r"a token replays at every MoE layer or at none \(2 partial tokens in total\)",
    ):
        RolloutRoutes.from_ids(ids, num_experts=8, layer_numbers=(2, 4, 6), sample=4)
    # A per-token mask decides instead; a per-(token, layer) one is the old layout and is refused.
    r = RolloutRoutes.from_ids(ids, num_experts=8, layer_numbers=(2, 4, 6), valid=np.array([True, False, False]))
    assert r.to_int64()[1:].tolist() == [[[-1, -1]] * 3] * 2
    with pytest.raises(RoutingValidationError, match=r"validity must be bool per token \(3,\)"):
        RolloutRoutes.from_ids(ids, num_experts=8, layer_numbers=(2, 4, 6), valid=np.ones((3, 3), np.bool_))
    with pytest.raises(RoutingValidationError, match="token 1, layer 4: expert id outside"):
        RolloutRoutes.from_ids(ids, num_experts=8, layer_numbers=(2, 4, 6), valid=np.array([True, True, False]))


def test_layer_numbers_must_increase():
    with pytest.raises(RoutingValidationError, match="increasing"):
        RolloutRoutes.from_ids(np.zeros((1, 2, 1), np.int64), num_experts=4, layer_numbers=(3, 2))


def test_select_layers_and_missing_layer():
    ids = np.arange(18).reshape(3, 3, 2)
    ids[1] = -1
    r = RolloutRoutes.from_ids(ids, num_experts=18, layer_numbers=(1, 3, 5))
    sub = r.select_layers((3, 5))
    assert sub.layer_numbers == (3, 5) and sub.valid.tolist() == [True, False, True]
    assert sub.to_int64().tolist() == [[[2, 3], [4, 5]], [[-1, -1], [-1, -1]], [[14, 15], [16, 17]]]
    with pytest.raises(RoutingValidationError, match="no MoE layer \\[4\\]"):
        layer_index((1, 3, 5), (3, 4))


def test_concat_checks_samples_agree():
    a = RolloutRoutes.empty(3, num_experts=8, topk=2, layer_numbers=(1, 2))
    b = RolloutRoutes.empty(2, num_experts=8, topk=2, layer_numbers=(1, 2))
    ids, valid = concat_routes([a, b])
    assert ids.shape == (5, 2, 2) and valid.shape == (5,)
    with pytest.raises(RoutingValidationError, match="sample 1"):
        concat_routes([a, RolloutRoutes.empty(2, num_experts=8, topk=2, layer_numbers=(1, 3))])
