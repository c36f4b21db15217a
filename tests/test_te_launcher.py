"""The launcher on a GPU with TransformerEngine: its default layers, R3 on and off, embedded and dump modes."""

import math

import pytest

from megatron_r3.layers.transformer_impl import transformer_engine_installed
from tests.support.launcher import run_workers
from tests.test_launch import train_worker, write_dump

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not transformer_engine_installed(), reason="needs TransformerEngine (make install on a "
                       "CUDA machine installs it)"),
]

# The test suite's small model (tests/test_launch.py) at widths TE's fused kernels take, with no
# --transformer-impl: the launcher's default on a GPU with TransformerEngine.
TE_MODEL = [
    "--num-layers", "4", "--moe-layer-freq", "0,1,0,1", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "64", "--init-method-std", "0.02",
]
EMBEDDED = TE_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8", "--rollouts-per-prompt", "2",
                       "--task-max-symbols", "4", "--train-iters", "3"]


def _model_worker(argv):
    """The launcher's policy config on this GPU: which layers, which dtype."""
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.model.factory import transformer_config

    settings = run_settings(parse_args(argv))
    config = transformer_config(settings.model, initialize(settings))
    return {"impl": config.transformer_impl, "bf16": config.bf16}


def test_the_gpu_default_is_transformer_engine_in_bf16():
    (result,) = run_workers(_model_worker, 1, EMBEDDED, backend="nccl")
    assert result == {"impl": "transformer_engine", "bf16": True}


@pytest.mark.parametrize("mode", [["--moe-enable-routing-replay"], []], ids=["r3", "live"])
def test_the_embedded_loop_trains_on_te_layers(mode):
    """R3 on: every update microbatch replays the engine's routes on the sync-free path; off: none.
    The comparison pass reports the mismatch both ways; every metric is finite."""
    ((result),) = run_workers(train_worker, 1, EMBEDDED + mode, backend="nccl", timeout=300)
    history = result["history"]
    assert [m["iteration"] for m in history] == [1, 2, 3]
    # Where the experts keep their token counts on the device (torch's grouped GEMM, the default where TE's
    # grouped GEMM is one GEMM per expert), the update pass is Megatron's full-iteration graph: its eager
    # first pass reads the wrapper's copies of the microbatches, without host counts; every later pass
    # replays. Elsewhere (TEGroupedMLP) every pass is eager with the fillers' host counts.
    graphed = any(line.startswith(" update pass: one CUDA graph") for line in result["lines"])
    sync_free = [0.0, 1.0, 1.0] if graphed else [1.0, 1.0, 1.0]
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        assert metrics["mismatch/replay/k3_kl"] >= 0 and metrics["mismatch/live/k3_kl"] >= 0
        if mode:
            assert metrics["routing/replayed_tokens"] > 0 and metrics["routing/live_tokens"] == 0
        else:
            assert metrics["routing/replayed_tokens"] == 0
    if mode:
        assert [m["routing/host_split_microbatches"] for m in history] == sync_free


def test_the_dump_mode_replays_on_te_layers(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3")
    argv = TE_MODEL + ["--vocab-size", "64", "--seq-length", "96", "--micro-batch-size", "2",
                       "--rollouts-per-prompt", "2", "--rollout-dump", str(dump), "--train-iters", "2",
                       "--moe-enable-routing-replay"]
    ((result),) = run_workers(train_worker, 1, argv, backend="nccl", timeout=300)
    assert [m["iteration"] for m in result["history"]] == [1, 2]
    assert all(m["routing/replayed_tokens"] > 0 for m in result["history"])


def test_te_layers_with_torchs_grouped_experts_train_the_same_with_and_without_graphs():
    """--moe-grouped-gemm-impl torch: the dispatcher keeps token counts on the device, so the engine's and
    the trainer's passes over TE's layers replay CUDA graphs, with the eager run's metrics."""
    from tests.rl.model.test_forward_graphs import _counting_train_worker

    # One microbatch a pass; three iterations: Megatron's full-iteration graph runs the first update pass
    # eagerly, captures and replays the second, replays the third. The built-in engine, whose forward
    # graphs are counted (Megatron's engine, the default where it runs, captures its own).
    argv = EMBEDDED + ["--moe-enable-routing-replay", "--moe-grouped-gemm-impl", "torch", "--train-iters", "3",
                       "--global-batch-size", "4", "--micro-batch-size", "4", "--rollout-engine", "local"]
    ((with_graphs, replays),) = run_workers(_counting_train_worker, 1, argv, backend="nccl", timeout=300)
    ((eager, no_replays),) = run_workers(_counting_train_worker, 1,
                                         argv + ["--no-rollout-cuda-graphs", "--no-trainer-cuda-graphs"],
                                         backend="nccl", timeout=300)
    assert no_replays == {"forward": 0, "update": 0}
    assert replays["forward"] > 0 and replays["update"] == 2  # every update pass after the wrapper's eager one
    for got, want in zip(with_graphs, eager, strict=True):
        assert {k: v for k, v in got.items() if k != "routing/host_split_microbatches"} == \
            {k: v for k, v in want.items() if k != "routing/host_split_microbatches"}


@pytest.mark.parametrize("grouped_gemm_impl", ["transformer_engine", "torch"])
def test_the_embedded_loop_replays_on_te_hybrid_layers(grouped_gemm_impl):
    """A HybridModel of the same layers (dense, MoE, dense, MoE) from Megatron's TE hybrid spec, with
    TE's or torch's grouped experts: every update microbatch replays the engine's routes."""
    argv = (EMBEDDED[4:] + ["--hybrid-layer-pattern", "*-*E*-*E", "--moe-grouped-gemm-impl", grouped_gemm_impl,
                            "--moe-enable-routing-replay"])
    ((result),) = run_workers(train_worker, 1, argv, backend="nccl", timeout=300)
    history = result["history"]
    assert [m["iteration"] for m in history] == [1, 2, 3]
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        assert metrics["routing/replayed_tokens"] > 0 and metrics["routing/live_tokens"] == 0
        assert sorted(k for k in metrics if k.startswith("routing/agreement/layer_")) == [
            "routing/agreement/layer_4", "routing/agreement/layer_8"]
