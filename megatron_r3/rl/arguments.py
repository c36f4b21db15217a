"""The launcher's flags: Megatron's names, a default for each that makes a small embedded run.

:func:`parse_args` parses them and refuses what does not fit together, one line per
problem (exit status 2); :func:`complete_args` fills the defaults that follow from other
flags (the task's vocabulary and lengths, ``--micro-batch-size``, ``--seq-length``).

The parsed namespace stops here: the functions at the end turn it into the settings
dataclasses the packages below take (:class:`~megatron_r3.rl.model.factory.ModelSettings`
and the others, each beside the code that reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_r3.layers.hybrid_pattern import hybrid_num_layers, hybrid_virtual_stages
from megatron_r3.layers.moe_layers import parse_moe_layer_freq
from megatron_r3.layers.transformer_impl import GROUPED_GEMM_IMPLS, TRANSFORMER_IMPLS
from megatron_r3.rl.checkpoint.checkpointing import checkpoint_flags
from megatron_r3.rl.checkpoint.dirs import find_checkpoint
from megatron_r3.rl.checkpoint.resume_flags import take_checkpoint_flags
from megatron_r3.rl.model.factory import ModelSettings, ParallelSettings, RecomputeSettings
from megatron_r3.rl.profiling.profiler import ProfilingSettings, add_profiling_args, profiling_problems
from megatron_r3.rl.rollout.engine import SamplingParams
from megatron_r3.rl.rollout.engine_choice import ENGINE_GRAPH_SCOPES, RolloutEngineSettings
from megatron_r3.rl.rollout.sources import RolloutSettings
from megatron_r3.rl.rollout.tasks import EOS, TRANSFORMS, SymbolTask
from megatron_r3.rl.run_settings import CheckpointSettings, LoggingSettings, RunSettings
from megatron_r3.rl.run_checks import data_parallel_size, relation_problems, value_problems
from megatron_r3.rl.trainer.policy_trainer import REPLAY_MODES, PolicyUpdateSettings
from megatron_r3.rl.trainer.training_stack import (
    TrainingStackSettings,
    add_training_stack_args,
    training_stack_problems,
)
from megatron_r3.routing_replay import RoutingReplaySettings, add_routing_replay_args

# The default model where the launcher runs on GPUs: a DeepSeek-V3-like router (128 experts, top-8 by
# sigmoid scores, SwiGLU experts, fp32 routing) on small layers, at which Megatron's inference engine and
# the trainer disagree on about a quarter of the routes (docs/launcher.md, "Measured effect on GPUs";
# Qwen3's softmax router is --moe-router-score-function softmax); on CPUs the small router of the first
# runs, which keeps the CPU suite and a first CPU run short.
GPU_MODEL = dict(num_experts=128, moe_router_topk=8, moe_router_score_function="sigmoid", swiglu=True,
                 moe_router_dtype="fp32")
CPU_MODEL = dict(num_experts=8, moe_router_topk=2, moe_router_score_function="softmax", swiglu=False,
                 moe_router_dtype=None)

DESCRIPTION = "RL training of a Megatron MoE (GPTModel or HybridModel) with rollout routing replay (R3)."


class RankZeroArgumentParser(argparse.ArgumentParser):
    """Under torchrun every rank parses the same flags and finds the same problems: only rank 0 (torchrun's
    ``RANK``; without torchrun the one process) prints the usage, the help and the errors, and every rank exits."""

    @staticmethod
    def _prints() -> bool:
        return os.environ.get("RANK", "0") == "0"

    def print_usage(self, file=None) -> None:
        if self._prints():
            super().print_usage(file)

    def print_help(self, file=None) -> None:
        if self._prints():
            super().print_help(file)

    def exit(self, status: int = 0, message: Optional[str] = None):
        super().exit(status, message if self._prints() else None)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Megatron-style flags; every one has a default that makes a small embedded run."""
    parser = RankZeroArgumentParser(description=DESCRIPTION, prog="pretrain_gpt_r3.py")
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=None,
                       help="decoder layers (default 8, or --hybrid-layer-pattern's layer count)")
    model.add_argument("--hybrid-layer-pattern", default=None,
                       help="build a HybridModel (megatron-core 0.19's successor of GPTModel) of these layers, in "
                            "Megatron-LM's syntax: one symbol per layer, '*' attention, '-' MLP, 'E' MoE (and, with "
                            "TransformerEngine's layers, 'M' Mamba, 'G' gated delta net, '+' MLA, 'D' DSA); '|' "
                            "between pipeline segments, --pipeline-model-parallel-size of them or a multiple "
                            "(virtual stages). It sets --num-layers; the MoE layers are its 'E's. Default: a "
                            "GPTModel of --num-layers layers, each attention then an MLP or MoE (--moe-layer-freq); "
                            "'*E' repeated --num-layers times is the same stack as a HybridModel")
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--ffn-hidden-size", type=int, default=256)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention groups")
    model.add_argument("--num-experts", type=int, default=None,
                       help=f"experts per MoE layer (default {GPU_MODEL['num_experts']} on GPUs, "
                            f"{CPU_MODEL['num_experts']} on CPUs)")
    model.add_argument("--moe-router-topk", type=int, default=None,
                       help=f"experts per token (default {GPU_MODEL['moe_router_topk']} on GPUs, "
                            f"{CPU_MODEL['moe_router_topk']} on CPUs)")
    model.add_argument("--moe-ffn-hidden-size", type=int, default=128)
    model.add_argument("--moe-layer-freq", default=None,
                       help="every Nth layer is MoE (an int), or one 0/1 per layer, comma-separated (default 1: "
                            "every layer; a GPTModel's flag: --hybrid-layer-pattern places its MoE layers itself)")
    model.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default=None,
                       help="the routers' scores of the top-k experts: sigmoid, normalised over the top-k "
                            "(DeepSeek-V3's), or softmax over the top-k logits (Qwen3's). Default: "
                            f"{GPU_MODEL['moe_router_score_function']} on GPUs, "
                            f"{CPU_MODEL['moe_router_score_function']} on CPUs")
    model.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                       help="the routers' logits, scores and top-k in this precision (Megatron-LM's flag; "
                            "default: fp32 on GPUs, as Megatron-LM advises from 32 experts on; on CPUs the "
                            "activations' dtype)")
    grouped = model.add_mutually_exclusive_group()
    grouped.add_argument("--moe-grouped-gemm", dest="moe_grouped_gemm", action="store_true", default=True,
                         help="the trainer's experts run as two grouped GEMMs per MoE layer (no TransformerEngine; "
                              "with no host sync on one expert rank; on CUDA in bf16 only) instead of two GEMMs per "
                              "expert; the same parameters and checkpoints. The default here (Megatron-LM's is "
                              "off); the rollout engine always runs them so")
    grouped.add_argument("--no-moe-grouped-gemm", dest="moe_grouped_gemm", action="store_false",
                         help="the trainer's experts as Megatron's SequentialMLP, two GEMMs per expert")
    model.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall")
    model.add_argument("--moe-allgather-static-shapes", action="store_true",
                       help="the allgather dispatcher sizes its permutation for the most rows the local experts "
                            "can get (gathered tokens x min(top-k, local experts)) and keeps the token counts on "
                            "the device: no host sync at any expert-parallel size, at the cost of that many rows "
                            "of activations; needs grouped experts that take device counts (torch's grouped GEMM). "
                            "docs/launcher.md")
    model.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
                       help="the layers: TransformerEngine's (Megatron's TE layer specs: TE attention with THD "
                            "and context parallelism, fused norm and linear, TEGroupedMLP experts with "
                            "--moe-grouped-gemm) or Megatron's local modules with megatron_r3's norm, attention "
                            "and grouped experts (every layout, on CPUs too). Default: transformer_engine on "
                            "GPUs where TransformerEngine is installed, else local")
    model.add_argument("--moe-grouped-gemm-impl", choices=GROUPED_GEMM_IMPLS, default=None,
                       help="who runs grouped experts with TransformerEngine's layers: TE's TEGroupedMLP (host "
                            "split sizes) or torch's grouped GEMM with the group offsets on the device "
                            "(GroupedGemmExperts: no host sync on one expert rank, so the passes can be CUDA "
                            "graphs). Default: TE's where its GroupedLinear runs one grouped GEMM on this node, "
                            "else torch's (said at start-up); the local layers always use torch's")
    model.add_argument("--cp-comm-type", choices=("p2p", "a2a"), default="p2p",
                       help="TransformerEngine attention's context-parallel communication (TE layers only)")
    model.add_argument("--moe-permute-fusion", action="store_true",
                       help="TransformerEngine's fused permutation of tokens to experts (TE only)")
    rope = model.add_mutually_exclusive_group()
    rope.add_argument("--apply-rope-fusion", dest="apply_rope_fusion", action="store_true", default=None,
                      help="TransformerEngine's fused rotary embedding, one kernel for a packed THD row (TE only). "
                           "Default: on with TransformerEngine's layers, as in Megatron-LM")
    rope.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false", default=None,
                      help="the unfused rotary embedding with TransformerEngine's layers (Megatron-LM's flag)")
    model.add_argument("--moe-router-fusion", action="store_true",
                       help="TransformerEngine's fused top-k and score function (TE only); live microbatches "
                            "take the fused kernel, replayed or recorded ones the unfused top-k (the fused "
                            "kernel never reaches the replay hook); docs/routing_replay.md")
    model.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None,
                       help="gated SiLU experts and MLPs (SwiGLU, as Qwen3 and DeepSeek MoE models; Megatron-LM's "
                            "flag); --no-swiglu: GeLU. Default: SwiGLU on GPUs, GeLU on CPUs")
    model.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="RMSNorm")
    model.add_argument("--init-method-std", type=float, default=0.15, help="std of the normal weight init")
    bias = model.add_mutually_exclusive_group()
    bias.add_argument("--add-bias-linear", dest="add_bias_linear", action="store_true",
                      help="biases in the linear layers (Megatron-LM's default; off here, as in most MoE models; "
                           "MoE biases need expert-TP 1)")
    bias.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                      help="no biases in the linear layers: the default here (Megatron-LM's flag, accepted)")
    model.add_argument("--vocab-size", type=int, default=None,
                       help="divisible by the TP size (default: the task's vocabulary, rounded up to it)")
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    model.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                       help="train in bf16 parameters and activations, with fp32 main weights in the optimizer "
                            "(default: bf16 with TransformerEngine's layers, whose THD and context-parallel "
                            "attention needs it; fp32 with the local layers; the rollout engine is bf16)")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parallel.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--context-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                          help="tensor parallelism of the experts (default: --tensor-model-parallel-size)")
    parallel.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    parallel.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    parallel.add_argument("--recompute-num-layers", type=int, default=1)
    parallel.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                          help="the process groups' backend (default: nccl on GPUs, gloo on CPUs)")

    training = parser.add_argument_group("training")
    training.add_argument("--rollout-dump", default=None,
                          help="train on this rollout dump (megatron_r3.dataplane.formats.rollout_dump) instead of the "
                               "built-in engine")
    training.add_argument("--allow-truncated-rollout-dump", action="store_true",
                          help="train on a --rollout-dump without its footer (its writer did not finish, or the file "
                               "was cut), on the whole samples it holds, with a warning; refused by default")
    training.add_argument("--micro-batch-size", type=int, default=None,
                          help="samples packed per microbatch (default: each data-parallel rank's share of "
                               "--global-batch-size in one microbatch per pipeline stage, the fewest passes through "
                               "the model; 8 with --rollout-dump and no --global-batch-size)")
    training.add_argument("--global-batch-size", type=int, default=None,
                          help="samples per iteration over all data-parallel ranks (default: 32 in the embedded "
                               "run, one microbatch per rank with --rollout-dump)")
    training.add_argument("--seq-length", type=int, default=None,
                          help="length of a packed microbatch row (default in the embedded run: room for "
                               "--micro-batch-size of the task's longest samples; required with --rollout-dump)")
    training.add_argument("--train-iters", type=int, default=40)
    training.add_argument("--seed", type=int, default=1234)
    training.add_argument("--log-interval", type=int, default=1)
    training.add_argument("--timing-log-level", type=int, choices=(0, 1), default=0,
                          help="1: the progress line also gives the seconds of each phase (rollout, each training "
                               "pass, optimizer step); the metrics file always has them (time/<phase>_s)")
    training.add_argument("--count-host-syncs", action="store_true",
                          help="count the host's waits for the device in each phase (sync-debug syncs and "
                               "explicit waits), for diagnosis: host_syncs/<phase> in the metrics (CUDA only)")
    training.add_argument("--metrics-file", default=None,
                          help="one JSON object per logged iteration (a resumed run keeps the lines up to its "
                               "checkpoint and continues them; a run from scratch refuses an existing file)")
    existing_metrics = training.add_mutually_exclusive_group()
    existing_metrics.add_argument("--append-metrics-file", action="store_true",
                                  help="a run from scratch appends to an existing --metrics-file")
    existing_metrics.add_argument("--overwrite-metrics-file", action="store_true",
                                  help="a run from scratch replaces an existing --metrics-file")
    training.add_argument("--drop-cut-metrics-line", action="store_true",
                          help="with --append-metrics-file: drop a last line of --metrics-file that was cut (no "
                               "newline: a run stopped while writing it) before appending; refused otherwise")

    checkpoints = parser.add_argument_group("checkpointing")
    checkpoints.add_argument("--save", default=None, help="directory to save checkpoints to")
    checkpoints.add_argument("--save-interval", type=int, default=None,
                             help="iterations between checkpoints (default: only at the end of training)")
    checkpoints.add_argument("--load", default=None,
                             help="directory to resume from (its latest complete checkpoint), or one iter_NNNNNNN "
                                  "folder in it; without a checkpoint there the run stops, unless --load-optional")
    checkpoints.add_argument("--load-optional", action="store_true",
                             help="start from scratch when --load holds no checkpoint yet (so --load and --save may "
                                  "name the same directory for runs that restart)")
    checkpoints.add_argument("--use-checkpoint-args", action="store_true",
                             help="take the flags that must match the checkpoint's to resume (the model, the routing, "
                                  "the rollout data and its staleness: docs/checkpoints.md) from --load's checkpoint "
                                  "instead of refusing the run where they differ (Megatron-LM's flag)")
    checkpoints.add_argument("--no-load-optim", action="store_true",
                             help="resume without the checkpoint's optimizer state and learning-rate schedule: Adam "
                                  "starts afresh (Megatron-LM's flag)")
    checkpoints.add_argument("--no-load-rng", action="store_true",
                             help="resume without the checkpoint's RNG states (Megatron-LM's flag)")

    rl = parser.add_argument_group("reinforcement learning")
    rl.add_argument("--task", choices=sorted(TRANSFORMS), default="reverse", help="the built-in task")
    rl.add_argument("--task-num-symbols", type=int, default=8, help="distinct symbols of the task")
    rl.add_argument("--task-min-symbols", type=int, default=3, help="fewest symbols in a prompt")
    rl.add_argument("--task-max-symbols", type=int, default=6, help="most symbols in a prompt")
    rl.add_argument("--rollouts-per-prompt", type=int, default=4,
                    help="completions per prompt; advantages are normalised within these groups (GRPO)")
    rl.add_argument("--rollout-temperature", type=float, default=1.0)
    rl.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's longest answer")
    rl.add_argument("--rollout-staleness", type=int, default=0,
                    help="optimizer steps the rollout engine's weights trail the policy's")
    rl.add_argument("--rollout-engine", choices=("megatron", "local"), default=None,
                    help="what generates the rollouts: megatron-core's DynamicInferenceEngine (KV cache, its "
                         "CUDA graphs; needs CUDA, flash-attn >= 2.7.3 or 3/4 and a model replica of one GPU with "
                         "one expert rank) or the built-in engine (no KV cache, CUDA graphs; every layout, CPUs "
                         "too). Default: megatron where it runs, else local")
    rl.add_argument("--no-rollout-cuda-graphs", dest="rollout_cuda_graphs", action="store_false",
                    help="run the rollout engine's generation and recording passes eagerly; by default, where a "
                         "model replica is one GPU whose MoE layers keep their token counts on the device, they "
                         "replay CUDA graphs captured on the first passes (each engine its own)")
    rl.add_argument("--inference-cuda-graph-scope", choices=ENGINE_GRAPH_SCOPES, default="layer",
                    help="what one of Megatron's engine's CUDA graphs holds (Megatron-LM's flag name): each "
                         "transformer layer's own (layer, the default: captured on the engine's first steps, where "
                         "Megatron-LM's layer scope captures when the engine starts; a decode step replays one "
                         "graph per layer, each after its manager checks its arguments) or the whole transformer "
                         "block (block: one replay a step, captured when the engine starts). Needs Megatron's "
                         "engine with its graphs (--rollout-engine megatron or its default, no "
                         "--no-rollout-cuda-graphs)")
    rl.add_argument("--no-trainer-cuda-graphs", dest="trainer_cuda_graphs", action="store_false",
                    help="run the trainer's passes eagerly; by default, where a model replica is one GPU and its "
                         "experts are grouped, the forward-only passes that route live (--r3-compare's when "
                         "training replays, R2's old-log-prob pass) replay CUDA graphs captured on the first pass, "
                         "and, with one data-parallel rank, the whole update pass (every microbatch, forward and "
                         "backward) is Megatron's full-iteration graph, captured on the second pass")
    rl.add_argument("--clip-ratio", type=float, default=0.2, help="PPO clip epsilon of the importance ratio")
    rl.add_argument("--routing-replay-mode", choices=REPLAY_MODES, default=None,
                    help="with --moe-enable-routing-replay: replay the rollout engine's routes (r3, the default) "
                         "or those of the trainer's own old-log-prob pass (r2)")
    rl.add_argument("--no-filler-routes", dest="filler_routes", action="store_false",
                    help="route the positions no loss can see (each sample's final token, padding) live instead "
                         "of giving them filler routes: their microbatches then take Megatron's dispatch path, "
                         "with a host sync per MoE layer (for comparison; see docs/routing_replay.md)")
    rl.add_argument("--r3-compare", action=argparse.BooleanOptionalAction, default=None,
                    help="one more forward-only pass per iteration in the other routing mode, to report the "
                         "mismatch with and without replay; training live, its routers then take the rollout's "
                         "routes, so the model is built for them (default: on without --rollout-dump)")
    add_training_stack_args(parser)
    add_profiling_args(parser)
    add_routing_replay_args(parser, enable_help=(
        "train on replayed routes: the update pass replays the rollout engine's routes (or, with "
        "--routing-replay-mode r2, those of the trainer's own old-log-prob pass), its routers built to take "
        "them; without it the trainer routes live"))
    parser.set_defaults(add_bias_linear=False)
    args = parser.parse_args(argv)
    if args.use_checkpoint_args and args.load is not None:
        _take_checkpoint_flags(args, parser)
    if args.r3_compare is None:
        args.r3_compare = args.rollout_dump is None
    if args.routing_replay_mode is not None and not args.moe_enable_routing_replay:
        parser.error(f"--routing-replay-mode {args.routing_replay_mode} needs --moe-enable-routing-replay")
    if args.moe_enable_routing_replay and args.routing_replay_mode is None:
        args.routing_replay_mode = "r3"
    problems = [f"--{flag.replace('_', '-')} needs --{needs.replace('_', '-')}" for flag, needs in (
        ("save_interval", "save"), ("load_optional", "load"), ("append_metrics_file", "metrics_file"),
        ("overwrite_metrics_file", "metrics_file"), ("allow_truncated_rollout_dump", "rollout_dump"),
        ("drop_cut_metrics_line", "metrics_file"), ("use_checkpoint_args", "load"), ("no_load_optim", "load"),
        ("no_load_rng", "load"))
        if getattr(args, flag) not in (None, False) and getattr(args, needs) is None]
    if args.rollout_dump is not None and not os.path.isfile(args.rollout_dump):
        # Before the flags a dump needs: a path that names no dump is the first thing to fix.
        problems.append(f"--rollout-dump {args.rollout_dump}: "
                        + ("a folder, not a rollout dump" if os.path.isdir(args.rollout_dump) else "no such file"))
    problems += value_problems(args)
    if not problems:
        try:
            complete_args(args)
        except ValueError as error:
            problems = [str(error)]
        else:
            problems = (relation_problems(args) + training_stack_problems(training_stack_settings(args))
                        + profiling_problems(profiling_settings(args)))
    if problems:  # one line each, without argparse's usage block
        parser.exit(2, "".join(f"{parser.prog}: error: {problem}\n" for problem in problems))
    return args


