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
    ids = random_routes(2, 8)
    routing = moe_routing_for_chunk(Wrapper(hybrid), ids, layer_numbers=[2, 4])
    assert routing.layer_numbers == [2, 4]
    assert torch.equal(routing.expert_ids, ids)
    with pytest.raises(ValueError, match=r"lacks MoE layers \[4\] of this chunk"):
        moe_routing_for_chunk(hybrid, ids[:1], layer_numbers=[2])
    with pytest.raises(ValueError, match=r"names layers \[3\], not decoder MoE layers of this 4-layer model "
                                         r"\(its MoE layers: \[2, 4\];"):
        moe_routing_for_chunk(hybrid, random_routes(3, 8), layer_numbers=[2, 3, 4])


@pytest.fixture(scope="module")
def first_stage():
    """The first of two pipeline stages of a model whose MoE layers are 1, 2 and 4: it builds layers 1 and 2."""
    init_single_rank()
    return make_model(make_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                  moe_layer_freq=[1, 1, 0, 1]))


def test_routes_of_other_pipeline_stages_are_cut_to_the_chunk(first_stage):
    assert chunk_moe_layers(first_stage) == [1, 2]
    ids = random_routes(3, 8)
    routing = moe_routing_for_chunk(Wrapper(first_stage), ids, layer_numbers=[1, 2, 4])
    assert routing.layer_numbers == [1, 2]
    assert torch.equal(routing.expert_ids, ids[:2])


@pytest.mark.parametrize("layers, message", [
    ([1, 2, 3], r"names layers \[3\], not decoder MoE layers of this 4-layer model \(its MoE layers: \[1, 2, 4\]; "
                r"MTP layers route live here\): their rows would be dropped"),
    ([9, 1, 2], r"names layers \[9\], not decoder MoE layers"),
])
def test_rows_of_layers_that_are_no_moe_layer_of_the_model_are_refused(first_stage, layers, message):
    with pytest.raises(ValueError, match=message):
        moe_routing_for_chunk(first_stage, random_routes(3, 8), layer_numbers=layers)


def _planted(row, token, values):
    ids = random_routes(3, 8)
    ids[row, token] = torch.tensor(values)
    return ids


@pytest.mark.parametrize("ids, message", [
    (_planted(1, 5, [8, 0]), r"the row of token 5 at layer 3 \[8, 0\] holds an expert id outside \[0, 8\) "
                             r"\(num_experts\)"),
    (_planted(0, 2, [-2, 1]), r"the row of token 2 at layer 2 \[-2, 1\] holds an expert id outside"),
    (_planted(2, 7, [3, 3]), r"the row of token 7 at layer 4 \[3, 3\] names an expert twice"),
    (_planted(2, 1, [-1, 4]), r"the row of token 1 at layer 4 \[-1, 4\] is only partly -1"),
])
def test_ids_on_the_host_are_checked_against_the_model_for_free(model, ids, message):
    """With the device check off (the default): without the host check, an id >= num_experts reached the
    router's gather (a bare "index 8 is out of bounds") and a repeated id the dispatcher's split sizes."""
    assert not model.config.moe_routing_replay_check_values
    with pytest.raises(ValueError, match=message):
        moe_routing_for_chunk(model, ids, layer_numbers=[2, 3, 4])
    moe_routing_for_chunk(model, random_routes(3, 8), layer_numbers=[2, 3, 4])  # the same, valid


@pytest.mark.gpu
def test_a_check_that_needs_the_device_names_the_flag_that_turns_it_on():
    """Routes on the GPU: unchecked by default (a check would sync), checked with the flag, which the error names."""
    init_single_rank()
    ids = random_routes(3, 8).cuda()
    ids[1, 4] = -1
    unchecked = make_model(make_config()).cuda()
    moe_routing_for_chunk(unchecked, ids, every_token_routed=True)
    checked = make_model(make_config(moe_routing_replay_check_values=True)).cuda()
    with pytest.raises(ValueError, match=r"no route \(a row of -1\) for token 4 at layer 3: pass every_token_routed="
                                         r"False \(checked on cuda:0: moe_routing_replay_check_values, "
                                         r"--moe-routing-replay-check-values\)"):
        moe_routing_for_chunk(checked, ids, every_token_routed=True)


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
