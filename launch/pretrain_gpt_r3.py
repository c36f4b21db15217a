"""RL training of a Megatron GPT MoE with rollout routing replay (R3).

    torchrun --nproc-per-node 2 launch/pretrain_gpt_r3.py --moe-enable-routing-replay

With no other flag this is a complete small R3 loop, with no data and no
download, on CPUs (gloo) or GPUs (NCCL): each iteration the built-in rollout
engine (``megatron_r3.rollout_engine``: the policy's weights in bf16, lagging
``--rollout-staleness`` optimizer steps) completes ``--global-batch-size /
--rollouts-per-prompt`` prompts of a built-in task (``megatron_r3.tasks``) and
records the routes it took and the log-probs of its tokens; the task scores the
completions; the trainer (``megatron_r3.policy_trainer``, fp32) replays the
engine's routes on every MoE layer and takes a step on the clipped
policy-gradient loss with group-normalised advantages (GRPO). ``--r3-compare``
(on by default here) runs one more forward-only pass without replay, so every
logged iteration shows the train/rollout mismatch with and without R3.

With ``--rollout-dump`` the samples come from a rollout dump instead
(``megatron_r3.rollout_dump``, read again from the start when it runs out; each
sample's metadata holds its ``reward`` or ``advantage``), trained with the same
loss and metrics. The policy trains through Megatron's stack
(``megatron_r3.training_stack``: DDP, ``finalize_model_grads``, Megatron's Adam, the
learning-rate schedule), with Megatron-LM's flags for it (``--use-distributed-optimizer``,
``--overlap-grad-reduce``, ``--clip-grad``, ``--lr-decay-style``, ...).

``--routing-replay-mode r2`` replays the routes of the trainer's own
old-log-prob pass instead of the engine's; without ``--moe-enable-routing-replay``
the trainer routes live. Every ``--log-interval`` iterations the last rank
prints a progress line and appends the metrics (``megatron_r3.train_metrics``)
to ``--metrics-file``. Flags follow Megatron's names; every model and layout
flag has a small default (all parallel sizes 1, so ``--nproc-per-node 2`` is
data-parallel size 2). Layers come from ``megatron_r3.layer_specs`` (no
TransformerEngine needed). ``--save``/``--save-interval`` write checkpoints
(``megatron_r3.checkpointing``: weights, optimizer, learning-rate schedule, the engine's
lagging weights, data position, RNG) and ``--load`` resumes from the latest one, under
any layout.

Bad input stops the run before its first iteration, with one line naming the
flags, files or records (``megatron_r3.run_checks``): the flags' arithmetic, an
unwritable ``--save``, a ``--load`` without a checkpoint (unless
``--load-optional``), a ``--metrics-file`` of another run (unless
``--append-metrics-file`` or ``--overwrite-metrics-file``), a dump without its
footer (unless ``--allow-truncated-rollout-dump``), with bytes after it, or with
a record that is corrupt or holds a value the loss cannot take. A loss or
gradients that are not finite stop the step before the optimizer applies it,
with nothing saved and the iteration named. The process then exits with status
1 (2 for flags).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.adapters import RoutingSpec
from megatron_r3.checkpointing import (
    RNGStateNotRestoredWarning,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_directory_problem,
)
from megatron_r3.layer_specs import get_gpt_decoder_block_r3_spec
from megatron_r3.moe_layers import PipelineSplit, moe_layer_numbers, parse_moe_layer_freq
from megatron_r3.plan import RankLayout
from megatron_r3.policy_loss import group_advantages
from megatron_r3.output_files import OutputFileError, check_output
from megatron_r3.phase_timer import PhaseTimer
from megatron_r3.policy_trainer import REPLAY_MODES, NonFiniteStepError, PolicyTrainer, PolicyUpdateSettings
from megatron_r3.rollout_batch import RowLayout
from megatron_r3.rollout_dump import RolloutDumpReader, RolloutSample, check_dump_fits
from megatron_r3.rollout_engine import RolloutEngine, RolloutEngineError, SamplingParams
from megatron_r3.rollout_shards import DataParallelDumpShard
from megatron_r3.routing_replay import add_routing_replay_args, routing_replay_config_kwargs
from megatron_r3.run_checks import (
    RunCheckError,
    check_dump_records,
    metrics_file_mode,
    microbatch_problem,
    raise_on_any_rank,
    relation_problems,
    value_problems,
    world_problems,
)
from megatron_r3.tasks import EOS, TRANSFORMS, SymbolTask
from megatron_r3.train_metrics import MetricsFile, iteration_metrics, progress_line
from megatron_r3.training_stack import add_training_stack_args, build_training_stack, training_stack_problems


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Megatron-style flags; every one has a default that makes a small embedded run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="pretrain_gpt_r3.py")
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=8)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--ffn-hidden-size", type=int, default=256)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention groups")
    model.add_argument("--num-experts", type=int, default=8)
    model.add_argument("--moe-router-topk", type=int, default=2)
    model.add_argument("--moe-ffn-hidden-size", type=int, default=128)
    model.add_argument("--moe-layer-freq", default="1",
                       help="every Nth layer is MoE (an int), or one 0/1 per layer, comma-separated")
    model.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    model.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall")
    model.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="RMSNorm")
    model.add_argument("--init-method-std", type=float, default=0.15, help="std of the normal weight init")
    model.add_argument("--vocab-size", type=int, default=None,
                       help="divisible by the TP size (default: the task's vocabulary, rounded up to it)")
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    model.add_argument("--bf16", action="store_true",
                       help="train in bf16 parameters and activations, with fp32 main weights in the optimizer "
                            "(default fp32; the rollout engine is bf16)")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parallel.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parallel.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    parallel.add_argument("--context-parallel-size", type=int, default=1)
    parallel.add_argument("--expert-model-parallel-size", type=int, default=1)
    parallel.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    parallel.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    parallel.add_argument("--recompute-num-layers", type=int, default=1)

    training = parser.add_argument_group("training")
    training.add_argument("--rollout-dump", default=None,
                          help="train on this rollout dump (megatron_r3.rollout_dump) instead of the built-in engine")
    training.add_argument("--allow-truncated-rollout-dump", action="store_true",
                          help="train on a --rollout-dump without its footer (its writer did not finish, or the file "
                               "was cut), on the whole samples it holds, with a warning; refused by default")
    training.add_argument("--micro-batch-size", type=int, default=8, help="samples packed per microbatch")
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
                         "mismatch with and without replay (default: on without --rollout-dump)")
    add_training_stack_args(parser)
    add_routing_replay_args(parser)
    args = parser.parse_args(argv)
    if args.r3_compare is None:
        args.r3_compare = args.rollout_dump is None
    if args.routing_replay_mode is not None and not args.moe_enable_routing_replay:
        parser.error(f"--routing-replay-mode {args.routing_replay_mode} needs --moe-enable-routing-replay")
    if args.moe_enable_routing_replay and args.routing_replay_mode is None:
        args.routing_replay_mode = "r3"
    problems = [f"--{flag.replace('_', '-')} needs --{needs.replace('_', '-')}" for flag, needs in (
        ("save_interval", "save"), ("load_optional", "load"), ("append_metrics_file", "metrics_file"),
        ("overwrite_metrics_file", "metrics_file"), ("allow_truncated_rollout_dump", "rollout_dump"))
        if getattr(args, flag) not in (None, False) and getattr(args, needs) is None]
    problems += value_problems(args)
    if not problems:
        try:
            complete_args(args)
        except ValueError as error:
            problems = [str(error)]
        else:
            problems = relation_problems(args) + training_stack_problems(args)
    if problems:  # one line each, without argparse's usage block
        parser.exit(2, "".join(f"{parser.prog}: error: {problem}\n" for problem in problems))
    return args


def layer_freq(args: argparse.Namespace):
    """``--moe-layer-freq`` as Megatron's ``moe_layer_freq`` (an int or a per-layer list)."""
    return parse_moe_layer_freq(args.moe_layer_freq)