def _take_checkpoint_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--use-checkpoint-args``: the flags a resumed run must share with ``--load``'s checkpoint, taken from it
    (:mod:`megatron_r3.rl.checkpoint.resume_flags`), each one the flags gave otherwise said on rank 0.

    Without a checkpoint there yet the given flags stand, as in Megatron-LM (``--load`` itself is checked
    before the run builds anything).
    """
    try:
        saved = checkpoint_flags(*find_checkpoint(args.load))
    except FileNotFoundError:
        return
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: --use-checkpoint-args: {error}\n")
    if saved is None:
        parser.exit(2, f"{parser.prog}: error: --use-checkpoint-args: the checkpoint of --load {args.load} was saved "
                       f"without its flags (by an earlier version)\n")
    for line in take_checkpoint_flags(args, saved):
        if os.environ.get("RANK", "0") == "0":
            print(f" {line}", flush=True)


def layer_freq(args: argparse.Namespace):
    """``--moe-layer-freq`` as Megatron's ``moe_layer_freq`` (an int or a per-layer list; default 1)."""
    return parse_moe_layer_freq(args.moe_layer_freq or "1")


def virtual_pipeline_stages(args: argparse.Namespace) -> Optional[int]:
    """Virtual pipeline stages per rank: ``--num-virtual-stages-per-pipeline-rank``, or as Megatron-LM
    derives them from ``--hybrid-layer-pattern`` (its ``|`` segments per pipeline rank)."""
    if args.hybrid_layer_pattern is None:
        return args.num_virtual_stages_per_pipeline_rank
    return hybrid_virtual_stages(args.hybrid_layer_pattern, args.pipeline_model_parallel_size)


