"""RolloutRoutes: compact dtypes, layer selection, concatenation checks."""

import numpy as np
import pytest
import torch

from megatron_r3.routes import RolloutRoutes, concat_routes, id_dtype, layer_index
from megatron_r3.validation import RoutingValidationError


def test_id_dtype_is_never_wider_than_needed():
    assert id_dtype(1) == np.uint8 and id_dtype(256) == np.uint8
    assert id_dtype(257) == np.int16 and id_dtype(32768) == np.int16
    with pytest.raises(ValueError):
        id_dtype(40000)


def test_from_ids_compacts_and_keeps_no_route_rows():
    ids = torch.tensor([[[3, 1], [-1, -1]], [[255, 0], [7, 2]]])
    r = RolloutRoutes.from_ids(ids, num_experts=256, layer_numbers=(2, 4))
    assert r.ids.dtype == np.uint8 and r.valid.tolist() == [[True, False], [True, True]]
    assert r.ids[0, 1].tolist() == [0, 0]  # invalid rows hold zeros, never read as routes
    assert r.to_int64().tolist() == [[[3, 1], [-1, -1]], [[255, 0], [7, 2]]]
    assert r.nbytes == 8 + 4


def test_layer_numbers_must_increase():
    with pytest.raises(RoutingValidationError, match="increasing"):
        RolloutRoutes.from_ids(np.zeros((1, 2, 1), np.int64), num_experts=4, layer_numbers=(3, 2))


def test_select_layers_and_missing_layer():
    r = RolloutRoutes.from_ids(np.arange(12).reshape(2, 3, 2), num_experts=16, layer_numbers=(1, 3, 5))
    sub = r.select_layers((3, 5))
    assert sub.layer_numbers == (3, 5) and sub.to_int64().tolist() == [[[2, 3], [4, 5]], [[8, 9], [10, 11]]]
    with pytest.raises(RoutingValidationError, match="no MoE layer \\[4\\]"):
        layer_index((1, 3, 5), (3, 4))


def test_concat_checks_samples_agree():
    a = RolloutRoutes.empty(3, num_experts=8, topk=2, layer_numbers=(1, 2))
    b = RolloutRoutes.empty(2, num_experts=8, topk=2, layer_numbers=(1, 2))
    ids, valid = concat_routes([a, b])
    assert ids.shape == (5, 2, 2) and valid.shape == (5, 2)
    with pytest.raises(RoutingValidationError, match="sample 1"):
        concat_routes([a, RolloutRoutes.empty(2, num_experts=8, topk=2, layer_numbers=(1, 3))])
