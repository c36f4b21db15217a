"""megatron_r3.rl.model.factory: the flags reach the TransformerConfig (through ModelSettings), and the
routers take a MoERouting exactly when a pass gives them one."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state

from megatron_r3.layers import transformer_impl
from megatron_r3.rl.arguments import (
    model_settings,
    parallel_settings,
    parse_args,
    policy_update_settings,
    routers_take_moe_routing,
)
from megatron_r3.rl.initialize import init_model_parallel
from megatron_r3.rl.model.factory import build_model, experts_grouped_gemm_impl, transformer_config
from megatron_r3.rl.trainer.policy_trainer import PolicyTrainer
from tests.support.launcher import run_workers
from tests.support.parallel import Layout

CPU = torch.device("cpu")
DUMP = ["--rollout-dump", "x.r3dump", "--vocab-size", "64", "--seq-length", "64"]


@pytest.mark.parametrize("flags, takes", [
    ([], True),  # the embedded run compares by default: its live-trained policy replays in that pass
    (["--no-r3-compare"], False),
    (["--moe-enable-routing-replay"], True),
    (["--moe-enable-routing-replay", "--no-r3-compare"], True),
    (["--moe-enable-routing-replay", "--routing-replay-mode", "r2", "--no-r3-compare"], True),
    (DUMP, False),  # dump mode does not compare by default
    (DUMP + ["--r3-compare"], True),
    (DUMP + ["--moe-enable-routing-replay"], True),
])
def test_routers_take_moe_routing_when_a_pass_gives_them_one(flags, takes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.r3dump").touch()  # the flags only ask that the file exists
    args = parse_args(flags)
    assert routers_take_moe_routing(args) is takes
    model = model_settings(args)
    assert model.routing_replay.enabled is takes
    config = transformer_config(model, CPU)
    assert config.moe_enable_routing_replay is takes
    # The trainer's passes agree with the model: it refuses only a model built without the field.
    settings = policy_update_settings(args)
    assert settings.routers_take_moe_routing is takes
    if takes:
        live_only = transformer_config(model_settings(parse_args(DUMP)), CPU)
        with pytest.raises(ValueError, match="need routers that take a MoERouting"):
            PolicyTrainer(None, live_only, None, None, settings)
    # The rollout engine records its routes whatever the training flags say, in bf16.
    engine = transformer_config(model, CPU, rollout_engine=True)
    assert engine.moe_enable_routing_replay and engine.bf16 and engine.params_dtype == torch.bfloat16
    assert not config.bf16
    # It runs its experts as grouped GEMMs, as inference engines do; the trainer too, unless asked not to.
    assert engine.moe_grouped_gemm and config.moe_grouped_gemm
    assert transformer_config(model_settings(parse_args([*flags, "--moe-grouped-gemm"])), CPU).moe_grouped_gemm
    no_grouped = parse_args([*flags, "--no-moe-grouped-gemm"])
    assert not transformer_config(model_settings(no_grouped), CPU).moe_grouped_gemm
    assert transformer_config(model_settings(no_grouped), CPU, rollout_engine=True).moe_grouped_gemm


def test_model_flags_reach_the_config():
    args = parse_args(["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                       "--add-bias-linear", "--moe-routing-replay-check-values",
                       "--no-moe-check-host-tokens-per-expert", "--moe-router-score-function", "sigmoid"])
    config = transformer_config(model_settings(args), CPU)
    assert (config.tensor_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert config.add_bias_linear and config.moe_router_score_function == "sigmoid"
    assert config.moe_routing_replay_check_values and not config.moe_check_host_tokens_per_expert
    # Megatron's default expert-TP is TP; the launcher's linear layers have no biases unless asked.
    for flags in ([], ["--disable-bias-linear"]):
        config = transformer_config(model_settings(parse_args(["--tensor-model-parallel-size", "2", *flags])), CPU)
        assert config.expert_tensor_parallel_size == 2 and not config.add_bias_linear


@pytest.mark.parametrize("flags, training, engine", [
    ([], "transformer_engine", "transformer_engine"),  # TEGroupedMLP in both where TE runs one grouped GEMM
    (["--moe-grouped-gemm-impl", "torch"], "torch", "torch"),
    # A policy of SequentialMLP experts: the engine's grouped experts must keep their parameters
    # (torch's GroupedGemmExperts), not TEGroupedMLP's weight<i>, or its lagged weights cannot follow.
    (["--no-moe-grouped-gemm"], None, "torch"),
    (["--no-moe-grouped-gemm", "--moe-grouped-gemm-impl", "transformer_engine"], None, "torch"),
])
def test_the_rollout_engines_grouped_experts_keep_the_policys_parameters(monkeypatch, flags, training, engine):
    # TE's layers cannot be built here; the choice reads only these two config fields and TE's capability,
    # pinned to a node whose TE runs one grouped GEMM per linear.
    monkeypatch.setattr(transformer_impl, "te_grouped_gemm_problem", lambda: None)
    model = model_settings(parse_args(flags))
    for config_grouped, expected in ((model.moe_grouped_gemm, training), (True, engine)):
        config = SimpleNamespace(moe_grouped_gemm=config_grouped, transformer_impl="transformer_engine")
        if expected is not None:  # (no grouped experts in training: the trainer's choice is not used)
            assert experts_grouped_gemm_impl(model, config) == expected


def test_fields_without_a_flag_replace_the_fixed_choices_and_a_flagged_field_is_refused():
    model = model_settings(parse_args([]))
    assert transformer_config(model, CPU).moe_router_load_balancing_type == "none"
    config = transformer_config(model, CPU, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
                                moe_router_pre_softmax=True)
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("aux_loss", 0.1)
    assert config.moe_router_pre_softmax
    with pytest.raises(ValueError, match=r"\['moe_enable_routing_replay', 'moe_router_score_function'\] come "
                                         r"from the model's settings \(the flags\): set them there instead"):
        transformer_config(model, CPU, moe_router_score_function="sigmoid", moe_enable_routing_replay=True)


def expert_tp_worker(argv):
    """This rank's expert-TP size and its first MoE layer's experts, built from the flags."""
    args = parse_args(argv)
    init_model_parallel(parallel_settings(args), create_gloo_process_groups=False)
    try:
        model = model_settings(args)
        (chunk,) = build_model(model, transformer_config(model, CPU), CPU)
        experts = chunk.decoder.layers[0].mlp.experts.local_experts
        fc1 = experts[0].linear_fc1
        return {"etp": parallel_state.get_expert_tensor_parallel_world_size(), "local_experts": len(experts),
                "fc1": tuple(fc1.weight.shape), "fc1_bias": None if fc1.bias is None else tuple(fc1.bias.shape)}
    finally:
        parallel_state.destroy_model_parallel()


def test_expert_tensor_parallel_size_reaches_the_parallel_state_and_the_experts():
    """TP2 + SP on two ranks (hidden 128, 8 experts of FFN 128): by default the experts are split
    over TP like the dense layers; with EP2 and expert-TP 1 each rank holds half the experts, whole,
    and they may have biases."""
    model = ["--moe-layer-freq", "1"]
    split, whole = (run_workers(expert_tp_worker, 2, [*layout.flags, *model, *flags], backend="gloo")
                    for layout, flags in ((Layout(tp=2, sp=True), []),
                                          (Layout(tp=2, sp=True, ep=2, etp=1), ["--add-bias-linear"])))
    for result in split:
        assert result == {"etp": 2, "local_experts": 8, "fc1": (64, 128), "fc1_bias": None}
    for result in whole:
        assert result == {"etp": 1, "local_experts": 4, "fc1": (128, 128), "fc1_bias": (128,)}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pipeline_messages_are_never_batched(device):
    """At PP=2 with virtual stages a batched exchange swaps an activation and a gradient bound for the same
    peer (untagged point-to-point messages pair by order, on gloo and NCCL alike): every device gets
    Megatron's separate sends and receives."""
    args = parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                       "--num-virtual-stages-per-pipeline-rank", "2"])
    config = transformer_config(model_settings(args), torch.device(device))
    assert config.virtual_pipeline_model_parallel_size == 2 and not config.batch_p2p_comm
