"""The launcher's defaults that follow from other flags and the world size."""

import pytest

from megatron_r3.rl import arguments
from megatron_r3.rl.arguments import default_micro_batch_size, parse_args


@pytest.mark.parametrize("flags, world_size, expected", [
    ([], 1, 32),  # one rank: the whole batch in one microbatch
    ([], 2, 16),  # two data-parallel ranks: half each
    (["--tensor-model-parallel-size", "2"], 4, 16),  # data-parallel size 2
    (["--context-parallel-size", "2"], 2, 32),  # data-parallel size 1; samples padded to 16 tokens
    (["--pipeline-model-parallel-size", "2"], 2, 16),  # one microbatch per stage
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], 4, 8),
    (["--global-batch-size", "12", "--pipeline-model-parallel-size", "5", "--num-layers", "10"], 5, 12),  # 12 over 5: one
    (["--global-batch-size", "8"], 16, 1),  # fewer samples than ranks: the world check refuses it later
])
def test_micro_batch_size_defaults_to_one_microbatch_per_stage(monkeypatch, flags, world_size, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    # Before torchrun's group exists, as at start-up (an earlier test in this process may have left a one-rank one).
    monkeypatch.setattr(arguments.dist, "is_initialized", lambda: False)
    args = parse_args(flags)
    assert args.micro_batch_size == expected
    assert default_micro_batch_size(args, world_size) == expected
    per_sample = 16 if "--context-parallel-size" in flags else 15  # the task's longest sample, padded for CP
    assert args.seq_length == expected * per_sample  # room for that many of them


def test_an_explicit_micro_batch_size_is_kept(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--micro-batch-size", "4"])
    assert (args.micro_batch_size, args.global_batch_size, args.seq_length) == (4, 32, 60)


def test_dump_mode_without_a_global_batch_size_takes_microbatches_of_8(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.r3dump").touch()  # the flags only ask that the file exists
    dump = ["--rollout-dump", "x.r3dump", "--vocab-size", "64", "--seq-length", "128"]
    assert parse_args(dump).micro_batch_size == 8
    assert parse_args(dump + ["--global-batch-size", "16"]).micro_batch_size == 16


@pytest.mark.parametrize("cuda, expected", [
    (True, dict(num_experts=128, moe_router_topk=8, moe_router_score_function="sigmoid", swiglu=True,
                moe_router_dtype="fp32")),
    (False, dict(num_experts=8, moe_router_topk=2, moe_router_score_function="softmax", swiglu=False,
                 moe_router_dtype=None)),
])
def test_the_default_router_is_deepseek_v3_like_on_gpus_and_small_on_cpus(monkeypatch, cuda, expected):
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    args = parse_args([])
    assert {name: getattr(args, name) for name in expected} == expected


def test_flags_given_override_the_platform_defaults(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    args = parse_args(["--num-experts", "16", "--moe-router-topk", "2", "--no-swiglu", "--moe-router-dtype", "fp64",
                       "--moe-router-score-function", "softmax"])
    assert (args.num_experts, args.moe_router_topk, args.swiglu, args.moe_router_dtype,
            args.moe_router_score_function) == (16, 2, False, "fp64", "softmax")
