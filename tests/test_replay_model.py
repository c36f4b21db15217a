"""GPTModel with per-microbatch MoERouting (single rank): exact replay, recording (R2),
recompute, forward-only then train, two models, flat memory, early errors, config checks."""

import gc

import pytest
import torch

from megatron.core.transformer.moe.moe_routing import MoERouting
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from tests.support.replay import (
    NUM_EXPERTS,
    TOPK,
    capture_routes,
    init_single_rank,
    make_batch,
    make_config,
    make_model,
    moe_layers,
    random_routes,
    routes_as_map,
)

MOE_LAYERS = [2, 3, 4]


# In-process CPU models: Megatron must not pick up a visible GPU (gpu-marked tests excepted).
pytestmark = pytest.mark.usefixtures("megatron_on_cpu")


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_rank()


def forced_routing(tokens, seed=0, no_route_every=0):
    batch_size, seq = tokens.shape
    ids = random_routes(len(MOE_LAYERS), seq * batch_size, seed=seed)
    if no_route_every:
        ids[:, ::no_route_every] = -1
    return MoERouting(layer_numbers=MOE_LAYERS, expert_ids=ids)


def train_step(model, batch, routing):
    tokens, position_ids, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, None, labels=labels, moe_routing=routing)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_forced_routes_are_the_routes_taken_and_recorded():
    model = make_model(make_config())
    batch = make_batch()
    routing = forced_routing(batch[0], seed=1)
    assert model.decoder.moe_layer_numbers == MOE_LAYERS
    with capture_routes(model) as seen:
        train_step(model, batch, routing)
    assert sorted(seen) == MOE_LAYERS
    for row, layer_number in enumerate(MOE_LAYERS):
        assert torch.equal(seen[layer_number][0], routes_as_map(routing.expert_ids[row]))
    assert torch.equal(routing.recorded_expert_ids(), routing.expert_ids)


def test_record_then_replay_reproduces_logits_and_routes():
    """R2: record in a forward-only (old log-prob) pass, replay in the update pass."""
    model = make_model(make_config())
    tokens, position_ids, _ = make_batch()
    record = MoERouting(layer_numbers=MOE_LAYERS)
    model.eval()
    with torch.no_grad(), capture_routes(model) as first:
        logits = model(tokens, position_ids, None, moe_routing=record)
    recorded = record.recorded_expert_ids()
    assert recorded.shape == (3, tokens.numel(), TOPK) and recorded.dtype == torch.int64

    model.train()
    with capture_routes(model) as second:
        replayed_logits = model(
            tokens, position_ids, None, moe_routing=MoERouting(MOE_LAYERS, expert_ids=recorded)
        )
    torch.testing.assert_close(replayed_logits, logits, rtol=0, atol=0)
    for layer_number in MOE_LAYERS:
        assert torch.equal(second[layer_number][0], first[layer_number][0])


def test_rows_without_route_use_the_live_router_in_the_model():
    model = make_model(make_config())
    tokens, position_ids, _ = make_batch()
    with torch.no_grad(), capture_routes(model) as live:
        model(tokens, position_ids, None)
    routing = forced_routing(tokens, seed=4)
    routing.expert_ids[:] = -1  # all rows "no route": exactly the live routing
    with torch.no_grad(), capture_routes(model) as seen:
        model(tokens, position_ids, None, moe_routing=routing)
    for row, layer_number in enumerate(MOE_LAYERS):
        assert torch.equal(seen[layer_number][0], live[layer_number][0])
        assert torch.equal(routes_as_map(routing.recorded_expert_ids()[row]), live[layer_number][0])


