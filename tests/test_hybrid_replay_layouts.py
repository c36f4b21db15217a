"""Routing replay through a HybridModel under parallel layouts.

The first test builds the stages of ``*E-|E*E`` by hand with the weights of one whole model,
runs Megatron's 1F1B schedule with forced random routes (every 5th token without a route),
and must take exactly the forced routes, with the loss and every gradient of a single-rank
run of the whole pattern. The others run the replay matrix of tests/test_replay_layouts.py on
the tiny MoE as a HybridModel (``--hybrid-layer-pattern``, the same layers as the GPT's:
dense, MoE, dense, MoE), the pipeline stages and virtual stages from the pattern's ``|``.
"""

from functools import partial

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.layers.hybrid_specs import get_hybrid_stack_r3_spec
from megatron_r3.layers.moe_layers import hybrid_moe_layers
from megatron_r3.routing_replay import chunk_moe_layers, moe_routing_for_chunk
from tests.support.harness import Step
from tests.support.launcher import run_workers
from tests.support.parallel import Layout
from tests.support.replay_layouts import random_forced_routes, run_replay_layout
from tests.support.tiny_moe import TinyMoE
from tests.test_layouts import BSHD_DATA
from tests.test_replay_layouts import assert_replay_matches, replay_reference

pytestmark = pytest.mark.slow

PATTERN = "*E-|E*E"
NUM_EXPERTS, TOPK, VOCAB, SEQ, BATCH, MICROBATCHES = 8, 2, 64, 8, 2, 3


def _config(pp):
    return TransformerConfig(
        num_layers=6, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_enable_routing_replay=True, use_cpu_initialization=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, is_hybrid_model=True,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, batch_p2p_comm=False,
        calculate_per_token_loss=True,
    )


def _model(config, pattern, pre_process=True, post_process=True):
    torch.manual_seed(5)
    return HybridModel(config, get_hybrid_stack_r3_spec(pattern, NUM_EXPERTS), vocab_size=VOCAB,
                       max_sequence_length=64, hybrid_layer_pattern=pattern, position_embedding_type="rope",
                       pre_process=pre_process, post_process=post_process)


def _stage_of_whole(config, pp_rank):
    """This rank's stage, with the weights of the whole model (its layers at their global numbers)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)  # the whole model, built on every rank
    whole = _model(_config(1), PATTERN.replace("|", "")).state_dict()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, config.pipeline_model_parallel_size)
    stage = _model(config, PATTERN, pre_process=pp_rank == 0, post_process=pp_rank == 1)
    offset = 3 * pp_rank
    own = {}
    for name in stage.state_dict():
        source = name
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            source = f"decoder.layers.{int(index) + offset}.{rest}"
        own[name] = whole[source]
    stage.load_state_dict(own)
    return stage


def _forced():
    """{layer: int64 [MICROBATCHES, SEQ * BATCH, TOPK]} in the router's (s-major) token order."""
    gen = torch.Generator().manual_seed(3)
    out = {}
    for layer in hybrid_moe_layers(PATTERN):
        ids = torch.rand(MICROBATCHES, SEQ * BATCH, NUM_EXPERTS, generator=gen).topk(TOPK, -1).indices
        ids[:, ::5] = -1
        out[layer] = ids
    return out


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(MICROBATCHES)]


