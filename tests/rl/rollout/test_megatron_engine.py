"""Megatron's inference engine as the loop's rollout engine: where it runs, its finished requests as samples,
its router recording kept to its own routers; on a GPU, the loop replaying the routes it records."""

import dataclasses
import importlib.metadata
import sys

import numpy as np
import pytest
import torch
from megatron.core.inference.inference_request import DynamicInferenceRequest, DynamicInferenceRequestRecord, Status
from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.route_checks import RoutingValidationError
from megatron_r3.rl.rollout import megatron_engine
from megatron_r3.rl.arguments import model_settings, parse_args, rollout_engine_settings
from megatron_r3.rl.model.factory import ModelSettings, ParallelSettings, transformer_config
from megatron_r3.rl.rollout.megatron_engine import (
    MegatronRolloutEngine,
    flash_attention_problem,
    megatron_engine_problem,
    recording_with,
    finished_request,
    sample_from_request,
)
from megatron_r3.rl.rollout.engine import RolloutEngineError, SamplingParams
from megatron_r3.rl.rollout.engine_choice import (
    RolloutEngineSettings,
    graph_safe_rng_tracker,
    graphed_engine_config,
    resolve_rollout_engine,
)
from megatron_r3.routing_replay import moe_routing_for_chunk
from tests.support.launcher import run_workers
from tests.support.parallel import Layout, init_parallel
from tests.support.tiny_moe import TinyMoE, build_gpt
from tests.test_launch import EMBEDDED_FLAGS, train_worker

SPEC = RoutingSpec(num_layers=4, model_moe_layers=(2, 4), num_experts=4, topk=2)


DEFAULT_MODEL = model_settings(parse_args([]))


def _model(hybrid_layer_pattern=None, **parallel) -> ModelSettings:
    """The launcher's default model under ``parallel`` sizes, or a HybridModel of ``hybrid_layer_pattern``."""
    if hybrid_layer_pattern is not None:
        return model_settings(parse_args(["--hybrid-layer-pattern", hybrid_layer_pattern]))
    return dataclasses.replace(DEFAULT_MODEL, parallel=ParallelSettings(**parallel))


def _resolve(requested, device, model=DEFAULT_MODEL):
    return resolve_rollout_engine(requested, model, torch.device(device))


def test_a_cpu_run_defaults_to_the_built_in_engine_and_refuses_megatrons_naming_cuda():
    assert _resolve(None, "cpu") == "local"
    assert _resolve("local", "cpu") == "local"
    with pytest.raises(ValueError, match=r"--rollout-engine megatron cannot run here: it needs CUDA and this run "
                                         r"computes on cpu: .*torch\.cuda\.current_device.*--rollout-engine local"):
        _resolve("megatron", "cpu")


def test_without_flash_attention_megatrons_engine_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(megatron_engine, "flash_attention_problem", lambda: "flash-attn is not installed")
    assert megatron_engine_problem(_model(), torch.device("cuda")) == "flash-attn is not installed"
    with pytest.raises(ValueError, match="cannot run here: flash-attn is not installed"):
        _resolve("megatron", "cuda")
    assert _resolve(None, "cuda") == "local"