def task_of(args: argparse.Namespace) -> SymbolTask:
    """The built-in task the flags describe."""
    return SymbolTask(args.task, args.task_num_symbols, args.task_min_symbols, args.task_max_symbols)


def complete_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults that depend on other flags and checks that they fit together (idempotent)."""
    tp = args.tensor_model_parallel_size
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
    if args.global_batch_size is None:
        args.global_batch_size = 32
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


def transformer_config(args: argparse.Namespace, device: torch.device, *, bf16: Optional[bool] = None,
                       routing_replay: Optional[bool] = None) -> TransformerConfig:
    """The model's ``TransformerConfig`` from the flags.

    Args:
        args: The flags.
        device: Where the model computes.
        bf16: Override ``--bf16`` (the rollout engine always runs bf16).
        routing_replay: Override ``moe_enable_routing_replay`` (default: on with
            ``--moe-enable-routing-replay`` or ``--r3-compare``, which replays in its extra pass).
    """
    bf16 = args.bf16 if bf16 is None else bf16
    dtype = torch.bfloat16 if bf16 else torch.float32
    replay = routing_replay_config_kwargs(args)
    if routing_replay is None:
        routing_replay = args.moe_enable_routing_replay or args.r3_compare
    replay["moe_enable_routing_replay"] = routing_replay
    recompute = {}
    if args.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective")
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        normalization=args.normalization,
        init_method_std=args.init_method_std,
        add_bias_linear=False,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_layer_freq=layer_freq(args),
        moe_router_score_function=args.moe_router_score_function,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.num_virtual_stages_per_pipeline_rank,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # The loss is a sum over tokens; the step divides by the iteration's token count.
        calculate_per_token_loss=True,
        # gloo (CPU) pairs batched sends and receives by order and swaps them when both go to
        # the same peer (PP=2); separate isend/irecv are right on every backend.
        batch_p2p_comm=device.type == "cuda",
        **recompute,
        **replay,
    )


def init_model_parallel(args: argparse.Namespace) -> None:
    """Megatron's parallel state for the flags, on an initialised default process group."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.num_virtual_stages_per_pipeline_rank,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )


# The torchrun agent's store (None outside torchrun): it outlives a worker group, so a restarted
# attempt reads there what an earlier attempt of the same run noted (_note_metrics_file).
_agent_store: Optional[dist.Store] = None


def init_process_group(device: torch.device) -> None:
    """The default process group from torchrun's environment (``env://``), NCCL or gloo.

    Its store keys are scoped to this attempt of the worker group: after a torchrun restart
    (``--max-restarts``) the agent's store still holds the addresses the dead workers
    published under the same keys, and a restarted worker would try to connect to them.
    """
    global _agent_store
    store, rank, world_size = next(dist.rendezvous("env://"))
    _agent_store = store
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.PrefixStore(f"/worker_group_attempt_{attempt}", store),
                            rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None)


def initialize(args: argparse.Namespace) -> torch.device:
    """Process group (from torchrun's environment unless one exists), parallel state and RNG.

    CUDA and NCCL where CUDA is available, else the CPU and gloo. The flags' arithmetic with
    the world size is checked before the parallel state is built.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        init_process_group(device)
    problems = world_problems(args, dist.get_world_size())
    if problems:
        raise RunCheckError("; ".join(problems))
    init_model_parallel(args)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return device


def build_model(args: argparse.Namespace, config: TransformerConfig, device: torch.device) -> list[GPTModel]:
    """This rank's model chunks, one per virtual pipeline stage."""
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp) if vp else [None]:
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_decoder_block_r3_spec(config, vp_stage=vp_stage),
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings or args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        ).to(device))
    return chunks


def check_dump(reader: RolloutDumpReader, args: argparse.Namespace) -> None:
    """Refuses, before training, a dump that does not fit the model (routes, vocab, sample lengths)."""
    check_dump_fits(reader, num_experts=args.num_experts, topk=args.moe_router_topk,
                    moe_layer_numbers=moe_layer_numbers(args.num_layers, layer_freq(args)), vocab_size=args.vocab_size,
                    seq_length=args.seq_length)


@dataclass
class RolloutBatch:
    """This data-parallel rank's samples of one iteration, with their advantages and rewards."""

    samples: list[RolloutSample]
    advantages: np.ndarray
    rewards: Optional[np.ndarray]