def _run(pp):
    parallel_state.initialize_model_parallel(1, pp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = _config(pp)
    model = _stage_of_whole(config, pp_rank) if pp > 1 else _model(config, PATTERN.replace("|", ""))
    forced, batches = _forced(), iter(enumerate(_batches()))
    taken = {}
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(
                lambda router, args, out: taken.setdefault(router.layer_number, []).append(out[1].clone()))

    def forward_step(data_iterator, chunk):
        index, (tokens, labels) = next(data_iterator)
        layers = chunk_moe_layers(chunk)
        routing = moe_routing_for_chunk(chunk, torch.stack([forced[n][index] for n in layers]), layers)
        losses = chunk(tokens, torch.arange(SEQ).expand(BATCH, -1), None, labels=labels,
                       extra_block_kwargs={"moe_routing": routing})
        return losses, lambda out: (out.sum(), torch.tensor(out.numel()), {"losses": out.detach()})

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches, model=[model], num_microbatches=MICROBATCHES,
        seq_length=SEQ, micro_batch_size=BATCH, forward_only=False,
    )
    offset = 3 * pp_rank if pp > 1 else 0
    grads = {}
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(index) + offset}.{rest}"
        grads[name] = param.grad.clone()
    return {"losses": [r["losses"] for r in results], "taken": taken, "grads": grads,
            "moe_layers": chunk_moe_layers(model)}


def test_pp2_stages_split_by_the_pattern_replay_forced_routes():
    (reference,) = run_workers(_run, 1, 1)
    stages = run_workers(_run, 2, 2)
    assert [s["moe_layers"] for s in stages] == [[2], [4, 6]]
    forced = _forced()
    for result in [reference, *stages]:
        for layer, maps in result["taken"].items():
            for index, routing_map in enumerate(maps):
                ids = forced[layer][index]
                routed = (ids >= 0).all(dim=-1)
                want = torch.zeros(ids.shape[0], NUM_EXPERTS, dtype=torch.bool)
                want[routed] = want[routed].scatter(1, ids[routed], True)
                assert torch.equal(routing_map[routed], want[routed]), (layer, index)
    for layer in hybrid_moe_layers(PATTERN):
        staged = next(s["taken"][layer] for s in stages if layer in s["taken"])
        assert all(torch.equal(a, b) for a, b in zip(staged, reference["taken"][layer]))
    for got, want in zip(stages[1]["losses"], reference["losses"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    grads = {**stages[0]["grads"], **stages[1]["grads"]}
    routers = [name for name in reference["grads"] if name.endswith("router.weight")]
    assert len(routers) == 3 and all(reference["grads"][name].abs().sum() > 0 for name in routers)
    assert grads.keys() == reference["grads"].keys()
    for name, want in reference["grads"].items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)


WHOLE = "*-*E*-*E"
# Layout name: (layout, the pattern it runs: its '|' segments are the layout's pipeline stages).
HYBRID_LAYOUTS = {
    "tp2-sp": (Layout(tp=2, sp=True), WHOLE),
    "ep2-dp2-alltoall": (Layout(ep=2, dp=2, dispatcher="alltoall"), WHOLE),
    "cp2": (Layout(cp=2), WHOLE),
    "pp2-split-by-pattern": (Layout(pp=2), "*-*E|*-*E"),
    "pp2-vp2-split-by-pattern": (Layout(pp=2), "*-|*E|*-|*E"),
    "pp2-even-split": (Layout(pp=2), WHOLE),
}
HYBRID_FORCED = random_forced_routes(TinyMoE(hybrid_layer_pattern=WHOLE), BSHD_DATA.num_tokens, 13, 7)


@pytest.fixture(scope="module")
def hybrid_replay_reference():
    step = Step(model=TinyMoE(hybrid_layer_pattern=WHOLE))
    (result,) = run_workers(run_replay_layout, 1, Layout(), BSHD_DATA, step, HYBRID_FORCED)
    return replay_reference(result, BSHD_DATA, HYBRID_FORCED)


@pytest.mark.parametrize("name", sorted(HYBRID_LAYOUTS))
def test_hybrid_layout_replays_forced_routes(name, hybrid_replay_reference):
    layout, pattern = HYBRID_LAYOUTS[name]
    step = Step(model=TinyMoE(hybrid_layer_pattern=pattern))
    results = run_workers(run_replay_layout, layout.world_size, layout, BSHD_DATA, step, HYBRID_FORCED)
    assert_replay_matches(hybrid_replay_reference, results, BSHD_DATA)
