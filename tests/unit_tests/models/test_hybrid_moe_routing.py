# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
"""Per-microbatch routing replay (MoERouting) through HybridModel, beside test_moe_routing.py.

The MoE layers of a hybrid MTP block replay too, numbered after the decoder's.
HybridModel's own stack specs need TransformerEngine; these CPU tests build the stack from
Megatron's local modules (megatron_r3.layers.hybrid_specs), for patterns of attention (``*``),
MLP (``-``) and MoE (``E``) layers.
"""


import pytest
import torch

from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_routing import MoERouting
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_r3.layers.hybrid_specs import get_hybrid_stack_r3_spec
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


# In-process CPU models: Megatron must not pick up a visible GPU.

def _moe_numbers(pattern):
    """Global 1-based numbers of a main pattern's MoE layers."""
    main = pattern.split("/")[0].replace("|", "")
    return [i + 1 for i, symbol in enumerate(main) if symbol == "E"]


def _config(pattern, **overrides):
    fields = dict(
        num_layers=len(pattern.split("/")[0].replace("|", "")),
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=16,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        is_hybrid_model=True,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _hybrid(pattern, seed=7, vp_stage=None, pre_process=True, post_process=True, **overrides):
    torch.manual_seed(seed)
    config = _config(pattern, **overrides)
    return HybridModel(
        config,
        get_hybrid_stack_r3_spec(pattern, NUM_EXPERTS),
        vocab_size=VOCAB,
        max_sequence_length=64,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )


def _forced(layers, num_tokens, seed=0, no_route_every=0, **kwargs):
    ids = random_routes(len(layers), num_tokens, seed)
    if no_route_every:
        ids[:, ::no_route_every] = -1
    return MoERouting(layers, expert_ids=ids, **kwargs)




class TestMoERoutingInHybridModel:
    """hybrid: hand MoERouting from HybridModel to the MoE layers of its stack."""

    PATTERNS = ["*E*E", "*-*E", "E-*E"]
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

    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_forced_random_routes_are_the_routes_taken(self, pattern):
        model = _hybrid(pattern)
        batch = make_batch()
        layers = _moe_numbers(pattern)
        routing = _forced(layers, batch[0].numel(), seed=1, every_token_routed=True)
        assert model.decoder.moe_layer_numbers == layers
        with routing_maps(model) as seen:
            run_model(model, batch, routing)
        assert sorted(seen) == layers
        for row, layer in enumerate(layers):
            assert torch.equal(seen[layer][0], as_routing_map(routing.expert_ids[row]))

    def test_rows_without_a_route_are_routed_live(self):
        pattern = "*E*E"
        model = _hybrid(pattern)
        batch = make_batch()
        layers = _moe_numbers(pattern)
        with routing_maps(model) as live:
            run_model(model, batch, MoERouting(layers), backward=False)
        routing = _forced(layers, batch[0].numel(), seed=2, no_route_every=3)
        with routing_maps(model) as seen:
            run_model(model, batch, routing, backward=False)
        routed = (routing.expert_ids >= 0).all(dim=-1)
        # The first MoE layer sees the same hidden states either way: its live rows match.
        assert torch.equal(seen[2][0][~routed[0]], live[2][0][~routed[0]])
        for row, layer in enumerate(layers):
            assert torch.equal(seen[layer][0][routed[row]], as_routing_map(routing.expert_ids[row][routed[row]]))

    def test_the_recording_is_the_routes_taken_and_replays_the_same_pass(self):
        pattern = "*E-E"
        model = _hybrid(pattern)
        batch = make_batch()
        layers = _moe_numbers(pattern)
        recording = MoERouting(layers, record=True)  # live routing, recorded
        with routing_maps(model) as seen:
            want_loss, want_grads = run_model(model, batch, recording)
        recorded = recording.recorded_expert_ids()
        assert recorded.shape == (len(layers), batch[0].numel(), TOPK)
        for row, layer in enumerate(layers):
            assert torch.equal(as_routing_map(recorded[row]), seen[layer][0])
        replay = MoERouting(layers, expert_ids=recorded, every_token_routed=True)
        loss, grads = run_model(model, batch, replay)
        assert torch.equal(loss, want_loss)
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), name

    def test_replayed_routers_get_gradients_from_their_own_scores(self):
        pattern = "*E*E"
        model = _hybrid(pattern)
        batch = make_batch()
        layers = _moe_numbers(pattern)
        _, grads = run_model(model, batch, _forced(layers, batch[0].numel(), seed=5, every_token_routed=True))
        routers = [name for name in grads if name.endswith("router.weight")]
        assert len(routers) == len(layers)
        assert all(grads[name].abs().sum() > 0 and grads[name].isfinite().all() for name in routers)
        # Other forced routes give the routers other gradients: the probabilities are gathered
        # at the replayed experts.
        _, other = run_model(model, batch, _forced(layers, batch[0].numel(), seed=6, every_token_routed=True))
        assert all(not torch.equal(grads[name], other[name]) for name in routers)

    @pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
    def test_recompute_replays_the_same_routes_bit_for_bit(self, recompute):
        pattern = "*E*E"
        layers = _moe_numbers(pattern)
        batch = make_batch()

        def forced():
            return _forced(layers, batch[0].numel(), seed=9, no_route_every=4)

        want_loss, want_grads = run_model(_hybrid(pattern), batch, forced())
        model = _hybrid(pattern, **self.RECOMPUTE[recompute])
        with routing_maps(model) as seen:
            loss, grads = run_model(model, batch, forced())
        assert torch.equal(loss, want_loss)
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), name
        for layer in layers:  # the recompute ran the routers again, the same way
            assert len(seen[layer]) == 2 and torch.equal(seen[layer][0], seen[layer][1])

    def test_only_moe_layers_are_given_the_routes(self):
        pattern = "*-*E"
        model = _hybrid(pattern)
        batch = make_batch()
        given = {}
        for layer in model.decoder.layers:

            def hook(module, args, kwargs):
                given[module.layer_number] = "moe_routing" in kwargs

            layer.register_forward_pre_hook(hook, with_kwargs=True)
        run_model(model, batch, _forced([4], batch[0].numel()), backward=False)
        assert given == {1: False, 2: False, 3: False, 4: True}

    BAD_ROUTES = {
        "missing_layer": (lambda ids: MoERouting([2], expert_ids=ids[:1]), "also builds MoE layers \\[4\\]"),
        "foreign_layer": (
            lambda ids: MoERouting([1, 2, 4], expert_ids=torch.cat([ids[:1], ids])),
            "routes for MoE layers \\[1\\], which this model chunk does not build",
        ),
        "token_count": (
            lambda ids: MoERouting([2, 4], expert_ids=ids[:, :-1]),
            "num_tokens=32 \\(s_local \\* b on this rank\\)",
        ),
        "int32_ids": (lambda ids: MoERouting([2, 4], expert_ids=ids.int()), "int64.*int32"),
        "replay_disabled": (lambda ids: MoERouting([2, 4], expert_ids=ids), "moe_enable_routing_replay"),
    }

    @pytest.mark.parametrize("case", sorted(BAD_ROUTES))
    def test_bad_routes_fail_before_any_layer_runs(self, case):
        make, message = self.BAD_ROUTES[case]
        overrides = dict(moe_enable_routing_replay=False) if case == "replay_disabled" else {}
        model = _hybrid("*E*E", **overrides)
        batch = make_batch()
        ran = []
        for layer in model.decoder.layers:
            layer.register_forward_pre_hook(lambda *args: ran.append("layer"))
        with pytest.raises(ValueError, match=message):
            run_model(model, batch, make(random_routes(2, batch[0].numel(), seed=3)), backward=False)
        assert ran == []

    def test_the_value_check_runs_before_any_layer(self):
        """moe_routing_replay_check_values checks the ids in the hybrid stack as in the decoder
        block: a duplicate id in a row fails by name before any layer runs (without the check
        the stack ran into the dispatcher's split sizes)."""
        model = _hybrid("*E*E", moe_routing_replay_check_values=True)
        batch = make_batch()
        ids = random_routes(2, batch[0].numel(), seed=3)
        ids[1, 30] = 5  # token 30 = position 15 of sample 0 (s-major, b = 2)
        ran = []
        for layer in model.decoder.layers:
            layer.register_forward_pre_hook(lambda *args: ran.append("layer"))
        with pytest.raises(
            ValueError, match="duplicate expert ids.*sample 0, position 15 .*, layer 4: \\[5, 5\\]"
        ):
            run_model(model, batch, MoERouting([2, 4], expert_ids=ids), backward=False)
        assert ran == []