class EmbeddedRollouts:
    """Prompts from the built-in task, completions from the built-in engine, rewards from the task.

    Replica ``d`` completes prompts ``[d * P, (d + 1) * P)`` of each iteration, each
    ``--rollouts-per-prompt`` times; advantages are normalised within each prompt's group.
    """

    def __init__(self, args: argparse.Namespace, engine: RolloutEngine, per_rank: int):
        self.task = task_of(args)
        self.engine = engine
        self.seed = args.seed
        self.group = args.rollouts_per_prompt
        self.prompts_per_rank = per_rank // self.group
        self.dp_rank = parallel_state.get_data_parallel_rank()

    def batch(self, iteration: int) -> RolloutBatch:
        first = self.dp_rank * self.prompts_per_rank
        prompts = self.task.prompts(self.seed, iteration, range(first, first + self.prompts_per_rank))
        repeated = [p for p in prompts for _ in range(self.group)]
        self.engine.weights.advance()
        samples = self.engine.generate([p.token_ids for p in repeated], iteration)
        rewards = np.asarray([self.task.reward(p, s.token_ids[len(p.token_ids):]) for p, s in zip(repeated, samples)])
        for sample, reward in zip(samples, rewards):
            sample.meta["reward"] = float(reward)
        return RolloutBatch(samples, group_advantages(rewards, self.group), rewards)

    def resume(self, consumed_samples: int) -> None:
        """Nothing to do: prompts and sampling follow from (seed, iteration, data-parallel rank)."""

    def close(self) -> None:
        """Nothing to release: the engine lives as long as the run."""


class DumpRollouts:
    """This rank's share of the next ``--global-batch-size`` samples of the dump (``DataParallelDumpShard``).

    Advantages come from each sample's metadata: ``advantage`` as given when every
    sample of the dump has one, else ``reward`` normalised within groups of
    ``--rollouts-per-prompt`` consecutive samples (a rank's share is whole groups).

    Before training the dump is checked whole: its footer (a dump without one is
    refused unless ``--allow-truncated-rollout-dump``), its fit to the model, and every
    record (CRC, routes, values, a reward or an advantage), in one streaming pass the
    ranks split between them (``megatron_r3.run_checks.check_dump_records``).
    """

    def __init__(self, args: argparse.Namespace, global_batch: int, log: Callable[[str], None]):
        self.path, self.global_batch = args.rollout_dump, global_batch
        self.group = args.rollouts_per_prompt
        # A cut last record is dropped by the reader and refused (or warned about) by _check_footer.
        self.reader = RolloutDumpReader(self.path, allow_truncated_tail=True)
        try:
            self._check_footer(args.allow_truncated_rollout_dump, log)
            check_dump(self.reader, args)
            self.loss_field = check_dump_records(self.reader)
        except BaseException:
            self.reader.close()
            raise
        self.shard = self._shard(consumed_samples=0)

    def _check_footer(self, allow_truncated: bool, log: Callable[[str], None]) -> None:
        if self.reader.finished:
            return
        why = "format version 2 has none" if self.reader.version < 3 else \
            "its writer did not finish, or the file was cut"
        recovered = len(self.reader)  # a scan of the record heads; bytes after a footer raise here
        dropped = os.path.getsize(self.path) - self.reader.index.end
        found = f"{recovered} whole samples" + (f" and {dropped} bytes of a cut record" if dropped else "")
        if not allow_truncated:
            raise RunCheckError(f"--rollout-dump {self.path} has no footer ({why}), so samples may be missing at "
                                f"its end ({found} are there): pass --allow-truncated-rollout-dump to train on the "
                                f"whole samples")
        log(f" warning: --rollout-dump {self.path} has no footer ({why}): training on the {recovered} whole "
            f"samples recovered" + (f", {dropped} bytes of a cut record dropped" if dropped else ""))

    def _shard(self, consumed_samples: int) -> DataParallelDumpShard:
        return DataParallelDumpShard(self.reader, parallel_state.get_data_parallel_rank(),
                                     parallel_state.get_data_parallel_world_size(), self.global_batch,
                                     consumed_samples=consumed_samples)

    def resume(self, consumed_samples: int) -> None:
        """Continue after the first ``consumed_samples`` samples (a checkpoint's data position)."""
        self.shard = self._shard(consumed_samples)

    def check_microbatches(self, args: argparse.Namespace, iteration: int, alignment: int) -> None:
        """Every microbatch of the iterations after ``iteration`` fits one ``--seq-length`` row."""
        problem = microbatch_problem(self.reader.index.num_tokens, consumed_samples=self.shard.consumed_samples,
                                     iterations=args.train_iters - iteration, global_batch=self.global_batch,
                                     micro_batch_size=args.micro_batch_size, alignment=alignment,
                                     seq_length=args.seq_length, first_iteration=iteration + 1)
        if problem is not None:
            raise RunCheckError(problem)

    def batch(self, iteration: int) -> RolloutBatch:
        samples = self.shard.next_batch()
        rewards = None
        if all("reward" in s.meta for s in samples):
            rewards = np.asarray([s.meta["reward"] for s in samples], dtype=np.float64)
        if self.loss_field == "advantage":
            advantages = np.asarray([s.meta["advantage"] for s in samples], dtype=np.float64)
        else:
            advantages = group_advantages(rewards, self.group)
        return RolloutBatch(samples, advantages, rewards)

    def close(self) -> None:
        self.reader.close()


