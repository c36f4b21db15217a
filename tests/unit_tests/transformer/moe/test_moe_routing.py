# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""Per-microbatch routing replay (MoERouting), beside upstream's test_router_replay.py.

One class per patch of the replay series: replay through the RouterReplay hook (router,
model plumbing, config refusals), recording, live routes for agreement, the opt-in value
check, host token counts for the alltoall dispatcher, and upstream's RouterReplay API on
the patched tree.
"""

import gc

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as router_module
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_routing import (
    LayerRoutes,
    MoERouting,
    host_counts_unsupported,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils
from tests.unit_tests.transformer.moe.moe_routing_utils import (
    HIDDEN,
    NUM_EXPERTS,
    TOPK,
    VOCAB,
    as_routing_map,
    make_batch,
    random_routes,
    routing_maps,
    run_model,
)

MOE_LAYERS = [2, 3, 4]

# In-process CPU models: Megatron must not pick up a visible GPU.

def _config(**overrides):
    """A dense first layer and three MoE layers, replay enabled, no load balancing."""
    fields = dict(
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1, 1, 1],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _gpt(config, seed=7, mtp=False):
    torch.manual_seed(seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp_spec = None
    if mtp:
        mtp_spec = get_gpt_mtp_block_spec(
            config, spec.layer_specs[-1], use_transformer_engine=False
        )
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64, mtp_block_spec=mtp_spec)


def _forced(tokens, seed=0, no_route_every=0, **kwargs):
    ids = random_routes(len(MOE_LAYERS), tokens.numel(), seed)
    if no_route_every:
        ids[:, ::no_route_every] = -1
    return MoERouting(MOE_LAYERS, expert_ids=ids, **kwargs)


def _moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoELayer)]




class TestMoERoutingRouter:
    """moe: per-microbatch routes (MoERouting) replayed through the RouterReplay hook."""

    LAYER = 2
    VARIANTS = {
        "softmax_post_topk": dict(),
        "softmax_pre_topk": dict(moe_router_pre_softmax=True),
        "softmax_scaled": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
        "sigmoid": dict(moe_router_score_function="sigmoid"),
        "sigmoid_expert_bias": dict(
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
        ),
        "group_limited": dict(
            moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2
        ),
        "sigmoid_group_limited_scaled": dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_router_topk_scaling_factor=1.5,
        ),
    }

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _router(self, **overrides):
        torch.manual_seed(3)
        router = TopKRouter(
            _config(**overrides), pg_collection=moe_utils.get_default_pg_collection()
        )
        router.set_layer_number(self.LAYER)
        if router.expert_bias is not None:
            # A bias that pulls the live top-k away from the replayed experts.
            router.expert_bias.copy_(torch.linspace(-1.0, 1.0, NUM_EXPERTS))
        return router

    @staticmethod
    def _expected_probs(config, logits, ids):
        """The replayed probabilities, from the definition of each score function."""
        if config.moe_router_score_function == "softmax":
            if config.moe_router_pre_softmax:
                probs = torch.softmax(logits, dim=-1).gather(1, ids)
            else:
                probs = torch.softmax(logits.gather(1, ids), dim=-1)
        else:
            scores = torch.sigmoid(logits).gather(1, ids)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        if config.moe_router_topk_scaling_factor:
            probs = probs * config.moe_router_topk_scaling_factor
        return torch.zeros_like(logits).scatter(1, ids, probs)

    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    def test_every_score_function_replays_exactly_with_router_grads(self, variant):
        router = self._router(**self.VARIANTS[variant])
        hidden = torch.randn(6, 3, HIDDEN, requires_grad=True)
        ids = random_routes(1, 18, seed=11)
        routing = MoERouting([self.LAYER], expert_ids=ids, every_token_routed=True)

        probs, routing_map = router(hidden, moe_routing=routing)

        assert torch.equal(routing_map, as_routing_map(ids[0]))
        logits = torch.nn.functional.linear(
            hidden.detach().view(-1, HIDDEN), router.weight.detach()
        )
        torch.testing.assert_close(probs, self._expected_probs(router.config, logits, ids[0]))
        (probs * torch.randn_like(probs)).sum().backward()
        assert router.weight.grad.abs().sum() > 0 and hidden.grad.abs().sum() > 0

    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    def test_rows_without_a_route_take_the_live_top_k(self, variant):
        router = self._router(**self.VARIANTS[variant])
        hidden = torch.randn(6, 3, HIDDEN)
        live_probs, live_map = router(hidden)
        ids = random_routes(1, 18, seed=5)
        no_route = torch.zeros(18, dtype=torch.bool)
        no_route[::3] = True
        ids[0, no_route] = -1

        probs, routing_map = router(hidden, moe_routing=MoERouting([self.LAYER], expert_ids=ids))

        assert torch.equal(routing_map[no_route], live_map[no_route])
        torch.testing.assert_close(probs[no_route], live_probs[no_route])
        assert torch.equal(routing_map[~no_route], as_routing_map(ids[0].clamp(min=0))[~no_route])
        # -1 is never replayed as an expert id: the live rows do not all land on expert 0.
        assert not routing_map[no_route][:, 0].all()

    def test_every_token_routed_runs_no_live_top_k(self, monkeypatch):
        router = self._router()
        hidden = torch.randn(6, 3, HIDDEN)
        ids = random_routes(1, 18, seed=6)
        calls = []
        real_topk = torch.topk
        monkeypatch.setattr(torch, "topk", lambda *a, **k: calls.append(1) or real_topk(*a, **k))
        router(hidden, moe_routing=MoERouting([self.LAYER], expert_ids=ids))
        assert calls, "without every_token_routed a -1 row may exist: the live top-k runs"
        calls.clear()
        router(
            hidden, moe_routing=MoERouting([self.LAYER], expert_ids=ids, every_token_routed=True)
        )
        assert calls == []

    def test_expert_bias_counts_the_replayed_routes(self):
        router = self._router(
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
        )
        ids = random_routes(1, 18, seed=2)
        router.local_tokens_per_expert.zero_()
        router(torch.randn(6, 3, HIDDEN), moe_routing=MoERouting([self.LAYER], expert_ids=ids))
        want = torch.bincount(ids[0].flatten(), minlength=NUM_EXPERTS).float()
        assert torch.equal(router.local_tokens_per_expert, want)

    def test_complete_routes_take_upstreams_precomputed_indices_path(self, monkeypatch):
        router = self._router(moe_router_pre_softmax=True)
        hidden = torch.randn(6, 3, HIDDEN)
        ids = random_routes(1, 18, seed=9)
        calls = []
        upstream = router_module.topk_routing_with_score_function

        def spy(*args, **kwargs):
            calls.append(kwargs)
            return upstream(*args, **kwargs)

        monkeypatch.setattr(router_module, "topk_routing_with_score_function", spy)
        monkeypatch.setattr(
            LayerRoutes, "get_replay_topk", lambda *a, **k: pytest.fail("the hook ran")
        )
        _, routing_map = router(
            hidden, moe_routing=MoERouting([self.LAYER], expert_ids=ids, every_token_routed=True)
        )
        assert calls[0]["router_replay"] is None
        assert torch.equal(calls[0]["precomputed_indices"], ids[0])
        assert torch.equal(routing_map, as_routing_map(ids[0]))

    def test_a_partly_filled_row_is_routed_live_and_refused_by_verify(self):
        router = self._router()
        hidden = torch.randn(6, 3, HIDDEN)
        _, live_map = router(hidden)
        ids = random_routes(1, 18, seed=7)
        ids[0, 2] = -1  # no route: fine
        ids[0, 5, 1] = -1  # partly filled: an error
        routing = MoERouting([self.LAYER], expert_ids=ids)

        _, routing_map = router(hidden, moe_routing=routing)

        assert torch.equal(routing_map[[2, 5]], live_map[[2, 5]])  # never gathered at -1
        with pytest.raises(ValueError, match="token 5 .*MoE layer 2 is \\[\\d+, -1\\]"):
            routing.verify()
        ids[0, 5, 1] = (ids[0, 5, 0] + 1) % NUM_EXPERTS
        whole_rows_only = MoERouting([self.LAYER], expert_ids=ids)
        router(hidden, moe_routing=whole_rows_only)
        whole_rows_only.verify()

    def test_the_aux_loss_means_the_same_under_both_replay_sources(self):
        """The aux loss balances the router's own top-k of its scores, replayed or not."""
        router = self._router(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
        router.train()
        hidden = torch.randn(6, 3, HIDDEN)
        ids = torch.tensor([6, 7]).expand(1, 18, TOPK).contiguous()  # maximally unbalanced

        def aux_loss(**kwargs):
            tracker = get_moe_metrics_tracker()
            tracker.clear()
            router(hidden, **kwargs)
            return tracker.metrics["load_balancing_loss"].values[self.LAYER - 1].clone()

        live = aux_loss()
        per_microbatch = aux_loss(moe_routing=MoERouting([self.LAYER], expert_ids=ids))
        router.router_replay.set_target_indices(ids[0])
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            global_replay = aux_loss()
        finally:
            router.router_replay.clear_router_replay_action()

        logits = torch.nn.functional.linear(hidden.view(-1, HIDDEN), router.weight.detach())
        scores = torch.softmax(logits, -1)
        own = torch.bincount(scores.topk(TOPK).indices.flatten(), minlength=NUM_EXPERTS).float()
        want = NUM_EXPERTS * (own / (18 * TOPK) * scores.mean(0)).sum()
        torch.testing.assert_close(live, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(per_microbatch, live) and torch.equal(global_replay, live)

    @pytest.mark.gpu
    @pytest.mark.parametrize("every_token_routed", [True, False])
    def test_replay_forward_and_backward_do_not_sync_the_device(self, every_token_routed):
        router = self._router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        ids = random_routes(1, 18, seed=4).cuda()
        if not every_token_routed:
            ids[0, ::3] = -1

        def step():
            hidden = torch.randn(6, 3, HIDDEN, device="cuda", requires_grad=True)
            routing = MoERouting([self.LAYER], expert_ids=ids, every_token_routed=every_token_routed)
            probs, _ = router(hidden, moe_routing=routing)
            probs.sum().backward()

        step()  # the first call moves the gate to the GPU
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    @pytest.mark.gpu
    def test_a_partly_filled_row_on_the_gpu_is_reported_without_a_device_assert(self):
        router = self._router()
        ids = random_routes(1, 18, seed=4).cuda()
        ids[0, 5, 1] = -1
        routing = MoERouting([self.LAYER], expert_ids=ids)
        probs, _ = router(torch.randn(6, 3, HIDDEN, device="cuda"), moe_routing=routing)
        with pytest.raises(ValueError, match="token 5 .*MoE layer 2"):
            routing.verify()
        torch.cuda.synchronize()  # the CUDA context is intact: the process can save or exit
        assert torch.isfinite(probs).all()

    def test_a_router_replay_action_and_a_moe_routing_are_exclusive(self):
        router = self._router()
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        ids = random_routes(1, 18)
        with pytest.raises(ValueError, match="use one of the two"):
            router(torch.randn(6, 3, HIDDEN), moe_routing=MoERouting([self.LAYER], expert_ids=ids))


class TestMoERoutingInGPTModel:
    """transformer, gpt: hand MoERouting from the decoder and MTP blocks to the MoE layers."""

    RECOMPUTE = {
        "full_uniform": dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        "full_block": dict(
            recompute_granularity="full", recompute_method="block", recompute_num_layers=4
        ),
        "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    }

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_the_routes_taken_are_the_given_routes(self):
        model = _gpt(_config())
        batch = make_batch()
        routing = _forced(batch[0], seed=1, every_token_routed=True)
        assert model.decoder.moe_layer_numbers == MOE_LAYERS
        with routing_maps(model) as seen:
            run_model(model, batch, routing)
        for row, layer in enumerate(MOE_LAYERS):
            assert torch.equal(seen[layer][0], as_routing_map(routing.expert_ids[row]))

    @pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
    def test_recompute_replays_the_same_routes_bit_for_bit(self, recompute):
        batch = make_batch()
        want_loss, want_grads = run_model(_gpt(_config()), batch, _forced(batch[0], 9, 4))
        model = _gpt(_config(**self.RECOMPUTE[recompute]))
        with routing_maps(model) as seen:
            loss, grads = run_model(model, batch, _forced(batch[0], 9, 4))
        assert torch.equal(loss, want_loss)
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), name
        for layer in MOE_LAYERS:  # the recompute ran the routers again, the same way
            assert len(seen[layer]) == 2 and torch.equal(seen[layer][0], seen[layer][1])

    def test_a_forward_only_pass_leaves_nothing_for_the_next_step(self):
        model = _gpt(_config(**self.RECOMPUTE["full_uniform"]))
        batch = make_batch()
        with torch.no_grad():
            run_model(model, batch, _forced(batch[0], seed=100), backward=False)
        routing = _forced(batch[0], seed=200)
        with routing_maps(model) as seen:
            run_model(model, batch, routing)
        for row, layer in enumerate(MOE_LAYERS):
            want = as_routing_map(routing.expert_ids[row])
            assert len(seen[layer]) == 2 and all(torch.equal(m, want) for m in seen[layer])

    def test_two_models_in_one_process_replay_independently(self):
        policy, reference = _gpt(_config(), seed=1), _gpt(_config(), seed=2)
        batch = make_batch()
        policy_routes, reference_routes = _forced(batch[0], 10), _forced(batch[0], 20)
        with routing_maps(policy) as seen_policy, routing_maps(reference) as seen_reference:
            loss = policy(
                *batch[:2], None, labels=batch[2], extra_block_kwargs={"moe_routing": policy_routes}
            )
            with torch.no_grad():
                run_model(reference, batch, reference_routes, backward=False)
            loss.sum().backward()
        for row, layer in enumerate(MOE_LAYERS):
            assert torch.equal(seen_policy[layer][0], as_routing_map(policy_routes.expert_ids[row]))
            assert torch.equal(seen_reference[layer][0], as_routing_map(reference_routes.expert_ids[row]))

    def test_memory_stays_flat_over_2000_microbatches(self):
        model = _gpt(_config(num_layers=2, moe_layer_freq=[0, 1]))
        tokens, position_ids, _ = make_batch(batch_size=1, seq=4)

        def microbatch(i):
            # A training-mode forward whose graph is dropped without a backward: the case
            # where upstream's FIFO keeps every entry.
            routing = MoERouting([2], expert_ids=random_routes(1, 4, seed=i))
            model(tokens, position_ids, None, extra_block_kwargs={"moe_routing": routing})

        def tensor_count():
            gc.collect()
            return sum(1 for obj in gc.get_objects() if torch.is_tensor(obj))

        for i in range(50):
            microbatch(i)
        baseline = tensor_count()
        for i in range(2000):
            microbatch(i)
        assert tensor_count() <= baseline

    def test_float16module_passes_the_routes_and_the_router_gets_grads(self):
        config = _config(bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32")
        model = Float16Module(config, _gpt(config))
        batch = make_batch()
        routing = _forced(batch[0], seed=31, no_route_every=3)
        with routing_maps(model.module) as seen:
            loss = model(
                *batch[:2], None, labels=batch[2], extra_block_kwargs={"moe_routing": routing}
            )
        loss.float().sum().backward()
        for row, layer in enumerate(MOE_LAYERS):
            ids = routing.expert_ids[row]
            routed = (ids >= 0).all(dim=-1)
            assert torch.equal(seen[layer][0][routed], as_routing_map(ids[routed]))
        assert all(m.router.weight.grad.abs().sum() > 0 for m in _moe_layers(model.module))

    BAD_SHAPES = {
        "missing_layer": (
            lambda ids: MoERouting(MOE_LAYERS[:2], expert_ids=ids[:2]),
            "also builds MoE layers \\[4\\]",
        ),
        "foreign_layer": (
            lambda ids: MoERouting([1, 2, 3, 4], expert_ids=torch.cat([ids[:1], ids])),
            "routes for MoE layers \\[1\\], which this model chunk does not build",
        ),
        "layer_rows": (
            lambda ids: MoERouting(MOE_LAYERS, expert_ids=ids[:2]),
            "shape \\(2, 32, 2\\)",
        ),
        "token_count": (
            lambda ids: MoERouting(MOE_LAYERS, expert_ids=ids[:, :-1]),
            "num_tokens=32 \\(s_local \\* b on this rank\\)",
        ),
        "topk": (lambda ids: MoERouting(MOE_LAYERS, expert_ids=ids[..., :1]), "topk=2"),
        "float_ids": (lambda ids: MoERouting(MOE_LAYERS, expert_ids=ids.float()), "int64.*float32"),
        "int32_ids": (lambda ids: MoERouting(MOE_LAYERS, expert_ids=ids.int()), "int64.*int32"),
    }

    @pytest.mark.parametrize("case", sorted(BAD_SHAPES))
    def test_bad_routes_fail_before_any_layer_runs(self, case):
        make, message = self.BAD_SHAPES[case]
        model = _gpt(
            _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        )
        batch = make_batch()
        ran = []
        for layer in model.decoder.layers:
            layer.register_forward_pre_hook(lambda *args: ran.append("layer"))
        with pytest.raises(ValueError, match=message):
            run_model(model, batch, make(random_routes(3, batch[0].numel(), seed=3)), backward=False)
        assert ran == []
        assert all(m.router.local_tokens_per_expert.sum() == 0 for m in _moe_layers(model))

    REFUSED = {
        "moe_enable_routing_replay": dict(moe_enable_routing_replay=False),
        "moe_expert_capacity_factor": dict(
            moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="aux_loss"
        ),
        "mlp_chunks_for_training": dict(mlp_chunks_for_training=2),
    }

    @pytest.mark.parametrize("option", sorted(REFUSED))
    def test_configurations_that_would_not_take_the_routes_are_refused(self, option):
        model = _gpt(_config(**self.REFUSED[option]))
        batch = make_batch()
        with pytest.raises(ValueError, match=option):
            run_model(model, batch, _forced(batch[0]), backward=False)

    def test_cuda_graphs_refuse_the_routes_only_where_a_layer_replays_one(self):
        """cuda_graph_impl="local" (which the config accepts: RouterReplay records under it)
        leaves a graph manager on every layer, which a training forward replays; Megatron-LM's
        RL loop keeps the graphs for inference only and removes them for training
        (toggle_cuda_graphs(model, "none")), and there the routes replay."""
        model = _gpt(_config())
        batch = make_batch()
        routing = _forced(batch[0], seed=3)
        model.decoder.config.cuda_graph_impl = "local"
        model.decoder.layers[1].cudagraph_manager = object()  # what building under "local" leaves
        with pytest.raises(ValueError, match="MoERouting does not support cuda_graph_impl"):
            run_model(model, batch, routing, backward=False)
        del model.decoder.layers[1].cudagraph_manager  # what toggle_cuda_graphs(model, "none") does
        with routing_maps(model) as seen:
            run_model(model, batch, routing, backward=False)
        for row, layer in enumerate(MOE_LAYERS):
            assert torch.equal(seen[layer][0], as_routing_map(routing.expert_ids[row]))

    def test_the_combined_1f1b_schedule_plan_refuses_moe_routing(self):
        model = _gpt(_config())
        tokens, position_ids, _ = make_batch()
        with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm"):
            model.build_schedule_plan(
                tokens, position_ids, None, extra_block_kwargs={"moe_routing": _forced(tokens)}
            )

    def test_mtp_layers_replay_given_routes_and_route_live_otherwise(self):
        config = _config(mtp_num_layers=1)
        model = _gpt(config, mtp=True)
        tokens, position_ids, _ = make_batch()
        mtp_layer = config.num_layers + 1
        ids = random_routes(4, tokens.numel(), seed=41)

        def forward(routing):
            # Evaluation: the MTP layer runs; its training-only loss logging (CUDA-only) does not.
            model.eval()
            with torch.no_grad(), routing_maps(model) as seen:
                model(tokens, position_ids, None, extra_block_kwargs={"moe_routing": routing})
            return seen

        live = forward(MoERouting(MOE_LAYERS, expert_ids=ids[:3]))
        replayed = forward(MoERouting(MOE_LAYERS + [mtp_layer], expert_ids=ids))
        assert torch.equal(replayed[mtp_layer][0], as_routing_map(ids[3]))
        assert not torch.equal(live[mtp_layer][0], as_routing_map(ids[3]))
        for row, layer in enumerate(MOE_LAYERS):
            assert torch.equal(live[layer][0], replayed[layer][0])
            assert torch.equal(replayed[layer][0], as_routing_map(ids[row]))


class TestRoutingReplayConfig:
    """moe: replay under moe_router_fusion; refuse routers without a replay hook (config)."""

    REFUSED = {
        "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0),
        "quantile_balancing": dict(
            moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0
        ),
    }

    @pytest.mark.parametrize("option", sorted(REFUSED))
    def test_routers_that_skip_the_hook_are_refused(self, option):
        with pytest.raises(ValueError, match="moe_enable_routing_replay does not support"):
            _config(**self.REFUSED[option])
        _config(moe_enable_routing_replay=False, **self.REFUSED[option])

    def test_options_upstream_route_recording_supports_stay_valid(self):
        for option in (
            dict(cuda_graph_impl="local"),
            dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="aux_loss"),
            dict(moe_router_force_load_balancing=True),
            dict(moe_router_fusion=True),
        ):
            assert _config(**option).moe_enable_routing_replay


class TestReplayUnderRouterFusion:
    """moe: replay under moe_router_fusion (the fused top-k steps aside where replay needs the
    hook).

    The fused top-k is TransformerEngine's kernel; a CPU stand-in that computes the unfused
    top-k and counts its calls takes its place, so the test runs without TE.
    """

    LAYER = 2
    VARIANTS = TestMoERoutingRouter.VARIANTS

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        RouterReplay.clear_global_router_replay_instances()

    def teardown_method(self, method):
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_instances()
        Utils.destroy_model_parallel()

    @pytest.fixture
    def fused_calls(self, monkeypatch):
        """Stand in for TE's fused top-k: the unfused computation, each call recorded."""
        calls = []
        unfused = moe_utils.topk_routing_with_score_function

        def fused_topk_with_score_function(logits, topk, **kwargs):
            calls.append(logits.shape)
            return unfused(logits, topk, **kwargs)

        monkeypatch.setattr(moe_utils, "HAVE_TE", True)
        monkeypatch.setattr(
            moe_utils, "fused_topk_with_score_function", fused_topk_with_score_function
        )
        return calls

    def _routers(self, **overrides):
        """A router under moe_router_fusion and its unfused twin (same weights and bias)."""
        routers = []
        for fusion in (True, False):
            torch.manual_seed(3)
            router = TopKRouter(
                _config(moe_router_fusion=fusion, **overrides),
                pg_collection=moe_utils.get_default_pg_collection(),
            )
            router.set_layer_number(self.LAYER)
            if router.expert_bias is not None:
                router.expert_bias.copy_(torch.linspace(-1.0, 1.0, NUM_EXPERTS))
            routers.append(router)
        return routers

    @staticmethod
    def _forward_backward(router, hidden, **kwargs):
        hidden = hidden.clone().requires_grad_(True)
        probs, routing_map = router(hidden, **kwargs)
        (probs * torch.linspace(0.5, 2.0, NUM_EXPERTS)).sum().backward()
        return probs.detach(), routing_map, router.weight.grad.clone(), hidden.grad

    @pytest.mark.parametrize("every_token_routed", [True, False])
    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    def test_a_replayed_microbatch_takes_the_unfused_top_k(
        self, fused_calls, variant, every_token_routed
    ):
        fused, unfused = self._routers(**self.VARIANTS[variant])
        hidden = torch.randn(6, 3, HIDDEN)
        ids = random_routes(1, 18, seed=13)
        if not every_token_routed:
            ids[0, ::4] = -1

        def routing():
            return MoERouting(
                [self.LAYER], expert_ids=ids, every_token_routed=every_token_routed
            )

        probs, routing_map, weight_grad, hidden_grad = self._forward_backward(
            fused, hidden, moe_routing=routing()
        )
        assert fused_calls == []
        want = self._forward_backward(unfused, hidden, moe_routing=routing())
        routed = ids[0, :, 0] >= 0
        assert torch.equal(routing_map[routed], as_routing_map(ids[0][routed]))
        assert torch.equal(routing_map, want[1])
        torch.testing.assert_close(probs, want[0], rtol=0, atol=0)
        torch.testing.assert_close(weight_grad, want[2], rtol=0, atol=0)
        torch.testing.assert_close(hidden_grad, want[3], rtol=0, atol=0)
        assert weight_grad.abs().sum() > 0

    def test_a_live_microbatch_keeps_the_fused_top_k(self, fused_calls):
        fused, unfused = self._routers()
        hidden = torch.randn(6, 3, HIDDEN)
        probs, routing_map = fused(hidden)
        assert fused_calls == [(18, NUM_EXPERTS)]
        # A MoERouting that neither replays nor records this layer does not need the hook.
        fused(hidden, moe_routing=MoERouting([self.LAYER]))
        fused(hidden, moe_routing=MoERouting([self.LAYER + 1], expert_ids=random_routes(1, 18)))
        assert len(fused_calls) == 3
        want_probs, want_map = unfused(hidden)
        assert torch.equal(routing_map, want_map)
        torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)

    def test_recording_and_live_routes_take_the_unfused_top_k(self, fused_calls):
        fused, unfused = self._routers()
        hidden = torch.randn(6, 3, HIDDEN)
        _, want_map = unfused(hidden)
        for kwargs in (dict(record=True), dict(keep_live_routes=True)):
            routing = MoERouting([self.LAYER], **kwargs)
            fused(hidden, moe_routing=routing)
            got = routing.recorded_expert_ids() if "record" in kwargs else routing.live_expert_ids()
            assert torch.equal(as_routing_map(got[0]), want_map)
        assert fused_calls == []

    def test_router_replay_actions_take_the_unfused_top_k(self, fused_calls):
        fused, unfused = self._routers(moe_router_score_function="sigmoid")
        hidden = torch.randn(6, 3, HIDDEN)
        _, want_map = unfused(hidden)
        replay = fused.router_replay

        replay.set_router_replay_action(RouterReplayAction.RECORD)
        fused(hidden)
        assert torch.equal(as_routing_map(replay.get_recorded_indices()), want_map)

        ids = random_routes(1, 18, seed=21)[0]
        replay.set_target_indices(ids)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs, routing_map, weight_grad, _ = self._forward_backward(fused, hidden)
        assert torch.equal(routing_map, as_routing_map(ids))
        unfused.router_replay.set_target_indices(ids)
        unfused.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        want = self._forward_backward(unfused, hidden)
        torch.testing.assert_close(probs, want[0], rtol=0, atol=0)
        torch.testing.assert_close(weight_grad, want[2], rtol=0, atol=0)

        replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        _, routing_map = fused(hidden)
        assert torch.equal(routing_map, as_routing_map(ids))
        assert fused_calls == []

        replay.clear_router_replay_action()
        fused(hidden)
        assert len(fused_calls) == 1

    def test_a_replayed_model_forward_and_backward_never_calls_the_fused_top_k(
        self, fused_calls
    ):
        model = _gpt(_config(moe_router_fusion=True))
        batch = make_batch()
        routing = _forced(batch[0], seed=5, no_route_every=3)
        with routing_maps(model) as seen:
            run_model(model, batch, routing)
        assert fused_calls == []
        for row, layer in enumerate(MOE_LAYERS):
            ids = routing.expert_ids[row]
            routed = ids[:, 0] >= 0
            assert torch.equal(seen[layer][0][routed], as_routing_map(ids[routed]))
        assert all(m.router.weight.grad.abs().sum() > 0 for m in _moe_layers(model))
        run_model(model, batch, None, backward=False)
        assert len(fused_calls) == len(MOE_LAYERS)


class TestMoERoutingRecording:
    """moe: MoERouting records the routes taken (R2) and keeps the live top-k on request."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_record_then_replay_reproduces_logits_and_routes(self):
        model = _gpt(_config())
        tokens, position_ids, _ = make_batch()
        record = MoERouting(MOE_LAYERS, record=True)
        model.eval()
        with torch.no_grad(), routing_maps(model) as first:
            logits = model(tokens, position_ids, None, extra_block_kwargs={"moe_routing": record})
        recorded = record.recorded_expert_ids()
        assert recorded.shape == (3, tokens.numel(), TOPK) and recorded.dtype == torch.int64

        model.train()
        replay = MoERouting(MOE_LAYERS, expert_ids=recorded, every_token_routed=True)
        with routing_maps(model) as second:
            replayed = model(tokens, position_ids, None, extra_block_kwargs={"moe_routing": replay})
        torch.testing.assert_close(replayed, logits, rtol=0, atol=0)
        for layer in MOE_LAYERS:
            assert torch.equal(second[layer][0], first[layer][0])

    def test_the_recording_holds_live_decided_rows_and_recompute_replays_it(self):
        config = _config(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
        model = _gpt(config)
        batch = make_batch()
        routing = _forced(batch[0], seed=8, no_route_every=3, record=True)
        with routing_maps(model) as seen:
            run_model(model, batch, routing)
        recorded = routing.recorded_expert_ids()
        routed = routing.expert_ids[..., 0] >= 0
        assert torch.equal(recorded[routed], routing.expert_ids[routed])
        assert (recorded >= 0).all()
        for row, layer in enumerate(MOE_LAYERS):
            assert torch.equal(seen[layer][1], as_routing_map(recorded[row]))

    @pytest.mark.parametrize("kwargs", [dict(record=True), dict(keep_live_routes=True)])
    def test_a_recording_routing_serves_one_forward(self, kwargs):
        model = _gpt(_config())
        batch = make_batch()
        routing = _forced(batch[0], seed=4, no_route_every=3, **kwargs)
        run_model(model, batch, routing)
        with pytest.raises(RuntimeError, match="has served a forward already"):
            run_model(model, batch, routing)

    def test_a_replay_only_routing_may_serve_again(self):
        model = _gpt(_config())
        batch = make_batch()
        routing = _forced(batch[0], seed=4, no_route_every=3)
        first, _ = run_model(model, batch, routing, backward=False)
        again, _ = run_model(model, batch, routing, backward=False)
        assert torch.equal(first, again)

    def test_nothing_is_recorded_unless_asked(self):
        model = _gpt(_config())
        batch = make_batch()
        routing = _forced(batch[0])
        run_model(model, batch, routing, backward=False)
        with pytest.raises(RuntimeError, match="recorded nothing"):
            routing.recorded_expert_ids()


class TestMoERoutingLiveRoutes:
    """moe: MoERouting records the routes taken (R2) and keeps the live top-k on request:
    the live top-k, for routing agreement."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_live_expert_ids_are_the_routers_own_choice_under_replay(self):
        model = _gpt(_config())
        batch = make_batch()
        live = MoERouting(MOE_LAYERS, record=True)
        with torch.no_grad():
            run_model(model, batch, live, backward=False)
        # Replaying in the first layer changes what later layers see; replay only layer 2.
        ids = torch.cat([random_routes(1, batch[0].numel(), 12), live.recorded_expert_ids()[1:]])
        replayed = MoERouting(MOE_LAYERS, expert_ids=ids, keep_live_routes=True, record=True)
        with torch.no_grad():
            run_model(model, batch, replayed, backward=False)
        assert torch.equal(replayed.live_expert_ids()[0], live.recorded_expert_ids()[0])
        assert torch.equal(replayed.recorded_expert_ids(), ids)
        assert not torch.equal(replayed.live_expert_ids()[0], ids[0])

    def test_live_routes_are_kept_only_on_request(self):
        model = _gpt(_config())
        batch = make_batch()
        routing = _forced(batch[0], every_token_routed=True)
        run_model(model, batch, routing, backward=False)
        with pytest.raises(RuntimeError, match="kept no live routes"):
            routing.live_expert_ids()


class TestMoERoutingValueCheck:
    """moe: optional device-side value check of MoERouting expert ids."""

    BAD_IDS = {
        "id_out_of_range": (
            lambda ids: ids[1, 13].fill_(NUM_EXPERTS),
            "outside \\[0, 8\\).*sample 1, position 6 \\(token 13 on this rank\\), layer 3",
        ),
        "negative_id": (
            lambda ids: ids[2, 4, 1].fill_(-2),
            "outside \\[0, 8\\).*sample 0, position 2 \\(token 4 on this rank\\), layer 4",
        ),
        "partly_no_route": (
            lambda ids: ids[0, 7, 0].fill_(-1),
            "outside \\[0, 8\\).*sample 1, position 3 \\(token 7 on this rank\\), layer 2",
        ),
        "duplicate_ids": (
            lambda ids: ids[2, 30].fill_(5),
            "duplicate expert ids.*sample 0, position 15 \\(token 30 on this rank\\), layer 4",
        ),
    }

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("case", sorted(BAD_IDS))
    def test_bad_ids_fail_naming_sample_position_and_layer(self, case):
        mutate, message = self.BAD_IDS[case]
        model = _gpt(_config(moe_routing_replay_check_values=True))
        batch = make_batch()
        routing = _forced(batch[0], seed=3)
        mutate(routing.expert_ids)
        with pytest.raises(ValueError, match=message):
            run_model(model, batch, routing, backward=False)

    def test_the_check_is_off_by_default(self, monkeypatch):
        assert not _config().moe_routing_replay_check_values
        model = _gpt(_config())
        batch = make_batch()
        monkeypatch.setattr(MoERouting, "check_values", lambda *a: pytest.fail("value check ran"))
        run_model(model, batch, _forced(batch[0]), backward=False)


class TestHostTokensPerExpert:
    """moe: the alltoall dispatcher takes split sizes from host token counts under replay."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @staticmethod
    def _counts(ids):
        """[tp_ep=1, layers, experts] host counts of the routes."""
        return torch.stack(
            [torch.bincount(layer.flatten(), minlength=NUM_EXPERTS) for layer in ids]
        )[None]

    def _routing(self, batch, counts=None):
        ids = random_routes(3, batch[0].numel(), seed=17)
        counts = self._counts(ids) if counts is None else counts(self._counts(ids))
        return MoERouting(
            MOE_LAYERS, expert_ids=ids, every_token_routed=True, host_tokens_per_expert=counts
        )

    def test_host_counts_give_identical_results_without_counting_on_the_device(self, monkeypatch):
        batch = make_batch()
        with_counts = self._routing(batch)
        plain = MoERouting(MOE_LAYERS, expert_ids=with_counts.expert_ids, every_token_routed=True)
        want_loss, want_grads = run_model(_gpt(_config()), batch, plain)
        monkeypatch.setattr(
            MoEAlltoAllTokenDispatcher, "preprocess", lambda *a: pytest.fail("counted on device")
        )
        loss, grads = run_model(_gpt(_config()), batch, with_counts)
        assert torch.equal(loss, want_loss)
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), name

    def test_counts_wrong_per_expert_are_reported_by_verify_naming_layer_expert_rank(self):
        def swapped(counts):
            counts = counts.clone()
            column = counts[0, 1]
            first, second = int(column.argmax()), int(column.argmin())  # two counts that differ
            column[[first, second]] = column[[second, first]]
            return counts

        batch = make_batch()
        routing = self._routing(batch, swapped)
        column = routing.host_tokens_per_expert[0, 1]
        expert = int((column != self._counts(routing.expert_ids)[0, 1]).nonzero()[0])
        model = _gpt(_config())
        run_model(model, batch, routing)  # no device-side assert: the pass runs to its end
        with pytest.raises(
            ValueError, match=f"wrong at MoE layer 3, expert {expert}, tp_ep rank 0: the routes"
        ):
            routing.verify()
        # The process goes on: the next microbatch, with right counts, runs and verifies.
        good = self._routing(batch)
        run_model(model, batch, good)
        good.verify()
        # Negative control: with the check off nothing is kept, so nothing is reported.
        unchecked = self._routing(batch, swapped)
        run_model(_gpt(_config(moe_check_host_tokens_per_expert=False)), batch, unchecked)
        unchecked.verify()

    def test_counts_wrong_in_sum_are_refused_on_the_host(self):
        batch = make_batch()

        def one_more(counts):
            counts = counts.clone()
            counts[0, 0, 0] += 1
            return counts

        with pytest.raises(
            ValueError, match="counts 65 routed tokens for MoE layer 2 on tp_ep rank 0"
        ):
            run_model(_gpt(_config()), batch, self._routing(batch, one_more), backward=False)

    def test_host_counts_need_routes_for_every_token(self):
        batch = make_batch()
        routing = self._routing(batch)
        routing.every_token_routed = False
        with pytest.raises(ValueError, match="needs routes for every token"):
            run_model(_gpt(_config()), batch, routing, backward=False)

    @pytest.mark.parametrize(
        "option, reason",
        [
            (dict(moe_token_dispatcher_type="allgather"), "only 'alltoall'"),
            (dict(moe_router_padding_for_quantization=True), "padding_for_quantization changes"),
        ],
        ids=["allgather", "padding_for_quantization"],
    )
    def test_configurations_without_host_counts_refuse_them(self, option, reason):
        batch = make_batch()
        model = _gpt(_config())
        for name, value in option.items():
            # Set after the build: the check before any layer runs reads the model's config.
            setattr(model.config, name, value)
        routing = self._routing(batch)
        with pytest.raises(ValueError, match=f"host_tokens_per_expert cannot be used: .*{reason}"):
            run_model(model, batch, routing, backward=False)

    def test_the_fused_permutation_takes_host_counts(self, monkeypatch):
        """Under moe_permute_fusion the dispatch takes host counts and reaches the fused
        permutation (over two tp_ep ranks: tests/test_host_counts_across_ranks.py)."""
        config = _config()
        dispatcher = MoEAlltoAllTokenDispatcher(
            NUM_EXPERTS, list(range(NUM_EXPERTS)), config, moe_utils.get_default_pg_collection()
        )
        config.moe_permute_fusion = True  # set after the build: it needs TransformerEngine to build
        assert host_counts_unsupported(config) is None

        class Permuted(Exception):
            """The dispatch took the counts and reached the (fused) permutation."""

        def permute(*args, fused, **kwargs):
            assert fused
            raise Permuted

        monkeypatch.setattr(token_dispatcher, "permute", permute)
        ids = random_routes(1, 12, seed=2)[0]
        routing_map = as_routing_map(ids)
        counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)[None]
        with pytest.raises(Permuted):
            dispatcher.dispatch_preprocess(
                torch.randn(12, HIDDEN), routing_map, routing_map.float() / TOPK,
                host_tokens_per_expert=counts,
            )
        assert dispatcher.counts_on_host and torch.equal(dispatcher.tokens_per_expert, counts[0])

    def test_the_dispatch_takes_the_counts_as_an_argument(self):
        config = _config()
        dispatcher = MoEAlltoAllTokenDispatcher(
            NUM_EXPERTS, list(range(NUM_EXPERTS)), config, moe_utils.get_default_pg_collection()
        )
        ids = random_routes(1, 12, seed=2)[0]
        routing_map = as_routing_map(ids)
        probs = routing_map.float() / TOPK
        counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)[None]
        hidden = torch.randn(12, HIDDEN)

        dispatcher.dispatch_preprocess(hidden, routing_map, probs, host_tokens_per_expert=counts)
        assert dispatcher.counts_on_host and torch.equal(dispatcher.tokens_per_expert, counts[0])
        dispatcher.dispatch_preprocess(hidden, routing_map, probs)
        assert not dispatcher.counts_on_host  # nothing carried over from the previous dispatch


class TestRouterReplayOnThePatchedTree:
    """Upstream's RouterReplay API and behaviour keep working with the series applied."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        RouterReplay.clear_global_router_replay_instances()

    def teardown_method(self, method):
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_instances()
        Utils.destroy_model_parallel()

    def test_record_and_replay_forward(self):
        model = _gpt(_config())
        assert len(RouterReplay.global_router_replay_instances) == len(MOE_LAYERS)
        tokens, position_ids, _ = make_batch()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad(), routing_maps(model) as live:
            model(tokens, position_ids, None)
        recorded = RouterReplay.get_recorded_data()
        forced = list(random_routes(3, tokens.numel(), seed=8))
        RouterReplay.set_replay_data(forced)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with torch.no_grad(), routing_maps(model) as seen:
            model(tokens, position_ids, None)
        for row, layer in enumerate(MOE_LAYERS):
            assert torch.equal(as_routing_map(recorded[row]), live[layer][0])
            assert torch.equal(seen[layer][0], as_routing_map(forced[row]))

    def test_replay_backward_pops_the_fifo_in_the_recompute(self):
        config = _config(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
        model = _gpt(config)
        tokens, position_ids, labels = make_batch()
        forced = list(random_routes(3, tokens.numel(), seed=21))
        RouterReplay.set_replay_data(forced)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with routing_maps(model) as seen:
            loss = model(tokens, position_ids, None, labels=labels)
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            loss.sum().backward()
        for row, layer in enumerate(MOE_LAYERS):
            assert len(seen[layer]) == 2
            assert all(torch.equal(m, as_routing_map(forced[row])) for m in seen[layer])
        assert all(
            r.replay_backward_list == [] for r in RouterReplay.global_router_replay_instances
        )
