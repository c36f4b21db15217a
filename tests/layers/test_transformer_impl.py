"""--transformer-impl: which layers a model is built from, and what each refuses."""

import pytest
import torch

from megatron_r3.layers import transformer_impl
from megatron_r3.layers.transformer_impl import (
    resolve_grouped_gemm_impl,
    resolve_rope_fusion,
    resolve_transformer_impl,
    with_experts,
)
from megatron_r3.rl.arguments import model_settings, parse_args
from megatron_r3.rl.model.factory import layers_summary, transformer_config

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
NO_FUSIONS = {"moe_permute_fusion": False, "moe_router_fusion": False, "apply_rope_fusion": False}


def launcher_config(flags, device=CPU, **kwargs):
    """The TransformerConfig the launcher builds from ``flags``."""
    return transformer_config(model_settings(parse_args(flags)), device, **kwargs)


@pytest.mark.parametrize("installed,device,expected", [
    (True, GPU, "transformer_engine"),
    (False, GPU, "local"),
    (True, CPU, "local"),
])
def test_the_default_is_transformer_engine_on_a_gpu_where_it_is_installed(monkeypatch, installed, device, expected):
    monkeypatch.setattr(transformer_impl, "transformer_engine_installed", lambda: installed)
    assert resolve_transformer_impl(None, device, NO_FUSIONS) == expected


def test_transformer_engine_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(transformer_impl, "transformer_engine_installed", lambda: True)
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_transformer_impl("transformer_engine", CPU, NO_FUSIONS)
    monkeypatch.setattr(transformer_impl, "transformer_engine_installed", lambda: False)
    with pytest.raises(ValueError, match="TransformerEngine is not installed"):
        resolve_transformer_impl("transformer_engine", GPU, NO_FUSIONS)


@pytest.mark.parametrize("flag", ["--moe-permute-fusion", "--moe-router-fusion", "--apply-rope-fusion"])
def test_te_only_options_are_refused_with_the_local_layers(flag):
    with pytest.raises(ValueError, match=f"{flag} needs TransformerEngine's layers"):
        launcher_config([flag, "--transformer-impl", "local"])


def test_rope_fusion_is_on_by_default_with_te_layers_only():
    assert parse_args([]).apply_rope_fusion is None
    assert parse_args(["--apply-rope-fusion"]).apply_rope_fusion is True
    assert parse_args(["--no-rope-fusion"]).apply_rope_fusion is False
    with pytest.raises(SystemExit):
        parse_args(["--apply-rope-fusion", "--no-rope-fusion"])
    assert resolve_rope_fusion(None, "transformer_engine") and not resolve_rope_fusion(None, "local")
    assert not resolve_rope_fusion(False, "transformer_engine") and resolve_rope_fusion(True, "transformer_engine")
    assert not launcher_config([]).apply_rope_fusion
    assert not launcher_config(["--no-rope-fusion"]).apply_rope_fusion  # saying "off" is fine with the local layers