class TestMoERoutingInHybridMTP:
    """hybrid: replay MoERouting in the MoE layers of a hybrid MTP block.

    MTP depth ``k`` of ``*E*E/*E/*E`` runs the pattern ``*E``: a MoERouting numbers its layers
    after the decoder's and the earlier depths' (``num_layers + (k - 1) * 2 + j``), so the MoE
    layers of the two depths are 6 and 8, as GPTModel's MTP layers are ``num_layers + k``.
    """

    PATTERN = "*E*E/*E/*E"
    DECODER, MTP = [2, 4], [6, 8]

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _model(self):
        model = _hybrid(self.PATTERN, mtp_num_layers=2)
        model.eval()  # the MTP block runs; its training-only loss logging (CUDA-only) does not
        return model

    def _forward(self, model, routing):
        tokens, position_ids, _ = make_batch()
        with torch.no_grad(), routing_maps(model) as seen:
            model(tokens, position_ids, None, extra_block_kwargs={"moe_routing": routing})
        return seen

    def test_mtp_moe_layers_are_numbered_after_the_decoder_depth_by_depth(self):
        model = self._model()
        assert model.decoder.moe_layer_numbers == self.DECODER
        assert model.mtp.moe_layer_numbers == self.MTP

    def test_forced_routes_replay_in_the_decoder_and_every_mtp_depth(self):
        model = self._model()
        layers = self.DECODER + self.MTP
        routing = _forced(layers, make_batch()[0].numel(), seed=4, every_token_routed=True)
        seen = self._forward(model, routing)
        assert sorted(seen) == layers
        for row, layer in enumerate(layers):
            assert len(seen[layer]) == 1
            assert torch.equal(seen[layer][0], as_routing_map(routing.expert_ids[row]))

    def test_mtp_layers_without_rows_route_live(self):
        model = self._model()
        routing = _forced(self.DECODER, make_batch()[0].numel(), seed=4, every_token_routed=True)
        seen = self._forward(model, routing)
        for layer in self.MTP:  # their own top-k: TOPK experts per token, none of the rows given
            assert seen[layer][0].sum(dim=-1).eq(TOPK).all()
            assert all(not torch.equal(seen[layer][0], as_routing_map(ids)) for ids in routing.expert_ids)

    def test_the_recording_covers_the_mtp_layers_and_replays_the_same_pass(self):
        model = self._model()
        tokens, position_ids, labels = make_batch()
        layers = self.DECODER + self.MTP
        recording = MoERouting(layers, record=True)
        with torch.no_grad():
            want = model(tokens, position_ids, None, labels=labels, extra_block_kwargs={"moe_routing": recording})
        recorded = recording.recorded_expert_ids()
        assert recorded.shape == (len(layers), tokens.numel(), TOPK)
        replay = MoERouting(layers, expert_ids=recorded, every_token_routed=True)
        with torch.no_grad():
            loss = model(tokens, position_ids, None, labels=labels, extra_block_kwargs={"moe_routing": replay})
        assert torch.equal(loss, want)

    @pytest.mark.parametrize("layers, bad", [([2, 4, 5], [5]), ([2, 4, 6, 8, 10], [10])])
    def test_routes_for_mtp_layers_the_model_does_not_build_are_refused(self, layers, bad):
        model = self._model()
        routing = _forced(layers, make_batch()[0].numel())
        ran = []
        for layer in model.decoder.layers:
            layer.register_forward_pre_hook(lambda *args: ran.append("layer"))
        with pytest.raises(ValueError, match=f"MoE layers \\{bad}.*MTP block builds MoE layers \\[6, 8\\]"):
            self._forward(model, routing)
        assert ran == []