RECOMPUTE = {
    "full_uniform": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full_block": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=4
    ),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_recompute_gives_bit_identical_grads(recompute):
    batch = make_batch()
    # Forced routes, and -1 rows that the live router decides (recompute must agree).
    routing_args = dict(seed=9, no_route_every=4)
    reference = make_model(make_config())
    want_loss, want_grads = train_step(reference, batch, forced_routing(batch[0], **routing_args))

    model = make_model(make_config(**RECOMPUTE[recompute]))
    routing = forced_routing(batch[0], **routing_args)
    with capture_routes(model) as seen:
        loss, grads = train_step(model, batch, routing)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name
    # The recompute really ran the routers again, with the same routes.
    for layer_number in MOE_LAYERS:
        assert len(seen[layer_number]) == 2
        assert torch.equal(seen[layer_number][0], seen[layer_number][1])


def test_forward_only_pass_leaves_nothing_for_the_next_training_step():
    config = make_config(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    model = make_model(config)
    batch = make_batch()
    stale = forced_routing(batch[0], seed=100)
    with torch.no_grad():
        model(batch[0], batch[1], None, moe_routing=stale)  # forward-only, never backwarded
    routing = forced_routing(batch[0], seed=200)
    with capture_routes(model) as seen:
        train_step(model, batch, routing)
    for row, layer_number in enumerate(MOE_LAYERS):
        want = routes_as_map(routing.expert_ids[row])
        assert len(seen[layer_number]) == 2  # forward and recompute
        assert all(torch.equal(m, want) for m in seen[layer_number])


def test_two_models_in_one_process_replay_independently():
    policy = make_model(make_config(), seed=1)
    reference = make_model(make_config(), seed=2)
    batch = make_batch()
    policy_routes = forced_routing(batch[0], seed=10)
    reference_routes = forced_routing(batch[0], seed=20)
    with capture_routes(policy) as seen_policy, capture_routes(reference) as seen_reference:
        policy_loss = policy(batch[0], batch[1], None, labels=batch[2], moe_routing=policy_routes)
        with torch.no_grad():
            reference(batch[0], batch[1], None, moe_routing=reference_routes)
        policy_loss.sum().backward()
    for row, layer_number in enumerate(MOE_LAYERS):
        assert torch.equal(
            seen_policy[layer_number][0], routes_as_map(policy_routes.expert_ids[row])
        )
        assert torch.equal(
            seen_reference[layer_number][0], routes_as_map(reference_routes.expert_ids[row])
        )


def _tensor_count():
    gc.collect()
    return sum(1 for obj in gc.get_objects() if torch.is_tensor(obj))


def test_replay_memory_stays_flat_over_2000_microbatches():
    model = make_model(make_config(num_layers=2, moe_layer_freq=[0, 1]))
    tokens, position_ids, _ = make_batch(batch_size=1, seq=4)

    def microbatch(i):
        ids = random_routes(1, tokens.numel(), seed=i)
        # Training-mode forward whose graph is dropped without a backward: the case where
        # the upstream FIFO keeps every entry.
        model(tokens, position_ids, None, moe_routing=MoERouting([2], expert_ids=ids))

    for i in range(50):
        microbatch(i)
    baseline = _tensor_count()
    for i in range(2000):
        microbatch(i)
    assert _tensor_count() <= baseline
    for instance in RouterReplay.global_router_replay_instances:
        assert instance.replay_backward_list == [] and instance.target_topk_idx is None


def _bad(tokens, mutate):
    routing = forced_routing(tokens, seed=3)
    mutated = mutate(routing)  # a new MoERouting, or an in-place edit of this one
    return mutated if isinstance(mutated, MoERouting) else routing


BAD_INPUTS = {
    "wrong_layer_count": (
        lambda r: MoERouting(MOE_LAYERS[:2], expert_ids=r.expert_ids[:2]),
        "covers MoE layers \\[2, 3\\], but this model chunk builds MoE layers \\[2, 3, 4\\]",
    ),
    "wrong_layer_rows": (
        lambda r: MoERouting(MOE_LAYERS, expert_ids=r.expert_ids[:2]),
        "wrong layer count",
    ),
    "wrong_token_count": (
        lambda r: MoERouting(MOE_LAYERS, expert_ids=r.expert_ids[:, :-1]),
        "31 tokens per layer.*32 tokens.*wrong token count",
    ),
    "topk_mismatch": (
        lambda r: MoERouting(MOE_LAYERS, expert_ids=r.expert_ids[..., :1]),
        "1 experts per token, but moe_router_topk is 2",
    ),
    "float_dtype": (
        lambda r: MoERouting(MOE_LAYERS, expert_ids=r.expert_ids.float()),
        "must be int64.*float32",
    ),
    "int32_dtype": (
        lambda r: MoERouting(MOE_LAYERS, expert_ids=r.expert_ids.int()),
        "must be int64.*int32",
    ),
    "id_out_of_range": (
        lambda r: r.expert_ids[1, 13].fill_(NUM_EXPERTS),
        "outside \\[0, 8\\).*sample 1, position 6 \\(token 13 on this rank\\), layer 3",
    ),
    "negative_id": (
        lambda r: r.expert_ids[2, 4, 1].fill_(-2),
        "outside \\[0, 8\\).*sample 0, position 2 \\(token 4 on this rank\\), layer 4",
    ),
    "partly_no_route": (
        lambda r: r.expert_ids[0, 7, 0].fill_(-1),
        "outside \\[0, 8\\).*sample 1, position 3 \\(token 7 on this rank\\), layer 2",
    ),
    "duplicate_ids": (
        lambda r: r.expert_ids[2, 30].fill_(5),
        "duplicate expert ids.*sample 0, position 15 \\(token 30 on this rank\\), layer 4",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_replay_input_fails_before_the_model_runs(case):
    mutate, message = BAD_INPUTS[case]
    model = make_model(
        make_config(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    )
    batch = make_batch()
    routing = _bad(batch[0], mutate)
    ran = []
    model.embedding.register_forward_pre_hook(lambda *args: ran.append("embedding"))
    for layer in moe_layers(model):
        layer.router.register_forward_pre_hook(lambda *args: ran.append("router"))
    with pytest.raises(ValueError, match=message):
        model(batch[0], batch[1], None, labels=batch[2], moe_routing=routing)
    assert ran == []
    for layer in moe_layers(model):
        assert layer.router.local_tokens_per_expert.sum() == 0


def test_routes_validated_upstream_skip_only_the_value_check():
    """values_checked=True (the data plane validated on the host) drops the syncing value check, not shapes."""
    tokens = make_batch()[0]
    shape = dict(layer_numbers=MOE_LAYERS, num_tokens=tokens.numel(), batch_size=tokens.shape[0],
                 num_experts=NUM_EXPERTS, topk=2)
    ids = forced_routing(tokens, seed=3).expert_ids.clone()
    ids[1, 13].fill_(NUM_EXPERTS)
    with pytest.raises(ValueError, match="outside"):
        MoERouting(MOE_LAYERS, expert_ids=ids).validate(**shape)
    MoERouting(MOE_LAYERS, expert_ids=ids, values_checked=True).validate(**shape)
    with pytest.raises(ValueError, match="wrong token count"):
        MoERouting(MOE_LAYERS, expert_ids=ids[:, :-1], values_checked=True).validate(**shape)


REJECTED = {
    "moe_router_fusion": dict(moe_router_fusion=True),
    "moe_expert_capacity_factor": dict(
        moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="aux_loss"
    ),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0),
    "moe_router_force_load_balancing": dict(moe_router_force_load_balancing=True),
    "cuda_graph_impl": dict(cuda_graph_impl="local"),
    "enable_cuda_graph": dict(enable_cuda_graph=True),
}


@pytest.mark.parametrize("option", sorted(REJECTED))
def test_options_that_would_ignore_replay_are_rejected_at_config_time(option):
    with pytest.raises(ValueError, match="moe_enable_routing_replay does not support"):
        make_config(**REJECTED[option])
    # The same options stay valid without replay.
    if option not in ("cuda_graph_impl", "enable_cuda_graph", "moe_router_fusion"):
        make_config(moe_enable_routing_replay=False, **REJECTED[option])


def test_moe_routing_is_refused_on_a_model_with_mtp_layers():
    """MTP routers run outside the decoder: refuse rather than route them live silently.
    The config itself stays valid (the upstream RouterReplay API covers MTP routers)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    config = make_config(mtp_num_layers=1)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False)
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=64, mtp_block_spec=mtp)
    tokens, position_ids, labels = make_batch()
    with pytest.raises(ValueError, match="does not cover MTP layers"):
        model(tokens, position_ids, None, labels=labels, moe_routing=forced_routing(tokens))


def test_combined_1f1b_is_rejected_with_replay():
    with pytest.raises(ValueError, match="does not support overlap_moe_expert_parallel_comm"):
        make_config(
            overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2, bf16=True
        )


def test_model_without_replay_flag_rejects_moe_routing():
    model = make_model(make_config(moe_enable_routing_replay=False))
    batch = make_batch()
    with pytest.raises(ValueError, match="moe_enable_routing_replay is off"):
        model(batch[0], batch[1], None, moe_routing=forced_routing(batch[0]))


def test_upstream_router_replay_api_keeps_working():
    RouterReplay.clear_global_router_replay_instances()
    try:
        model = make_model(make_config())
        assert len(RouterReplay.global_router_replay_instances) == len(MOE_LAYERS)
        tokens, position_ids, _ = make_batch()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad(), capture_routes(model) as live:
            model(tokens, position_ids, None)
        recorded = RouterReplay.get_recorded_data()
        assert [r.shape for r in recorded] == [(tokens.numel(), TOPK)] * 3

        forced = list(random_routes(3, tokens.numel(), seed=8))
        RouterReplay.set_replay_data(forced)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with torch.no_grad(), capture_routes(model) as seen:
            model(tokens, position_ids, None)
        for row, layer_number in enumerate(MOE_LAYERS):
            assert torch.equal(routes_as_map(recorded[row]), live[layer_number][0])
            assert torch.equal(seen[layer_number][0], routes_as_map(forced[row]))

        # Mixing the global action with a per-microbatch MoERouting is an error.
        with pytest.raises(ValueError, match="use one of the two"):
            model(tokens, position_ids, None, moe_routing=forced_routing(tokens))
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_instances()


def test_upstream_router_replay_fifo_backward_keeps_working_with_recompute():
    RouterReplay.clear_global_router_replay_instances()
    try:
        config = make_config(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
        model = make_model(config)
        tokens, position_ids, labels = make_batch()
        forced = list(random_routes(3, tokens.numel(), seed=21))
        RouterReplay.set_replay_data(forced)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with capture_routes(model) as seen:
            loss = model(tokens, position_ids, None, labels=labels)
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            loss.sum().backward()
        for row, layer_number in enumerate(MOE_LAYERS):
            assert len(seen[layer_number]) == 2  # forward, then the recompute in backward
            assert all(torch.equal(m, routes_as_map(forced[row])) for m in seen[layer_number])
        assert all(r.replay_backward_list == [] for r in RouterReplay.global_router_replay_instances)
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_instances()


def test_bf16_model_behind_float16module_replays_with_router_grads():
    """The moe_routing kwarg passes through Megatron's mixed-precision wrapper."""
    from megatron.core.transformer.module import Float16Module

    config = make_config(bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32")
    model = Float16Module(config, make_model(config))
    tokens, position_ids, labels = make_batch()
    routing = forced_routing(tokens, seed=31, no_route_every=3)
    with capture_routes(model.module) as seen:
        loss = model(tokens, position_ids, None, labels=labels, moe_routing=routing)
    loss.float().sum().backward()
    for row, layer_number in enumerate(MOE_LAYERS):
        ids = routing.expert_ids[row]
        routed = (ids >= 0).all(dim=-1)
        assert torch.equal(seen[layer_number][0][routed], routes_as_map(ids[routed].clamp(min=0)))
    for layer in moe_layers(model.module):
        assert layer.router.weight.grad.abs().sum() > 0