def task_of(args: argparse.Namespace) -> SymbolTask:
    """The built-in task the flags describe."""
    return SymbolTask(args.task, args.task_num_symbols, args.task_min_symbols, args.task_max_symbols)


def default_micro_batch_size(args: argparse.Namespace, world_size: int) -> int:
    """``--micro-batch-size`` when not given: each data-parallel rank's samples in one microbatch per stage.

    That is the fewest microbatches the pipeline schedule runs, hence the fewest passes through
    the model. A small model's pass costs the host's time to issue its operators whatever the
    rows' length, on a GPU most of all (docs/benchmarks.md: the default run's training passes take
    a quarter of the time with one microbatch instead of four). Without ``--global-batch-size``
    (dump mode) it is 8.
    """
    if args.global_batch_size is None:
        return 8
    per_rank = max(args.global_batch_size // data_parallel_size(args, world_size), 1)
    pp = args.pipeline_model_parallel_size
    return per_rank // pp if per_rank % pp == 0 else per_rank


def _world_size() -> int:
    """The process group's size, or before it exists torchrun's ``WORLD_SIZE`` (as Megatron-LM's flags read it)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def complete_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults that depend on other flags and checks that they fit together (idempotent)."""
    tp = args.tensor_model_parallel_size
    defaults = GPU_MODEL if torch.cuda.is_available() else CPU_MODEL  # the device initialize() takes
    for flag, value in defaults.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.hybrid_layer_pattern is not None:
        # The pattern sets the layer count, as in Megatron-LM, which warns and takes the pattern's
        # count over a different --num-layers; here a different count is refused.
        count = hybrid_num_layers(args.hybrid_layer_pattern)
        if args.num_layers not in (None, count):
            raise ValueError(f"--num-layers {args.num_layers} does not match --hybrid-layer-pattern "
                             f"{args.hybrid_layer_pattern!r}, which has {count} layers (leave --num-layers out)")
        args.num_layers = count
    elif args.num_layers is None:
        args.num_layers = 8
    if args.rollout_dump is None and args.global_batch_size is None:
        args.global_batch_size = 32
    if args.micro_batch_size is None:
        args.micro_batch_size = default_micro_batch_size(args, _world_size())
    if args.rollout_dump is not None:
        for flag in ("vocab_size", "seq_length"):
            if getattr(args, flag) is None:
                raise ValueError(f"--{flag.replace('_', '-')} is required with --rollout-dump")
        return args
    task = task_of(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = task.max_answer_tokens
    if args.vocab_size is None:
        args.vocab_size = -(-task.vocab_size // tp) * tp
    if args.vocab_size < task.vocab_size:
        raise ValueError(f"--vocab-size {args.vocab_size} is too small for task {args.task!r} with "
                         f"{args.task_num_symbols} symbols (it needs {task.vocab_size})")
    cp = args.context_parallel_size
    alignment = (2 * cp if cp > 1 else 1) * (tp if args.sequence_parallel else 1)
    longest = task.max_prompt_tokens + args.max_new_tokens
    needed = args.micro_batch_size * -(-longest // alignment) * alignment
    if args.seq_length is None:
        args.seq_length = needed
    elif args.seq_length < needed:
        raise ValueError(f"--seq-length {args.seq_length} cannot hold --micro-batch-size {args.micro_batch_size} "
                         f"samples of up to {longest} tokens (the task's longest prompt + --max-new-tokens "
                         f"{args.max_new_tokens}), padded to multiples of {alignment}: it needs {needed}")
    return args


def routers_take_moe_routing(args: argparse.Namespace) -> bool:
    """Whether the policy's routers take a per-microbatch ``MoERouting`` (``moe_enable_routing_replay``).

    ``--moe-enable-routing-replay`` trains on replayed routes, so its update passes (and R2's
    old-log-prob pass) need them. ``--r3-compare`` needs them too, for its extra pass in the
    other routing mode: training live, that pass replays the rollout's routes; training with
    replay, it records the routes the routers choose. Routers built so route live in a pass
    that gives them no routes, so a live update pass is unchanged by it.
    """
    return args.moe_enable_routing_replay or args.r3_compare


def routing_replay_settings(args: argparse.Namespace) -> RoutingReplaySettings:
    """The flags of :func:`~megatron_r3.routing_replay.add_routing_replay_args`: routers that take a
    ``MoERouting`` exactly under ``--moe-enable-routing-replay`` (the launcher's policy also under
    ``--r3-compare``: :func:`model_settings`)."""
    return RoutingReplaySettings(enabled=args.moe_enable_routing_replay,
                                 check_values=args.moe_routing_replay_check_values,
                                 check_host_tokens_per_expert=args.moe_check_host_tokens_per_expert)


def parallel_settings(args: argparse.Namespace) -> ParallelSettings:
    """The parallel sizes the flags give (virtual stages derived from ``--hybrid-layer-pattern``)."""
    return ParallelSettings(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_stages(args),
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )


def model_settings(args: argparse.Namespace) -> ModelSettings:
    """The policy's model as the completed flags (:func:`parse_args`, :func:`complete_args`) describe it."""
    freq = layer_freq(args)
    return ModelSettings(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=freq if isinstance(freq, int) else tuple(freq),
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        moe_router_score_function=args.moe_router_score_function,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_allgather_static_shapes=args.moe_allgather_static_shapes,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_grouped_gemm_impl=args.moe_grouped_gemm_impl,
        transformer_impl=args.transformer_impl,
        cp_comm_type=args.cp_comm_type,
        moe_permute_fusion=args.moe_permute_fusion,
        moe_router_fusion=args.moe_router_fusion,
        apply_rope_fusion=args.apply_rope_fusion,
        swiglu=args.swiglu,
        normalization=args.normalization,
        init_method_std=args.init_method_std,
        add_bias_linear=args.add_bias_linear,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings or args.seq_length,
        bf16=args.bf16,
        parallel=parallel_settings(args),
        recompute=RecomputeSettings(granularity=args.recompute_granularity, method=args.recompute_method,
                                    num_layers=args.recompute_num_layers),
        routing_replay=dataclasses.replace(routing_replay_settings(args), enabled=routers_take_moe_routing(args)),
        moe_router_dtype=args.moe_router_dtype,
    )


def rollout_engine_settings(args: argparse.Namespace) -> RolloutEngineSettings:
    """The rollout engine the completed flags ask for (``--rollout-engine``, its sampling and lag)."""
    return RolloutEngineSettings(
        requested=args.rollout_engine,
        sampling=SamplingParams(args.rollout_temperature, args.max_new_tokens, EOS, args.seed),
        staleness=args.rollout_staleness,
        cuda_graphs=args.rollout_cuda_graphs,
        graph_scope=args.inference_cuda_graph_scope,
    )


def rollout_settings(args: argparse.Namespace) -> RolloutSettings:
    """Where the completed flags take the samples from: the built-in task and engine, or ``--rollout-dump``."""
    embedded = args.rollout_dump is None
    return RolloutSettings(
        group_size=args.rollouts_per_prompt,
        seed=args.seed,
        task=task_of(args) if embedded else None,
        engine=rollout_engine_settings(args) if embedded else None,
        dump=args.rollout_dump,
        allow_truncated_dump=args.allow_truncated_rollout_dump,
    )


def policy_update_settings(args: argparse.Namespace) -> PolicyUpdateSettings:
    """How the trainer routes and what it optimises (``--routing-replay-mode``, ``--r3-compare``, ...)."""
    return PolicyUpdateSettings(replay_mode=args.routing_replay_mode, compare=args.r3_compare,
                                clip_ratio=args.clip_ratio, temperature=args.rollout_temperature,
                                filler_routes=args.filler_routes, cuda_graphs=args.trainer_cuda_graphs)


def training_stack_settings(args: argparse.Namespace) -> TrainingStackSettings:
    """The flags of :func:`~megatron_r3.rl.trainer.training_stack.add_training_stack_args`; the decay by
    default takes ``--train-iters``, as in Megatron-LM."""
    return TrainingStackSettings(
        lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters,
        lr_warmup_iters=args.lr_warmup_iters, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
        ddp_bucket_size=args.ddp_bucket_size, override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
    )


def profiling_settings(args: argparse.Namespace) -> ProfilingSettings:
    """The flags of :func:`~megatron_r3.rl.profiling.profiler.add_profiling_args`."""
    return ProfilingSettings(enabled=args.profile, step_start=args.profile_step_start,
                             step_end=args.profile_step_end, ranks=tuple(args.profile_ranks),
                             use_pytorch_profiler=args.use_pytorch_profiler, trace_dir=args.tensorboard_dir)


def run_settings(args: argparse.Namespace) -> RunSettings:
    """Everything a launcher run is built from, from its flags (completed first: :func:`complete_args`)."""
    args = complete_args(args)
    return RunSettings(
        model=model_settings(args),
        rollouts=rollout_settings(args),
        update=policy_update_settings(args),
        training_stack=training_stack_settings(args),
        profiling=profiling_settings(args),
        checkpoints=CheckpointSettings(save=args.save, save_interval=args.save_interval, load=args.load,
                                       load_optional=args.load_optional, load_optim=not args.no_load_optim,
                                       load_rng=not args.no_load_rng),
        logging=LoggingSettings(interval=args.log_interval, phase_times=args.timing_log_level >= 1,
                                count_host_syncs=args.count_host_syncs, metrics_file=args.metrics_file,
                                append_metrics_file=args.append_metrics_file,
                                overwrite_metrics_file=args.overwrite_metrics_file,
                                drop_cut_metrics_line=args.drop_cut_metrics_line),
        train_iters=args.train_iters,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        seed=args.seed,
        distributed_backend=args.distributed_backend,
        flags=dict(vars(args)),
    )