@dataclass
class TrainingRun:
    """Everything that decides the next iteration, in one place (what a checkpoint saves and loads).

    Attributes:
        args: The completed flags.
        trainer: The policy's chunks, optimizer and routing mode.
        source: Where each iteration's samples come from.
        engine: The built-in rollout engine (its chunks and lagging weight snapshots), or
            None in dump mode.
        iteration: Iterations done.
        consumed_samples: Samples trained on so far.
    """

    args: argparse.Namespace
    trainer: PolicyTrainer
    source: Union[EmbeddedRollouts, DumpRollouts]
    engine: Optional[RolloutEngine]
    iteration: int = 0
    consumed_samples: int = 0


def setup(args: argparse.Namespace, device: torch.device, log: Callable[[str], None] = print) -> TrainingRun:
    """Builds the policy, the optimizer, the trainer and the rollout source (the engine, or the dump).

    In dump mode the dump is checked first, before anything is built.
    """
    args = complete_args(args)
    dp_size = parallel_state.get_data_parallel_world_size()
    global_batch = args.global_batch_size or args.micro_batch_size * dp_size
    per_rank = global_batch // dp_size  # whole microbatches and groups: run_checks.world_problems
    source = DumpRollouts(args, global_batch, log) if args.rollout_dump is not None else None
    try:
        config = transformer_config(args, device)
        chunks = build_model(args, config, device)
        spec = RoutingSpec.from_config(config)
        rows = RowLayout(RankLayout.of_this_rank(config.sequence_parallel), PipelineSplit.from_config(config), args.seq_length,
                         args.micro_batch_size, device)
        stack = build_training_stack(chunks, config, args)
        trainer = PolicyTrainer(stack, config, spec, rows, PolicyUpdateSettings(
            replay_mode=args.routing_replay_mode, compare=args.r3_compare, clip_ratio=args.clip_ratio,
            temperature=args.rollout_temperature, filler_routes=args.filler_routes),
            PhaseTimer(device, args.count_host_syncs))
    except BaseException:
        if source is not None:
            source.close()
        raise
    if source is not None:
        return TrainingRun(args, trainer, source, None)
    # Built after the policy, so that the policy's initialisation does not depend on the mode.
    engine_config = transformer_config(args, device, bf16=True, routing_replay=True)
    engine = RolloutEngine(lambda: build_model(args, engine_config, device), chunks, spec, rows,
                           SamplingParams(args.rollout_temperature, args.max_new_tokens, EOS, args.seed),
                           args.rollout_staleness)
    return TrainingRun(args, trainer, EmbeddedRollouts(args, engine, per_rank), engine)


