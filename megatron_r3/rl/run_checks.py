"""What ``launch/pretrain_gpt_r3.py`` checks before its first iteration: bad input fails at once, in one line.

* :func:`value_problems` and :func:`relation_problems`: the flags' arithmetic
  (sizes and intervals > 0, finite rates, divisibility, top-k within the experts,
  the pipeline split, the row length), each problem one line naming the flags and
  their values; :func:`world_problems` the same for what needs the world size
  (parallel sizes, batch sizes).
* :func:`raise_on_any_rank`: a problem some ranks find (a folder one cannot
  write, a record of its share of the dump) stops every rank with the same
  message, instead of leaving the others waiting in a collective.
* :func:`metrics_file_mode`: how an existing ``--metrics-file`` may be written.
* :func:`check_dump_records`: every record of a rollout dump read once before
  training, in one streaming pass that the ranks split between them.
* :func:`microbatch_problem`: every microbatch the run will pack from a dump fits
  one ``--seq-length`` row.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.dataplane.formats.dump_checks import check_records, repeated_records
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.layers.hybrid_pattern import (
    check_hybrid_layer_pattern,
    hybrid_mtp_depths,
    hybrid_pipeline_segments,
    hybrid_virtual_stages,
)
from megatron_r3.layers.moe_layers import chunk_layers, chunk_vp_stages, model_moe_layers, parse_moe_layer_freq
from megatron_r3.rl.model.factory import ParallelSettings


class RunCheckError(ValueError):
    """A run that cannot go on: the message names the flags, files or records."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def value_problems(args: argparse.Namespace) -> list[str]:
    """Flags out of their range (sizes and intervals < 1, rates not finite or negative), one line each.

    Checked first: the defaults that depend on other flags, and :func:`relation_problems`,
    divide by these.
    """
    problems = []
    at_least_one = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_experts",
                    "moe_router_topk", "moe_ffn_hidden_size", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                    "recompute_num_layers", "micro_batch_size", "train_iters", "log_interval", "rollouts_per_prompt",
                    "task_min_symbols", "task_max_symbols",
                    # None where a default follows from other flags or the feature is off.
                    "num_query_groups", "expert_tensor_parallel_size", "num_virtual_stages_per_pipeline_rank",
                    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "vocab_size",
                    "max_position_embeddings", "global_batch_size", "seq_length", "save_interval", "max_new_tokens")
    for name in at_least_one:
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.append(f"{_flag(name)} must be >= 1, got {value}")
    for name in ("rollout_staleness", "seed"):
        if getattr(args, name) < 0:
            problems.append(f"{_flag(name)} must be >= 0, got {getattr(args, name)}")
    for name, low in (("lr", 0.0), ("weight_decay", 0.0), ("init_method_std", None), ("rollout_temperature", None),
                      ("clip_ratio", None)):
        value = getattr(args, name)
        if not math.isfinite(value) or (value < low if low is not None else value <= 0):
            problems.append(f"{_flag(name)} must be a finite number {'>= 0' if low is not None else '> 0'}, "
                            f"got {value}")
    if args.task_min_symbols > args.task_max_symbols:  # the task's defaults are derived from both
        problems.append(f"--task-min-symbols {args.task_min_symbols} is larger than --task-max-symbols "
                        f"{args.task_max_symbols}")
    if args.task_num_symbols < 2:
        problems.append(f"--task-num-symbols must be >= 2, got {args.task_num_symbols}")
    if args.hybrid_layer_pattern is not None:
        try:
            check_hybrid_layer_pattern(args.hybrid_layer_pattern, name="--hybrid-layer-pattern")
        except ValueError as error:
            problems.append(str(error))
    return problems