def test_the_start_up_line_names_the_fused_rope(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(transformer_impl, "te_grouped_gemm_problem", lambda: None)
    settings = model_settings(parse_args([]))
    config = SimpleNamespace(transformer_impl="transformer_engine", moe_grouped_gemm=True, bf16=True,
                             apply_rope_fusion=True)
    assert layers_summary(settings, config) == (" layers: TransformerEngine's layers (Megatron's TE specs) with fused "
                                                "RoPE in bf16; experts: TransformerEngine's TEGroupedMLP")
    config.apply_rope_fusion = False
    assert "RoPE" not in layers_summary(settings, config)


def test_the_local_layers_train_in_fp32_unless_bf16_is_asked_for():
    assert launcher_config([]).params_dtype == torch.float32
    config = launcher_config(["--bf16"])
    assert config.bf16 and config.params_dtype == torch.bfloat16
    assert launcher_config([], rollout_engine=True).bf16
    assert launcher_config([]).transformer_impl == "local"


def test_swiglu_gates_the_experts_and_the_mlps():
    config = launcher_config(["--swiglu"])
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    config = launcher_config([])
    assert not config.gated_linear_unit and config.activation_func is torch.nn.functional.gelu


def test_grouped_experts_are_tes_by_default_only_where_te_runs_one_grouped_gemm(monkeypatch):
    monkeypatch.setattr(transformer_impl, "te_grouped_gemm_problem", lambda: None)
    assert resolve_grouped_gemm_impl(None, "transformer_engine") == "transformer_engine"
    monkeypatch.setattr(transformer_impl, "te_grouped_gemm_problem", lambda: "cuBLASLt 13.0.2 on 9.0")
    assert resolve_grouped_gemm_impl(None, "transformer_engine") == "torch"
    assert resolve_grouped_gemm_impl("transformer_engine", "transformer_engine") == "transformer_engine"
    assert resolve_grouped_gemm_impl("torch", "transformer_engine") == "torch"
    assert resolve_grouped_gemm_impl(None, "local") == "torch"
    with pytest.raises(ValueError, match="needs TransformerEngine's layers"):
        resolve_grouped_gemm_impl("transformer_engine", "local")
    with pytest.raises(ValueError, match="needs TransformerEngine's layers"):
        launcher_config(["--moe-grouped-gemm-impl", "transformer_engine"])


def test_with_experts_swaps_the_experts_of_moe_layers_only():
    """The block spec of a dense-MoE model with other experts: MoE layers get them, dense ones are unchanged."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_r3.layers.grouped_experts import GroupedGemmExperts
    from megatron_r3.layers.specs import get_gpt_layer_r3_spec, grouped_gemm_experts_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    dense, moe = get_gpt_layer_r3_spec(), get_gpt_layer_r3_spec(num_experts=4)
    block = TransformerBlockSubmodules(layer_specs=[dense, moe], layer_norm=None)
    assert moe.submodules.mlp.keywords["submodules"].experts.func is SequentialMLP
    swapped = with_experts(block, grouped_gemm_experts_spec())
    assert swapped.layer_specs[0] is dense
    experts = swapped.layer_specs[1].submodules.mlp.keywords["submodules"].experts
    assert experts.func is GroupedGemmExperts
    assert moe.submodules.mlp.keywords["submodules"].experts.func is SequentialMLP  # the input is unchanged


def test_the_hybrid_layer_pattern_sets_the_layers_and_the_virtual_stages():
    gpt = launcher_config([])
    assert not gpt.is_hybrid_model and gpt.num_layers == 8
    flags = ["--hybrid-layer-pattern", "*-|*E|*-|*E", "--pipeline-model-parallel-size", "2"]
    config = launcher_config(flags)
    assert config.is_hybrid_model and config.num_layers == 8
    assert config.virtual_pipeline_model_parallel_size == 2  # 4 segments over 2 pipeline ranks
    flags = ["--hybrid-layer-pattern", "*-*E|*-*E", "--pipeline-model-parallel-size", "2"]
    assert launcher_config(flags).virtual_pipeline_model_parallel_size is None


def test_the_local_hybrid_layers_refuse_other_layer_types_naming_their_position():
    config = launcher_config(["--hybrid-layer-pattern", "*E"])
    with pytest.raises(ValueError, match=r"'\*E-M': 'M' \(Mamba\) at position 4: the local hybrid layers are only"):
        transformer_impl.hybrid_stack_spec(config, "*E-M")


@pytest.mark.gpu
@pytest.mark.skipif(not transformer_impl.transformer_engine_installed(), reason="needs TransformerEngine")
@pytest.mark.parametrize("grouped, impl, experts", [
    (True, "transformer_engine", "TEGroupedMLP"), (True, "torch", "GroupedGemmExperts"), (False, None, "SequentialMLP"),
])
def test_te_hybrid_layers_get_the_experts_asked_for(grouped, impl, experts):
    config = launcher_config(["--hybrid-layer-pattern", "*E", "--transformer-impl", "transformer_engine",
                             "--moe-grouped-gemm" if grouped else "--no-moe-grouped-gemm"], GPU)
    spec = transformer_impl.hybrid_stack_spec(config, "*E", grouped_gemm_impl=impl or "transformer_engine")
    moe = spec.submodules.moe_layer.submodules.mlp
    assert moe.keywords["submodules"].experts.func.__name__ == experts