def check_outputs(
    args: argparse.Namespace, log: Callable[[str], None] = print
) -> tuple[Optional[tuple[str, int]], str]:
    """What the run will write and read, checked on every rank before anything is built.

    ``--save`` must be writable on every rank (a probe file is created and removed);
    ``--load`` must name a checkpoint (a run directory or one ``iter_NNNNNNN`` folder in
    it) unless ``--load-optional``; an existing ``--metrics-file`` is only written by the
    run it belongs to (a resumed run, a torchrun restart of the run that created it), or
    with ``--append-metrics-file`` / ``--overwrite-metrics-file``.

    Returns:
        The checkpoint to resume from (``(run directory, iteration)``, or None) and the
        :class:`~megatron_r3.train_metrics.MetricsFile` mode.

    Raises:
        RunCheckError: on every rank, naming the flag, the path and the rank.
    """
    rank = dist.get_rank()
    if args.save is not None:
        problem = save_directory_problem(args.save)
        raise_on_any_rank(None if problem is None else f"--save {args.save} is not writable on rank {rank}: {problem}")
    checkpoint, problem = None, None
    if args.load is not None:
        try:
            checkpoint = find_checkpoint(args.load)
        except FileNotFoundError as error:
            if args.load_optional:
                log(f" {error}: starting from scratch (--load-optional)")
            else:
                problem = f"--load: {error}; pass --load-optional to start from scratch when there is none"
        except ValueError as error:
            problem = f"--load: {error}"
    raise_on_any_rank(problem)
    mode, problem = "new", None
    if args.metrics_file is not None and rank == dist.get_world_size() - 1:  # the rank that writes it
        mode, why = metrics_file_mode(os.path.exists(args.metrics_file), checkpoint is not None,
                                      args.append_metrics_file, args.overwrite_metrics_file,
                                      _noted_by_an_earlier_attempt(args.metrics_file))
        problem = None if why is None else f"--metrics-file {args.metrics_file} {why}"
        try:
            check_output(args.metrics_file, overwrite=True, flag="--metrics-file")  # a folder, in a missing folder
        except OutputFileError as error:
            problem = problem or str(error)
    raise_on_any_rank(problem)
    return checkpoint, mode


def _metrics_file_key(path: str) -> str:
    return f"megatron_r3/metrics_file_created/{os.path.abspath(path)}"


def _noted_by_an_earlier_attempt(path: str) -> bool:
    """Whether an earlier attempt of this torchrun run created the metrics file (``_note_metrics_file``)."""
    return _agent_store is not None and _agent_store.check([_metrics_file_key(path)])


def _note_metrics_file(path: str) -> None:
    """Tells later attempts of this torchrun run (after a restart) that the metrics file is this run's."""
    if _agent_store is not None:
        _agent_store.set(_metrics_file_key(path), "1")


def checkpoint_models(run: TrainingRun) -> dict[str, list[torch.nn.Module]]:
    """Every set of model chunks a checkpoint holds: the policy, and the engine's lagging weights."""
    models = {"model": run.trainer.stack.chunks}
    if run.engine is not None:
        lag = run.engine.weights
        models["rollout"] = lag.follower
        models.update({f"rollout_lag{i}": chunks for i, chunks in enumerate(lag.snapshots)})
    return models


def save(run: TrainingRun) -> None:
    """Saves the run at its current iteration to ``--save``."""
    state = {"consumed_samples": run.consumed_samples, "args": vars(run.args)}
    if run.engine is not None:
        state["rollout_weight_advances"] = run.engine.weights.advances
    stack = run.trainer.stack
    save_checkpoint(run.args.save, run.iteration, checkpoint_models(run), stack.optimizer, state, stack.scheduler)


def resume(run: TrainingRun, checkpoint: Optional[tuple[str, int]], log: Callable[[str], None] = print) -> None:
    """Loads ``checkpoint`` (``(run directory, iteration)`` from :func:`check_outputs`) into the run.

    Weights and optimizer state load under any parallel layout (dist_checkpointing);
    per-rank RNG states only under the layout they were saved with.
    """
    if checkpoint is None:
        return
    directory, iteration = checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RNGStateNotRestoredWarning)  # sampling is seeded per iteration
        stack = run.trainer.stack
        run.iteration, state = load_checkpoint(directory, checkpoint_models(run), stack.optimizer, iteration,
                                               stack.scheduler)
    run.consumed_samples = state["consumed_samples"]
    run.source.resume(run.consumed_samples)
    if run.engine is not None:
        run.engine.weights.advances = state["rollout_weight_advances"]
    log(f" resumed from {directory} at iteration {run.iteration} ({run.consumed_samples} samples consumed)")


