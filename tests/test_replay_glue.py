"""megatron_r3.routing_replay: chunk routes and Megatron-style flags."""

import argparse

import pytest
import torch

from megatron_r3.rl.arguments import routing_replay_settings
from megatron_r3.routing_replay import RoutingReplaySettings, add_routing_replay_args, chunk_moe_layers, moe_routing_for_chunk
from tests.support.replay import init_single_rank, make_config, make_hybrid_model, make_model, random_routes


@pytest.fixture(scope="module")
def model():
    init_single_rank()
    return make_model(make_config())


class Wrapper(torch.nn.Module):
    """Stands for DDP / Float16Module: the GPTModel is .module."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_chunk_layers_through_wrappers(model):
    assert chunk_moe_layers(model) == [2, 3, 4]
    assert chunk_moe_layers(Wrapper(Wrapper(model))) == [2, 3, 4]


def test_a_hybrid_model_chunk_gets_routes_for_its_moe_layers():
    init_single_rank()
    hybrid = make_hybrid_model(make_config(), "*E-E")
    assert chunk_moe_layers(Wrapper(hybrid)) == [2, 4]
    ids = random_routes(4, 8)
    routing = moe_routing_for_chunk(Wrapper(hybrid), ids, layer_numbers=[1, 2, 3, 4])
    assert routing.layer_numbers == [2, 4]
    assert torch.equal(routing.expert_ids, ids[[1, 3]])
    with pytest.raises(ValueError, match=r"lacks MoE layers \[4\] of this chunk"):
        moe_routing_for_chunk(hybrid, ids[:2], layer_numbers=[1, 2])


def test_routes_for_more_layers_are_cut_to_the_chunk(model):
    ids = random_routes(5, 8)
    routing = moe_routing_for_chunk(Wrapper(model), ids, layer_numbers=[1, 2, 3, 4, 5])
    assert routing.layer_numbers == [2, 3, 4]
    assert torch.equal(routing.expert_ids, ids[1:4])
    assert torch.equal(moe_routing_for_chunk(model, ids[1:4]).expert_ids, ids[1:4])


def test_routes_missing_a_chunk_layer_are_refused(model):
    with pytest.raises(ValueError, match=r"lacks MoE layers \[4\] of this chunk"):
        moe_routing_for_chunk(model, random_routes(2, 8), layer_numbers=[2, 3])


def test_live_routing_for_recording(model):
    routing = moe_routing_for_chunk(model)
    assert routing.expert_ids is None and routing.layer_numbers == [2, 3, 4]


def test_flags_map_to_config_fields():
    parser = add_routing_replay_args(argparse.ArgumentParser())
    settings = routing_replay_settings(parser.parse_args(["--moe-enable-routing-replay"]))
    assert settings == RoutingReplaySettings(enabled=True)
    assert settings.config_kwargs() == {
        "moe_enable_routing_replay": True,
        "moe_routing_replay_check_values": False,
        "moe_check_host_tokens_per_expert": True,
    }
    make_config(**settings.config_kwargs())
    settings = routing_replay_settings(
        parser.parse_args(["--moe-routing-replay-check-values", "--no-moe-check-host-tokens-per-expert"]))
    assert settings.config_kwargs() == {
        "moe_enable_routing_replay": False,
        "moe_routing_replay_check_values": True,
        "moe_check_host_tokens_per_expert": False,
    }
    assert settings.check_kwargs() == {
        "moe_routing_replay_check_values": True,
        "moe_check_host_tokens_per_expert": False,
    }


def test_a_program_gives_the_enable_flag_its_own_help():
    generic, own = (" ".join(add_routing_replay_args(argparse.ArgumentParser(), **kw).format_help().split())
                    for kw in ({}, {"enable_help": "train on replayed routes"}))
    assert "given as the moe_routing forward input" in generic and "train on replayed routes" not in generic
    assert "train on replayed routes" in own and "given as the moe_routing forward input" not in own
