"""Seeded weights are the same full tensors under every layout; full weights load onto shards."""

import pytest
import torch

from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt
from tests.support.weights import assemble, load_full, param_values

MODEL = TinyMoE()


def sharded_weights(layout: Layout, seed: int, full=None):
    """This rank's parameters as (Shard, value), built from ``seed`` or loaded from ``full``."""
    init_parallel(layout)
    _, chunks = build_gpt(layout, MODEL, seed)
    if full is not None:
        load_full(chunks, full)
    return param_values(chunks)


@pytest.fixture(scope="module")
def reference():
    return assemble(run_workers(sharded_weights, 1, Layout(), 3))


def test_reference_names_are_single_rank_names(reference):
    layers = {int(name.split(".")[2]) for name in reference if name.startswith("decoder.layers.")}
    assert layers == set(range(MODEL.num_layers))
    for layer in MODEL.moe_layers:
        for expert in range(MODEL.num_experts):
            name = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight"
            assert name in reference
    assert "decoder.layers.0.mlp.linear_fc1.weight" in reference  # dense first layer


@pytest.mark.parametrize(
    "layout",
    [
        Layout(tp=2, sp=True, ep=2, etp=1, dp=2),
        Layout(pp=2, vp=2),
        Layout(pp=2, first_stage_layers=1),
    ],
    ids=lambda layout: layout.name,
)
def test_shards_assemble_to_the_same_full_weights(layout, reference):
    seeded = assemble(run_workers(sharded_weights, layout.world_size, layout, 3))
    loaded = assemble(run_workers(sharded_weights, layout.world_size, layout, 4, full=reference))
    assert seeded.keys() == reference.keys() == loaded.keys()
    for name, full in reference.items():
        assert torch.equal(seeded[name], full), name
        assert torch.equal(loaded[name], full), name