def run_iterations(run: TrainingRun, log: Callable[[str], None] = print, metrics_mode: str = "new") -> list[dict]:
    """Runs iterations ``run.iteration + 1`` to ``--train-iters``, logging every ``--log-interval``.

    Args:
        run: The run, at the iteration it continues from.
        log: Where the logging rank prints.
        metrics_mode: How ``--metrics-file`` is opened (:func:`check_outputs`).

    Returns:
        The metrics of every iteration run (the same on every rank).

    Raises:
        NonFiniteStepError: on every rank, naming the iteration whose loss or gradients are not
            finite; its optimizer step was not taken, and it saved nothing.
    """
    args = run.args
    moe_layers = run.trainer.spec.moe_layer_numbers
    logging_rank = dist.get_rank() == dist.get_world_size() - 1
    metrics_file = MetricsFile(args.metrics_file if logging_rank else None, metrics_mode, keep_through=run.iteration)
    if logging_rank and args.metrics_file is not None:
        _note_metrics_file(args.metrics_file)
    history, window_tokens, first = [], 0, run.iteration
    start = window_start = time.perf_counter()
    try:
        while run.iteration < args.train_iters:
            iteration = run.iteration + 1
            timer = run.trainer.timer
            timer.reset()
            with timer.phase("rollout"):
                batch = run.source.batch(iteration)
            try:
                sums = run.trainer.step(batch.samples, batch.advantages, batch.rewards)
            except NonFiniteStepError as error:
                raise NonFiniteStepError(f"iteration {iteration}: {error}") from None
            run.iteration = iteration
            run.consumed_samples += int(sums["samples"][0])
            window_tokens += int(sums["tokens"][0])
            now = time.perf_counter()
            elapsed = now - start
            metrics = iteration_metrics(
                sums, moe_layers, iteration=iteration, consumed_samples=run.consumed_samples,
                tokens_per_s=window_tokens / max(now - window_start, 1e-9), elapsed_s=elapsed,
                eta_s=elapsed / (iteration - first) * (args.train_iters - iteration), seconds=timer.seconds,
                host_syncs=timer.host_syncs if timer.count_host_syncs else None)
            history.append(metrics)
            if iteration % args.log_interval == 0:
                window_tokens, window_start = 0, now
                if logging_rank:
                    log(progress_line(metrics, args.train_iters, timers=args.timing_log_level >= 1))
                    metrics_file.write(metrics)
            if args.save and (iteration == args.train_iters
                              or (args.save_interval and iteration % args.save_interval == 0)):
                save(run)
                if logging_rank:
                    log(f" saved checkpoint at iteration {iteration} to {args.save}")
    finally:
        metrics_file.close()
    return history


def train(args: argparse.Namespace, device: torch.device, log: Callable[[str], None] = print) -> list[dict]:
    """:func:`check_outputs`, :func:`setup`, :func:`resume`, then :func:`run_iterations`; returns every iteration's
    metrics. Everything that can be checked is checked before the first iteration."""
    rank_log = log if dist.get_rank() == dist.get_world_size() - 1 else lambda line: None
    checkpoint, metrics_mode = check_outputs(args, rank_log)
    run = setup(args, device, rank_log)
    try:
        resume(run, checkpoint, rank_log)
        if isinstance(run.source, DumpRollouts):
            run.source.check_microbatches(run.args, run.iteration, run.trainer.rows.rank.alignment)
        return run_iterations(run, log, metrics_mode)
    finally:
        run.source.close()


def main(argv: Optional[list[str]] = None) -> None:
    """Runs the launcher; bad input ends the process with one line on stderr and exit status 1."""
    args = parse_args(argv)
    try:
        device = initialize(args)
        train(args, device)
    except (ValueError, OSError, NonFiniteStepError, RolloutEngineError) as error:
        print(f"pretrain_gpt_r3.py: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