@pytest.mark.parametrize("field, flag", [("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                                         ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                                         ("context_parallel_size", "--context-parallel-size"),
                                         ("expert_model_parallel_size", "--expert-model-parallel-size"),
                                         ("virtual_pipeline_model_parallel_size",
                                          "--num-virtual-stages-per-pipeline-rank")])
def test_megatrons_engine_needs_a_replica_of_one_gpu_with_one_expert_rank(monkeypatch, field, flag):
    monkeypatch.setattr(megatron_engine, "flash_attention_problem", lambda: None)
    assert megatron_engine_problem(_model(), torch.device("cuda")) is None
    problem = megatron_engine_problem(_model(**{field: 2}), torch.device("cuda"))
    assert problem.endswith(f"this run has {flag} 2")


def test_a_hybrid_model_generates_on_the_built_in_engine(monkeypatch):
    monkeypatch.setattr(megatron_engine, "flash_attention_problem", lambda: None)
    hybrid = _model(hybrid_layer_pattern="*E*E")
    problem = megatron_engine_problem(hybrid, torch.device("cuda"))
    assert problem.endswith("this run builds a HybridModel (--hybrid-layer-pattern '*E*E')")
    assert _resolve(None, "cuda", hybrid) == "local"


@pytest.mark.parametrize("flash_attention_4", [True, False])
def test_a_head_dim_flash_attn_4_cannot_page_is_refused_naming_it(monkeypatch, flash_attention_4):
    """flash-attn-4 reads Megatron's paged KV cache only for head dims that are multiples of 16 (on an H200 a head
    dim of 8 failed inside its kernel with "Paged KV does not support irregular head dim")."""
    monkeypatch.setattr(megatron_engine, "flash_attention_problem", lambda: None)
    monkeypatch.setattr(megatron_engine, "flash_attention_4_runs", lambda: flash_attention_4)
    narrow = dataclasses.replace(DEFAULT_MODEL, hidden_size=32)  # 4 heads of 8
    problem = megatron_engine_problem(narrow, torch.device("cuda"))
    if flash_attention_4:
        assert problem == ("its attention runs flash-attn-4 here, whose paged KV cache takes head dims that are "
                           "multiples of 16, and this model's is 8 (--hidden-size 32 / --num-attention-heads 4)")
        assert _resolve(None, "cuda", narrow) == "local"
    else:  # flash-attn 2 and 3 read the cache at any head dim they take
        assert problem is None
    assert megatron_engine_problem(DEFAULT_MODEL, torch.device("cuda")) is None  # 4 heads of 32


@pytest.mark.parametrize("requested", [None, "megatron", "local"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_the_rng_tracker_is_graph_safe_where_megatrons_engine_captures_graphs(monkeypatch, requested, cuda_graphs):
    """Megatron's graph managers assert a graph-safe tracker when they are built, so the launcher seeds one
    where Megatron's engine generates with CUDA graphs; elsewhere it keeps Megatron's default tracker."""
    monkeypatch.setattr(megatron_engine, "flash_attention_problem", lambda: None)
    settings = RolloutEngineSettings(requested, SamplingParams(1.0, 4, stop_token=0, seed=1), cuda_graphs=cuda_graphs)
    megatrons = cuda_graphs and requested != "local"
    assert graph_safe_rng_tracker(settings, DEFAULT_MODEL, torch.device("cuda")) == megatrons
    assert not graph_safe_rng_tracker(settings if requested != "megatron" else None, DEFAULT_MODEL,
                                      torch.device("cpu"))
    assert not graph_safe_rng_tracker(None, DEFAULT_MODEL, torch.device("cuda"))  # rollouts from a dump


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_the_graph_scope_flag_sets_what_megatrons_engine_captures(scope):
    """--inference-cuda-graph-scope block makes the transformer block own the engine's graphs (Megatron's
    InferenceCudaGraphScope.block); layer, the default, leaves the scope of the config built without graphs,
    under which each layer's graph manager captures on the engine's first steps. The copy leaves the config
    it came from without graphs."""
    from megatron.core.transformer.enums import InferenceCudaGraphScope

    settings = rollout_engine_settings(parse_args(["--inference-cuda-graph-scope", scope]))
    assert settings.graph_scope == scope
    config = transformer_config(DEFAULT_MODEL, torch.device("cpu"), rollout_engine=True)
    graphed = graphed_engine_config(config, settings.graph_scope)
    assert graphed.cuda_graph_impl == "local" and config.cuda_graph_impl == "none"
    expected = InferenceCudaGraphScope.block if scope == "block" else config.inference_cuda_graph_scope
    assert graphed.inference_cuda_graph_scope == expected != InferenceCudaGraphScope.layer
    engine = object.__new__(MegatronRolloutEngine)
    engine.chunks = [type("Chunk", (), {"config": graphed})()]
    assert engine.graph_owner == ("of the whole transformer block" if scope == "block" else "per layer")


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_the_launcher_builds_megatrons_engine_on_the_graph_scope_it_was_given(monkeypatch, scope):
    """build_rollout_engine hands Megatron's engine a model built on the graphed config of --inference-cuda-graph-
    scope (the engine itself stood in: it needs CUDA)."""
    from megatron.core.transformer.enums import InferenceCudaGraphScope

    from megatron_r3.rl.rollout import engine_choice

    built, engines = [], []
    monkeypatch.setattr(engine_choice, "resolve_rollout_engine", lambda *args: "megatron")
    monkeypatch.setattr(engine_choice, "graphs_apply", lambda model: True)
    monkeypatch.setattr(engine_choice, "build_model", lambda model, config, device: built.append(config) or [])
    monkeypatch.setattr(engine_choice.tensor_parallel, "get_cuda_rng_tracker",
                        lambda: type("Tracker", (), {"use_cudagraphable_rng": True})())
    monkeypatch.setattr(engine_choice, "MegatronRolloutEngine",
                        lambda make_chunks, *args, **kwargs: engines.append((make_chunks(), kwargs)))
    settings = rollout_engine_settings(parse_args(["--inference-cuda-graph-scope", scope]))
    engine_choice.build_rollout_engine(settings, DEFAULT_MODEL, torch.device("cpu"), [], SPEC, rows=None,
                                       per_rank=4, max_sample_tokens=32)
    assert len(engines) == 1 and engines[0][1]["num_cuda_graphs"] == engine_choice.MEGATRON_ENGINE_CUDA_GRAPHS
    probe, engine_model = built  # the replica graphs_apply looks at, then the engine's
    assert probe.cuda_graph_impl == "none" and engine_model.cuda_graph_impl == "local"
    assert (engine_model.inference_cuda_graph_scope == InferenceCudaGraphScope.block) == (scope == "block")


def test_an_unknown_graph_scope_is_refused_naming_the_flag():
    assert parse_args([]).inference_cuda_graph_scope == "layer"
    with pytest.raises(ValueError, match=r"--inference-cuda-graph-scope must be one of \('layer', 'block'\), "
                                         r"got 'none'"):
        RolloutEngineSettings(None, SamplingParams(1.0, 4, stop_token=0, seed=1), graph_scope="none")


def _request(prompt, generated, logprobs, routing, status=Status.COMPLETED):
    return DynamicInferenceRequest(request_id=7, prompt_tokens=torch.tensor(prompt), generated_tokens=list(generated),
                                   generated_log_probs=logprobs, routing_indices=routing, status=status,
                                   sampling_params=MegatronSamplingParams())


def _routing(tokens, seed=0):
    """int16 ``[tokens - 1, MoE layers, topk]`` of distinct experts, as the engine rebuilds them from its blocks."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(SPEC.num_experts, SPEC.topk, replace=False) for _ in SPEC.model_moe_layers]
                     for _ in range(tokens - 1)]).astype(np.int16)


def test_a_finished_request_becomes_a_sample_with_its_completion_logprobs_and_routes():
    routing = _routing(6)
    sample = sample_from_request(_request([5, 6, 7], [9, 3, 1], [-0.5, -1.25, -0.125], routing), SPEC, sample=0)
    assert sample.token_ids.tolist() == [5, 6, 7, 9, 3, 1]
    assert sample.loss_mask.tolist() == [False, False, False, True, True, True]
    assert sample.logprobs.tolist() == [0, 0, 0, -0.5, -1.25, -0.125]  # no loss sees the prompt's
    assert sample.routes.valid.tolist() == [True] * 5 + [False]  # the final sampled token never ran
    np.testing.assert_array_equal(sample.routes.ids[:5], routing)


def test_a_record_of_one_request_is_that_request_and_one_of_pieces_is_their_merge():
    """A record the engine never split is taken as it is, not rebuilt by Megatron's merge; one split by a
    suspension (its pieces: the prompt and the first tokens, then all of them as the prompt and the rest) is
    merged, and both give the same sample as the merge would."""
    routing = _routing(6)
    whole = DynamicInferenceRequestRecord.from_request(_request([5, 6, 7], [9, 3, 1], [-0.5, -1.25, -0.125],
                                                                routing))
    assert finished_request(whole) is whole.requests[0]
    first = _request([5, 6, 7], [9], [-0.5], routing[:3], status=Status.ACTIVE_BUT_NOT_GENERATING_TOKENS)
    first.sampling_params.num_tokens_to_generate = 3
    split = DynamicInferenceRequestRecord.from_request(first)
    split.checkpoint()
    split.requests[-1].generated_tokens, split.requests[-1].generated_log_probs = [3, 1], [-1.25, -0.125]
    split.requests[-1].routing_indices, split.requests[-1].status = routing[3:], Status.COMPLETED
    merged = finished_request(split)
    assert merged is not split.requests[-1] and merged.generated_tokens == [9, 3, 1]
    for request in (whole.requests[0], merged):
        sample = sample_from_request(request, SPEC, sample=0)
        assert sample.token_ids.tolist() == [5, 6, 7, 9, 3, 1]
        assert sample.logprobs.tolist() == [0, 0, 0, -0.5, -1.25, -0.125]
        np.testing.assert_array_equal(sample.routes.ids[:5], routing)


def test_a_failed_request_is_refused_naming_the_sample():
    request = _request([5, 6, 7], [], [], None, status=Status.FAILED)
    with pytest.raises(RolloutEngineError, match="sample 3 ended FAILED, not COMPLETED"):
        sample_from_request(request, SPEC, sample=3)


def test_a_request_without_logprobs_or_routes_is_refused():
    with pytest.raises(RolloutEngineError, match="sample 1 has 2 generated tokens and no log-probs"):
        sample_from_request(_request([5, 6], [9, 1], None, _routing(4)), SPEC, sample=1)
    with pytest.raises(RoutingValidationError, match="sample 2: Megatron returned no routing_indices"):
        sample_from_request(_request([5, 6], [9, 1], [-1.0, -2.0], None), SPEC, sample=2)
    repeated = _routing(4)
    repeated[2, 1] = [3, 3]
    with pytest.raises(RoutingValidationError, match="sample 4"):
        sample_from_request(_request([5, 6], [9, 1], [-1.0, -2.0], repeated), SPEC, sample=4)


def test_recording_is_kept_to_the_engines_routers_and_cleared_after():
    before = list(RouterReplay.global_router_replay_instances)
    others, ours = RouterReplay(), RouterReplay()  # the policy's router, the engine's
    try:
        with recording_with([ours]):
            assert RouterReplay.global_router_replay_instances == [ours]
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)  # as the engine does
            ours.record_indices(torch.tensor([[0, 1]]))
        assert RouterReplay.global_router_replay_instances == before + [others, ours]
        assert others.router_replay_action is None and ours.router_replay_action is None
        assert ours.get_recorded_indices() is None
    finally:
        RouterReplay.global_router_replay_instances[:] = before


# On a GPU where Megatron's engine runs: the loop with it trains on the routes it records.

needs_megatron_engine = pytest.mark.skipif(
    torch.cuda.is_available() and flash_attention_problem() is not None,
    reason="Megatron's dynamic engine needs flash-attn >= 2.7.3 (or FA3/FA4)")

MODEL = TinyMoE(vocab_size=48, hidden_size=64)  # 4 heads of 16: flash-attn-4 pages it
# Completions of 6 tokens, and of 200: a request's KV then spans two of flash-attn-4's 128-token key
# tiles, where its split heuristic splits the KV (which it cannot on SM90: patch non-replay 0003).
GREEDY = {"short": (MODEL, 6),
          "past-one-key-tile": (TinyMoE(vocab_size=48, hidden_size=64, max_sequence_length=256), 200)}


def _greedy_worker(model_shape, max_new):
    from megatron.core import parallel_state

    device = init_parallel(Layout())
    try:
        flags = ["--moe-enable-routing-replay", "--bf16"]  # flash attention takes bf16
        config, policy = build_gpt(Layout(), model_shape, seed=4, device=device, flags=flags)
        prompts = [np.random.default_rng(i).integers(1, model_shape.vocab_size, size=3 + i) for i in range(8)]
        engine = MegatronRolloutEngine(
            lambda: build_gpt(Layout(), model_shape, seed=4, device=device, flags=flags)[1], policy,
            RoutingSpec.from_config(config), SamplingParams(1.0, max_new, stop_token=-1, seed=11), staleness=0,
            max_requests=len(prompts), max_sequence_length=model_shape.max_sequence_length, top_k=1)
        engine.weights.advance()
        samples = engine.generate(prompts, iteration=1)
        # The same weights without a KV cache: each sequence in one causal forward, replaying the routes the
        # engine recorded (a router near a tie could otherwise pick other experts on a bf16 rounding), whose
        # logits at every generated position are what the engine's argmax saw.
        model, gaps, argmax = engine.chunks[0], [], 0
        with torch.no_grad():
            for prompt, sample in zip(prompts, samples):
                ids = torch.as_tensor(sample.token_ids, device=device)[None]
                expert_ids = torch.as_tensor(sample.routes.ids.astype(np.int64), device=device).permute(1, 0, 2)
                expert_ids[:, torch.as_tensor(~sample.routes.valid, device=device)] = -1  # the final token: live
                routing = moe_routing_for_chunk(model, expert_ids.contiguous())
                logits = model(ids, torch.arange(ids.size(1), device=device)[None], None,
                               extra_block_kwargs={"moe_routing": routing})[0].float()
                steps = logits[len(prompt) - 1:-1]
                drawn = ids[0, len(prompt):]
                top = steps.max(-1).values
                gaps.append(((top - steps.gather(1, drawn[:, None])[:, 0]) / top.abs().clamp(min=1)).tolist())
                argmax += int((steps.argmax(-1) == drawn).sum())
        return {"prompts": [p.tolist() for p in prompts], "got": [s.token_ids.tolist() for s in samples],
                "gaps": gaps, "argmax": argmax, "routed": [int(s.routes.valid.sum()) for s in samples]}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@needs_megatron_engine
@pytest.mark.parametrize("completion", sorted(GREEDY))
def test_megatrons_greedy_decoding_draws_the_argmax_of_the_full_forward(completion):
    model_shape, max_new = GREEDY[completion]
    ((result),) = run_workers(_greedy_worker, 1, model_shape, max_new, backend="nccl", timeout=300)
    assert [tokens[:len(prompt)] for prompt, tokens in zip(result["prompts"], result["got"])] == result["prompts"]
    assert [len(tokens) - len(prompt) for prompt, tokens in zip(result["prompts"], result["got"])] == [max_new] * 8
    # Each token is the argmax of the reference's logits, or within a few bf16 roundings of it (relative to
    # the top logit): the paged attention and the full one round differently, so a near-tie may go either
    # way (on an H200 the eighth short sequence parted from the full model's greedy one at its third
    # generated token; past one key tile, with the routers routing live, a drawn token's logit was 13%
    # below the reference's top one: a router had picked other experts). With the routes replayed, the
    # largest gap of the 1600 tokens past one key tile was 0.0171 and 0.0221 in two runs (2 x H200,
    # 2026-11-28): the two attentions' roundings add up over 200 positions, past two roundings (2^-6).
    assert max(max(gaps) for gaps in result["gaps"]) <= 2 ** -5
    assert result["argmax"] >= 0.9 * 8 * max_new
    assert result["routed"] == [len(tokens) - 1 for tokens in result["got"]]  # all but the final token


@pytest.mark.gpu
@needs_megatron_engine
def test_the_loop_with_megatrons_engine_replays_the_routes_it_records():
    """R3 with Megatron's engine: the update replays the routes the engine recorded, replay brings the
    trainer's log-probs closer to the engine's than routing live, and the engine's log-probs and routes
    are as close to the trainer's as the built-in engine's (both run the same bf16 weights)."""
    # 4 heads of 16 (flash-attn-4 pages it) and the GPU default's router, 128 experts top-8 in fp32: with the
    # small model's 4 experts top-2 in fp32 no route differed between the engine and the trainer (2 x H200,
    # 2026-11-28: k3 8.79e-5 replayed against 8.74e-5 live), so replay had nothing to remove.
    argv = EMBEDDED_FLAGS + ["--moe-enable-routing-replay", "--train-iters", "3", "--init-method-std", "0.15",
                             "--hidden-size", "64", "--num-experts", "128", "--moe-router-topk", "8"]

    def history(engine):
        ((result),) = run_workers(train_worker, 1, argv + ["--rollout-engine", engine], backend="nccl", timeout=300)
        return result["history"]

    def mean(rows, name):
        return sum(row[name] for row in rows) / len(rows)

    megatron, local = history("megatron"), history("local")
    for metrics in megatron:
        # Every token but each sample's final one (it never ran through the engine) replays its route.
        assert metrics["routing/replayed_tokens"] > 0 and metrics["routing/live_tokens"] == 0
        assert metrics["routing/replayed_tokens"] + metrics["routing/filler_tokens"] == metrics["tokens"]
    assert mean(megatron, "routing/agreement") < 0.99  # routes differ: what replay removes
    assert mean(megatron, "mismatch/replay/k3_kl") < mean(megatron, "mismatch/live/k3_kl")
    assert mean(megatron, "mismatch/replay/logp_abs_diff") <= 2 * mean(local, "mismatch/replay/logp_abs_diff")
    assert mean(megatron, "routing/agreement") >= mean(local, "routing/agreement") - 0.1


def _graphs_worker(argv):
    """Megatron's engine built by the launcher with its CUDA graphs (of the scope ``argv`` asks) and without, on
    the same policy: one iteration's samples of each, and whether the graphed one's model has Megatron's graph
    managers, and which module owns them."""
    from megatron.core import parallel_state

    from megatron_r3.dataplane.device.microbatches import RowLayout
    from megatron_r3.dataplane.device.plan import RankLayout
    from megatron_r3.rl.arguments import run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.model.factory import build_model, transformer_config
    from megatron_r3.rl.rollout.engine_choice import build_rollout_engine

    run_args = parse_args(argv)
    settings = run_settings(run_args)
    device = initialize(settings)
    try:
        model = settings.model
        config = transformer_config(model, device)
        policy = build_model(model, config, device)
        rows = RowLayout(RankLayout.of_this_rank(False), config, run_args.seq_length, run_args.micro_batch_size,
                         device)
        prompts = [p.token_ids for p in settings.rollouts.task.prompts(run_args.seed, 1, range(4)) for _ in range(2)]
        samples, graphed = {}, {}
        for cuda_graphs in (True, False):
            engine_settings = dataclasses.replace(settings.rollouts.engine, requested="megatron",
                                                  cuda_graphs=cuda_graphs)
            engine = build_rollout_engine(engine_settings, model, device, policy, RoutingSpec.from_config(config),
                                          rows, len(prompts))
            graphed[cuda_graphs] = engine.chunks[0].config.cuda_graph_impl == "local"
            rounds = []
            for iteration in (1, 2):  # per layer the first captures (block: the engine's start), the second replays
                engine.weights.advance()
                rounds.append([(s.token_ids.tolist(), s.logprobs.tolist(), s.routes.ids.tolist())
                               for s in engine.generate(prompts, iteration)])
            samples[cuda_graphs] = rounds
            if cuda_graphs:
                owner = engine.graph_owner
                # the modules whose graph managers hold captured graphs: what replayed, not what was configured
                captured = sorted({type(module).__name__ for module in engine.chunks[0].modules()
                                   if getattr(getattr(module, "cudagraph_manager", None), "cudagraph_runners", None)})
        return {"graphed": graphed, "samples": samples, "owner": owner, "captured": captured}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
@needs_megatron_engine
@pytest.mark.parametrize("scope", ["layer", "block"])
def test_megatrons_engine_with_its_cuda_graphs_draws_what_it_draws_eagerly(scope):
    """Where the MoE layers keep their token counts on the device (torch's grouped experts), Megatron's
    engine captures its CUDA graphs, per layer or of the whole block, and they draw the same tokens, log-probs
    and routes (recorded inside the graphs) as its eager steps."""
    argv = EMBEDDED_FLAGS + ["--moe-enable-routing-replay", "--hidden-size", "64", "--moe-grouped-gemm-impl", "torch",
                             "--inference-cuda-graph-scope", scope]
    ((result),) = run_workers(_graphs_worker, 1, argv, backend="nccl", timeout=300)
    assert result["graphed"] == {True: True, False: False}
    assert result["owner"] == ("of the whole transformer block" if scope == "block" else "per layer")
    if scope == "block":
        assert result["captured"] == ["TransformerBlock"]
    else:
        assert result["captured"] and "TransformerBlock" not in result["captured"]
    assert result["samples"][True] == result["samples"][False]


def test_an_installed_flash_attn_4_that_does_not_import_is_named_with_its_error(monkeypatch):
    """FlashAttention-4 without its CuTe DSL (seen on an H200: `No module named 'cutlass.cute'`) is reported as
    such, not as flash-attn missing."""
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "4.0.0b36" if name == "flash-attn-4" else real_version(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # its import raises ImportError
    problem = flash_attention_problem()
    assert "flash-attn-4 4.0.0b36 is installed but does not import: " in problem
    assert "flash_attn.cute" in problem and "needs flash-attn >= 2.7.3 or flash-attn 3/4" in problem