def relation_problems(args: argparse.Namespace) -> list[str]:
    """Flags that do not fit together (divisibility, top-k, pipeline split, row length), one line each.

    For flags that passed :func:`value_problems`, with their defaults filled in.
    """
    problems = []
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    etp = expert_tensor_parallel_size(args)
    if args.inference_cuda_graph_scope == "block":
        for flag, given in (("--no-rollout-cuda-graphs", not args.rollout_cuda_graphs),
                            ("--rollout-engine local", args.rollout_engine == "local"),
                            ("--rollout-dump", args.rollout_dump is not None)):
            if given:
                problems.append(f"--inference-cuda-graph-scope block sets what Megatron's engine's CUDA graphs hold, "
                                f"and {flag} runs none")
    if args.moe_router_topk > args.num_experts:
        problems.append(f"--moe-router-topk {args.moe_router_topk} is larger than --num-experts {args.num_experts}")
    if args.num_experts % ep:
        problems.append(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    if args.hidden_size % args.num_attention_heads:
        problems.append(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                        f"{args.num_attention_heads}")
    groups = args.num_query_groups or args.num_attention_heads
    if args.num_attention_heads % groups:
        problems.append(f"--num-attention-heads {args.num_attention_heads} is not divisible by --num-query-groups "
                        f"{groups}")
    for name in ("num_attention_heads", "ffn_hidden_size", "vocab_size"):
        if getattr(args, name) is not None and getattr(args, name) % tp:
            problems.append(f"{_flag(name)} {getattr(args, name)} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if args.moe_ffn_hidden_size % etp:
        problems.append(f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} is not divisible by the experts' "
                        f"tensor-parallel size {etp} (--expert-tensor-parallel-size, default "
                        f"--tensor-model-parallel-size)")
    if args.add_bias_linear and etp > 1:
        problems.append(f"--add-bias-linear needs the experts' tensor-parallel size 1 (Megatron has no MoE biases "
                        f"under expert-TP), it is {etp}: pass --expert-tensor-parallel-size 1")
    if groups % tp:
        problems.append(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
    if args.hybrid_layer_pattern is None:
        try:
            model_moe_layers(args.num_layers, parse_moe_layer_freq(args.moe_layer_freq or "1"))
        except ValueError as error:
            problems.append(f"--moe-layer-freq {args.moe_layer_freq} with --num-layers {args.num_layers}: {error}")
        problems += _pipeline_problems(args)
    else:
        problems += _hybrid_pattern_problems(args)
    if args.seq_length is not None:
        cp = args.context_parallel_size
        alignment = (2 * cp if cp > 1 else 1) * (tp if args.sequence_parallel else 1)
        if args.seq_length % alignment:
            problems.append(f"--seq-length {args.seq_length} is not a multiple of {alignment} (2 x "
                            f"--context-parallel-size {cp} when > 1, times --tensor-model-parallel-size {tp} with "
                            f"--sequence-parallel)")
        if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
            problems.append(f"--max-position-embeddings {args.max_position_embeddings} is smaller than --seq-length "
                            f"{args.seq_length}")
    return problems


def expert_tensor_parallel_size(sizes: Union[argparse.Namespace, ParallelSettings]) -> int:
    """The experts' tensor-parallel size: ``--expert-tensor-parallel-size``, by default the dense layers'
    (of the flags, or a ``ParallelSettings``: the same names)."""
    if sizes.expert_tensor_parallel_size is None:
        return sizes.tensor_model_parallel_size
    return sizes.expert_tensor_parallel_size


def _pipeline_problems(args: argparse.Namespace) -> list[str]:
    pp, vp = args.pipeline_model_parallel_size, args.num_virtual_stages_per_pipeline_rank
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if pp == 1 and (vp is not None or first is not None or last is not None):
        return ["--num-virtual-stages-per-pipeline-rank and --decoder-first/last-pipeline-num-layers need "
                "--pipeline-model-parallel-size > 1"]
    flags = [f"--num-layers {args.num_layers}", f"--pipeline-model-parallel-size {pp}"]
    for name, value in (("num_virtual_stages_per_pipeline_rank", vp), ("decoder_first_pipeline_num_layers", first),
                        ("decoder_last_pipeline_num_layers", last)):
        if value is not None:
            flags.append(f"{_flag(name)} {value}")
    # Megatron's own checks and split: its TransformerConfig's, then the layers it gives each chunk.
    try:
        config = TransformerConfig(num_layers=args.num_layers, hidden_size=1, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                   pipeline_dtype=torch.float32,
                                   cuda_graph_modules=[])  # the default, "full", warns that it is deprecated
        chunks = [chunk_layers(config, rank, stage) for stage in chunk_vp_stages(config) for rank in range(pp)]
    except (ValueError, AssertionError) as error:
        return [f"{', '.join(flags)}: {' '.join(str(error).split())}"]  # Megatron's messages span lines
    counts = [chunk.stop - chunk.start for chunk in chunks]
    if sorted(n for chunk in chunks for n in chunk) != list(range(1, args.num_layers + 1)) or min(counts) < 0:
        return [f"{', '.join(flags)}: the pipeline chunks would build {counts} layers, not each of the "
                f"{args.num_layers} layers once"]
    return []


def _hybrid_pattern_problems(args: argparse.Namespace) -> list[str]:
    """A ``--hybrid-layer-pattern`` with the flags it replaces, its MTP depths and its pipeline split.

    As Megatron-LM: the pattern's ``|`` segments make the pipeline stages and virtual stages
    (``--num-virtual-stages-per-pipeline-rank`` is refused), ``--decoder-first/last-pipeline-num-layers``
    only split a pattern without ``|``, and its ``E`` layers are the MoE layers.
    """
    pattern, pp = args.hybrid_layer_pattern, args.pipeline_model_parallel_size
    flag = f"--hybrid-layer-pattern {pattern!r}"
    problems = []
    if args.moe_layer_freq is not None:
        problems.append(f"--moe-layer-freq {args.moe_layer_freq} with {flag}: the pattern's 'E' layers are the MoE "
                        "layers (leave --moe-layer-freq out)")
    if hybrid_mtp_depths(pattern):
        problems.append(f"{flag} has MTP layers (after '/'): the launcher trains no multi-token prediction "
                        "(leave out the '/' part)")
    if args.num_virtual_stages_per_pipeline_rank is not None:
        problems.append(f"--num-virtual-stages-per-pipeline-rank with {flag}: the pattern's '|' segments make "
                        "the virtual stages (pp x virtual stages segments)")
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    segments = hybrid_pipeline_segments(pattern)
    if segments > 1 and pp == 1:
        problems.append(f"{flag} has {segments} '|' segments: pipeline segments need --pipeline-model-parallel-size "
                        "> 1 (leave out the '|' to run the pattern on one pipeline stage)")
    elif segments > 1 and (first is not None or last is not None):
        problems.append(f"--decoder-first/last-pipeline-num-layers with {flag}: its '|' segments are the "
                        "pipeline stages")
    if problems:
        return problems
    if pp == 1 and (first is not None or last is not None):
        return ["--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1"]
    try:
        vp = hybrid_virtual_stages(pattern, pp)
        config = TransformerConfig(num_layers=args.num_layers, hidden_size=1, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                   pipeline_dtype=torch.float32, is_hybrid_model=True, cuda_graph_modules=[])
        for stage in chunk_vp_stages(config):
            for rank in range(pp):
                chunk_layers(config, rank, stage, hybrid_layer_pattern=pattern)
    except (ValueError, AssertionError) as error:
        return [f"{flag}, --pipeline-model-parallel-size {pp}: {' '.join(str(error).split())}"]
    return []


def data_parallel_size(sizes: Union[argparse.Namespace, ParallelSettings], world_size: int) -> int:
    """The data-parallel size the flags (or a ``ParallelSettings``: the same names) give ``world_size`` ranks
    (at least 1)."""
    model_parallel = sizes.tensor_model_parallel_size * sizes.pipeline_model_parallel_size * sizes.context_parallel_size
    return max(world_size // model_parallel, 1)


def world_problems(parallel: ParallelSettings, world_size: int, *, global_batch_size: Optional[int],
                   micro_batch_size: int, rollouts_per_prompt: int) -> list[str]:
    """Problems of the parallel sizes and the batch with ``world_size`` ranks, naming the flags."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp, ep, etp = parallel.context_parallel_size, parallel.expert_model_parallel_size, expert_tensor_parallel_size(parallel)
    problems = []
    if world_size % (tp * pp * cp):
        return [f"{world_size} ranks do not divide into --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {tp * pp * cp}"]
    if world_size % (etp * ep * pp):
        experts_tp = ("--tensor-model-parallel-size" if parallel.expert_tensor_parallel_size is None
                      else "--expert-tensor-parallel-size")
        problems.append(f"{world_size} ranks do not divide into {experts_tp} {etp} x "
                        f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}")
    dp = data_parallel_size(parallel, world_size)
    global_batch = global_batch_size or micro_batch_size * dp
    if global_batch % (micro_batch_size * dp):
        problems.append(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size "
                        f"{micro_batch_size} x data-parallel size {dp} = {micro_batch_size * dp}")
    elif (global_batch // dp) % rollouts_per_prompt:
        problems.append(f"each data-parallel rank's {global_batch // dp} samples (--global-batch-size {global_batch} "
                        f"/ data-parallel size {dp}) are not whole groups of --rollouts-per-prompt "
                        f"{rollouts_per_prompt}")
    return problems


def raise_on_any_rank(problem: Optional[str]) -> None:
    """Raises :class:`RunCheckError` on every rank when any rank has a problem (call it on every rank).

    The message is the first failing rank's; it names the other failing ranks.
    """
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    _raise_first(gathered)


def _raise_first(problems: Sequence[Optional[str]]) -> None:
    failed = [rank for rank, p in enumerate(problems) if p is not None]
    if failed:
        also = f" (and on ranks {failed[1:]})" if len(failed) > 1 else ""
        raise RunCheckError(f"{problems[failed[0]]}{also}")


def metrics_file_mode(exists: bool, resumed: bool, append: bool, overwrite: bool,
                      written_by_this_run: bool) -> tuple[str, Optional[str]]:
    """How a run writes its ``--metrics-file``: a :class:`~megatron_r3.rl.metrics_file.MetricsFile` mode, or a problem.

    Args:
        exists: The file exists.
        resumed: The run continues from a checkpoint (the file's lines up to it are its own).
        append, overwrite: ``--append-metrics-file``, ``--overwrite-metrics-file``.
        written_by_this_run: An earlier attempt of this run (a torchrun restart) created the file.

    Returns:
        ``(mode, problem)``: problem is set (and mode meaningless) when the file belongs to
        another run and neither flag says what to do with it.
    """
    if append:
        return "append", None
    if overwrite:
        return "overwrite", None
    if resumed or written_by_this_run:
        return "resume", None
    if exists:
        return "new", ("exists and this run starts from scratch, so it belongs to another run: pass "
                       "--append-metrics-file or --overwrite-metrics-file, or choose another file")
    return "new", None


def check_dump_records(reader: RolloutDumpReader, log=print) -> tuple[str, str]:
    """Reads every record of the dump once, each rank a contiguous share; returns the loss field all carry
    and a digest of the records.

    Every record's CRC, routes, log-probs and loss fields are checked
    (:func:`~megatron_r3.dataplane.formats.dump_checks.check_records`), one record in memory at a time.
    Records that repeat an earlier one (the same sample twice) are counted and ``log`` warns of
    them, naming the first. Call it on every rank.

    Returns:
        ``"advantage"`` when every sample has one, else ``"reward"`` when every sample has one; and
        a digest of every record's sample digest in order (what a checkpoint compares the dump by).

    Raises:
        RunCheckError: on every rank, naming the first bad record, a record with neither
            field, or a dump whose samples mix them.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    count = len(reader)
    problem, missing, digests = None, {}, []
    try:
        missing = check_records(reader, rank * count // world, (rank + 1) * count // world, require_loss_field=True,
                                digests=digests)
    except ValueError as error:  # RolloutDumpError, RoutingValidationError, SampleValueError
        problem = f"--rollout-dump {reader.name}: {error}"
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (problem, missing, digests))
    _raise_first([p for p, _, _ in gathered])
    every = sorted(d for _, _, rank_digests in gathered for d in rank_digests)
    records_digest = hashlib.blake2b(b"".join(digest for _, digest in every), digest_size=8).hexdigest()
    repeats = repeated_records(every)
    if repeats:
        shown = ", ".join(f"record {r} = record {earlier}" for r, earlier in repeats[:3])
        log(f" warning: rollout dump {reader.name}: {len(repeats)} records repeat an earlier one (the same tokens, "
            f"log-probs, routes and metadata): {shown}{', ...' if len(repeats) > 3 else ''}; each trains as often "
            f"as it appears")
    gathered = [(p, m) for p, m, _ in gathered]
    first = {key: min((m[key] for _, m in gathered if m[key] is not None), default=None) for key in missing}
    if first["advantage"] is None:
        return "advantage", records_digest
    if first["reward"] is None:
        return "reward", records_digest
    raise RunCheckError(f"--rollout-dump {reader.name}: record {first['reward']} has no 'reward' and record "
                        f"{first['advantage']} no 'advantage': the loss takes every sample's advantage, or "
                        f"normalises every sample's reward")


def degenerate_groups_warning(rollouts_per_prompt: int, normalised: bool) -> Optional[str]:
    """A warning when group normalisation makes every advantage zero (groups of one sample), or None."""
    if rollouts_per_prompt != 1 or not normalised:
        return None
    return ("warning: --rollouts-per-prompt 1: each group holds one sample, so every group-normalised advantage is "
            "0 and the loss gives the policy no gradient; use >= 2 rollouts per prompt (or a dump whose samples "
            "carry an 'advantage')")


def microbatch_problem(num_tokens: Sequence[int], *, consumed_samples: int, iterations: int, global_batch: int,
                       micro_batch_size: int, alignment: int, seq_length: int, first_iteration: int) -> Optional[str]:
    """The first microbatch of the next ``iterations`` that does not fit one ``seq_length`` row, or None.

    Sample position ``p`` is record ``p % N`` (the dump read cyclically); microbatches are
    consecutive runs of ``micro_batch_size`` positions from ``consumed_samples`` on, each
    sample padded to a multiple of ``alignment``. The pattern repeats after
    ``N / gcd(N, micro_batch_size)`` microbatches, so at most that many are checked.
    """
    lens = np.asarray(num_tokens, dtype=np.int64)
    count = len(lens)
    total = iterations * global_batch // micro_batch_size
    checked = min(total, count // math.gcd(count, micro_batch_size))
    positions = consumed_samples + np.arange(checked * micro_batch_size, dtype=np.int64)
    padded = -(-lens[positions % count] // alignment) * alignment
    needed = padded.reshape(checked, micro_batch_size).sum(axis=1)
    too_long = np.flatnonzero(needed > seq_length)
    if not len(too_long):
        return None
    k = int(too_long[0])
    records = (positions[k * micro_batch_size:(k + 1) * micro_batch_size] % count).tolist()
    iteration = first_iteration + k * micro_batch_size // global_batch
    return (f"--seq-length {seq_length} is too short: iteration {iteration} packs records {records} of the dump "
            f"({lens[records].tolist()} tokens) into one microbatch, which needs {int(needed[k])} positions once "
            f"each sample is padded to a multiple of {alignment}; raise --seq-length or lower --micro-batch-size")