class TestMoERoutingAcrossHybridStages:
    """Each stage of a ``|``-split pattern replays the rows of its own global MoE layers.

    One process builds both stages as the virtual stages of one pipeline rank (segment
    ``vp_stage * pp_size + pp_rank``), runs them in turn and compares with the whole model.
    """

    PATTERN = "*E-|E*E"

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _stages(self, whole):
        first = _hybrid(self.PATTERN, vp_stage=0, post_process=False)
        second = _hybrid(self.PATTERN, vp_stage=1, pre_process=False)
        state = whole.state_dict()
        for stage, offset in ((first, 0), (second, 3)):
            own = {}
            for name in stage.state_dict():
                source = name
                if name.startswith("decoder.layers."):
                    index, rest = name[len("decoder.layers.") :].split(".", 1)
                    source = f"decoder.layers.{int(index) + offset}.{rest}"
                own[name] = state[source]
            stage.load_state_dict(own)
        return first, second

    def test_stages_build_their_global_moe_layers_and_replay_like_the_whole_model(self):
        whole = _hybrid(self.PATTERN.replace("|", ""))
        first, second = self._stages(whole)
        assert first.decoder.moe_layer_numbers == [2]
        assert second.decoder.moe_layer_numbers == [4, 6]
        tokens, position_ids, labels = make_batch()
        ids = random_routes(3, tokens.numel(), seed=8)

        want = whole(
            tokens, position_ids, None, labels=labels,
            extra_block_kwargs={"moe_routing": MoERouting([2, 4, 6], expert_ids=ids)},
        )
        with routing_maps(first) as seen_first, routing_maps(second) as seen_second:
            hidden = first(
                tokens, position_ids, None,
                extra_block_kwargs={"moe_routing": MoERouting([2], expert_ids=ids[:1])},
            )
            second.set_input_tensor(hidden)
            loss = second(
                None, position_ids, None, labels=labels,
                extra_block_kwargs={"moe_routing": MoERouting([4, 6], expert_ids=ids[1:])},
            )
        assert torch.equal(seen_first[2][0], as_routing_map(ids[0]))
        assert torch.equal(seen_second[4][0], as_routing_map(ids[1]))
        assert torch.equal(seen_second[6][0], as_routing_map(ids[2]))
        assert torch.equal(loss, want)

    def test_a_stage_refuses_the_rows_of_another_stage(self):
        whole = _hybrid(self.PATTERN.replace("|", ""))
        first, second = self._stages(whole)
        tokens, position_ids, labels = make_batch()
        hidden = first(tokens, position_ids, None)
        second.set_input_tensor(hidden)
        routing = MoERouting([2, 4, 6], expert_ids=random_routes(3, tokens.numel()))
        with pytest.raises(ValueError, match="MoE layers \\[2\\], which this model chunk does not build"):
            second(None, position_ids, None, labels=labels, extra_block_kwargs={"moe_routing": routing})
