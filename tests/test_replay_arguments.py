"""moe_routing_for_chunk checks its arguments against each other and the model, naming the argument.

A stub chunk stands in for the first of three pipeline stages of a GPTModel whose MoE layers are 2, 4
and 6 (what the check reads: its MoE layers and the model's, its config's top-k, experts and value
check, its parameters' device).
"""

import types

import pytest
import torch

from megatron_r3.routing_replay import moe_routing_for_chunk


class StubChunk(torch.nn.Module):
    def __init__(self, moe_layers=(2, 4), topk=2, check_values=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.decoder = types.SimpleNamespace(moe_layer_numbers=list(moe_layers))
        self.config = types.SimpleNamespace(moe_router_topk=topk, moe_routing_replay_check_values=check_values,
                                            num_layers=6, moe_layer_freq=[0, 1] * 3, num_moe_experts=4)


def routes(layers=2, tokens=3, topk=2):
    return torch.arange(layers * tokens * topk, dtype=torch.int64).reshape(layers, tokens, topk) % 4


def with_no_route(ids, row, token):
    ids = ids.clone()
    ids[row, token] = -1
    return ids


BAD_ARGUMENTS = [
    ("a list", dict(expert_ids=[[[0, 1]]]), "expert_ids must be a torch.Tensor, got list"),
    ("int32", dict(expert_ids=routes().int()), r"expert_ids must be int64 \(the routers gather with it\), got "
                                                r"torch.int32: pass expert_ids.long\(\)"),
    ("two dims", dict(expert_ids=routes()[0]), r"expert_ids must be \[layers, tokens, topk\], got shape \(3, 2\)"),
    ("meta device", dict(expert_ids=routes().to("meta")), "expert_ids is on meta, the model on cpu"),
    ("top-3", dict(expert_ids=routes(topk=3)), r"expert_ids holds 3 experts per token \(dim 2\), the model's "
                                               r"moe_router_topk is 2"),
    ("more layers than rows", dict(expert_ids=routes(), layer_numbers=[2, 4, 6]),
     r"layer_numbers has 3 layers \[2, 4, 6\], expert_ids 2 rows \(dim 0\): one row per layer"),
    ("fewer layers than rows", dict(expert_ids=routes(layers=3), layer_numbers=[2, 4]),
     r"layer_numbers has 2 layers \[2, 4\], expert_ids 3 rows"),
    ("rows without layer numbers", dict(expert_ids=routes(layers=3)),
     r"the chunk's MoE layers \(layer_numbers not given\) has 2 layers \[2, 4\], expert_ids 3 rows"),
    ("a layer twice", dict(expert_ids=routes(), layer_numbers=[4, 4]), r"layer_numbers \[4, 4\] names a layer twice"),
    ("a layer missing", dict(expert_ids=routes(), layer_numbers=[2, 6]),
     r"layer_numbers \[2, 6\] lacks MoE layers \[4\] of this chunk \(it builds \[2, 4\]\)"),
    ("host counts of 1 layer", dict(expert_ids=routes(), every_token_routed=True,
                                    host_tokens_per_expert=torch.zeros(1, 1, 4, dtype=torch.int64)),
     r"host_tokens_per_expert must be \[tp_ep_size, 2 layers, num_experts\], got shape \(1, 1, 4\)"),
    ("no route, every token routed", dict(expert_ids=with_no_route(routes(), 1, 2), every_token_routed=True),
     r"every_token_routed=True, but expert_ids has no route \(a row of -1\) for token 2 at layer 4: pass "
     r"every_token_routed=False"),
]


@pytest.mark.parametrize("case, arguments, message", BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_replay_arguments_that_do_not_fit_are_refused_naming_the_argument(case, arguments, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        moe_routing_for_chunk(StubChunk(), **arguments)


def test_fitting_arguments_give_the_chunks_rows():
    ids = routes(layers=3)
    routing = moe_routing_for_chunk(StubChunk(), ids, [2, 6, 4])  # a layer another stage builds is dropped
    assert routing.layer_numbers == [2, 4] and torch.equal(routing.expert_ids, ids[[0, 2]])
    # Rows of -1 are fine where the live router decides them.
    assert moe_routing_for_chunk(StubChunk(), with_no_route(routes(), 0, 0)).every_token_routed is False
    assert moe_routing_for_chunk(StubChunk(), routes(), every_token_routed=True).every_token_routed


def test_a_chunks_rows_are_taken_without_an_index_tensor():
    """The rows are picked by Python indices (an index tensor's host-to-device copy would wait for the stream, or,
    non-blocking, leave its host buffer in a CUDA graph capture): consecutive rows, as when the routes of every
    stage are given in layer order, stay a view of the caller's tensor; rows in another order are stacked."""
    ids = routes(layers=3)
    every_stage = moe_routing_for_chunk(StubChunk(moe_layers=(4, 6)), ids, [2, 4, 6])
    assert torch.equal(every_stage.expert_ids, ids[1:])
    assert every_stage.expert_ids.data_ptr() == ids[1].data_ptr() and every_stage.expert_ids.is_contiguous()
    shuffled = moe_routing_for_chunk(StubChunk(moe_layers=(2, 6)), ids, [6, 4, 2])
    assert shuffled.layer_numbers == [2, 6] and torch.equal(shuffled.expert_ids, ids[[2, 0]])
    assert shuffled.expert_ids.data_ptr() != ids.data_ptr()
    dense_stage = moe_routing_for_chunk(StubChunk(moe_layers=()), ids, [2, 4, 6],
                                        host_tokens_per_expert=torch.zeros(1, 3, 4, dtype=torch.int64))
    assert dense_stage.layer_numbers == [] and dense_stage.expert_ids.shape == (0, 3, 2)
