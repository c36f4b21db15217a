"""Which launcher flags a resumed run must share with its checkpoint, and the lines that name those it does not.

A checkpoint keeps the flags of the run that saved it (:func:`~megatron_r3.rl.checkpoint.checkpointing.
checkpoint_flags`). A run that resumes from it continues that run, so every flag that changes what is
trained must be the checkpoint's: the model, the routing, the rollout data and its staleness
(:data:`COMPARED_FLAGS`). As in Megatron-LM (``check_checkpoint_args``), a mismatch stops the run; unlike
Megatron-LM's assertion, every differing flag is named in a line of its own with both values.
``--use-checkpoint-args`` takes them from the checkpoint instead (:func:`take_checkpoint_flags`).

Every other flag may change on resume (:data:`RESUMABLE_FLAGS`, listed in docs/checkpoints.md): the
parallel layout, the batch, the iterations, intervals and logging, the optimizer's settings (the
learning-rate schedule is compared by the scheduler itself, as in Megatron-LM), implementation choices
that compute the same model (kernels, fusions, CUDA graphs, the rollout engine, precision) and what is
checked.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

from megatron_r3.layers.moe_layers import model_moe_layers, parse_moe_layer_freq

_MODEL, _ROUTING, _DATA, _STALENESS = "the model", "the routing", "the rollout data", "the rollouts' staleness"

# The flags (argparse dests) a resumed run must share with its checkpoint, and what each changes.
COMPARED_FLAGS: dict[str, str] = {
    **dict.fromkeys(("num_layers", "hybrid_layer_pattern", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "swiglu",
                     "normalization", "add_bias_linear", "vocab_size"), _MODEL),
    **dict.fromkeys(("moe_router_topk", "moe_router_score_function", "moe_router_dtype",
                     "moe_enable_routing_replay", "routing_replay_mode", "filler_routes"), _ROUTING),
    **dict.fromkeys(("rollout_dump", "task", "task_num_symbols", "task_min_symbols", "task_max_symbols",
                     "rollouts_per_prompt", "rollout_temperature", "max_new_tokens", "seed"), _DATA),
    "rollout_staleness": _STALENESS,
}

# The flags that may change on resume (docs/checkpoints.md lists them).
RESUMABLE_FLAGS = frozenset({
    # the parallel layout and how it runs: a checkpoint loads under any layout
    "tensor_model_parallel_size", "sequence_parallel", "pipeline_model_parallel_size",
    "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "distributed_backend",
    # implementations of the same model and the same sampling
    "transformer_impl", "moe_grouped_gemm", "moe_grouped_gemm_impl", "moe_token_dispatcher_type",
    "moe_allgather_static_shapes", "cp_comm_type",
    "moe_permute_fusion", "moe_router_fusion", "apply_rope_fusion", "bf16", "init_method_std",
    "max_position_embeddings",
    "rollout_engine", "rollout_cuda_graphs", "inference_cuda_graph_scope", "trainer_cuda_graphs", "r3_compare",
    "moe_routing_replay_check_values", "moe_check_host_tokens_per_expert",
    # the batch and the iterations
    "micro_batch_size", "global_batch_size", "seq_length", "train_iters", "allow_truncated_rollout_dump",
    # the loss's clip and the optimizer (its learning-rate schedule is compared by the scheduler)
    "clip_ratio", "lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "weight_decay",
    "clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "use_distributed_optimizer", "overlap_grad_reduce",
    "ddp_bucket_size", "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
    # checkpoints, logging and profiling
    "save", "save_interval", "load", "load_optional", "use_checkpoint_args", "no_load_optim", "no_load_rng",
    "log_interval", "timing_log_level", "count_host_syncs", "metrics_file", "append_metrics_file",
    "overwrite_metrics_file", "drop_cut_metrics_line", "profile", "profile_step_start", "profile_step_end",
    "profile_ranks", "use_pytorch_profiler", "tensorboard_dir",
})


def _moe_layers(flags: Mapping[str, Any]) -> Any:
    """``--moe-layer-freq`` as the MoE layers it makes (``2`` and ``1,0,1,0`` are the same model)."""
    if flags.get("hybrid_layer_pattern") is not None:
        return None  # the pattern places the MoE layers, and is compared itself
    return model_moe_layers(flags["num_layers"], parse_moe_layer_freq(flags.get("moe_layer_freq") or "1"))


# The built-in task's flags: a run on a dump reads none of them.
_EMBEDDED_ONLY = frozenset({"task", "task_num_symbols", "task_min_symbols", "task_max_symbols", "max_new_tokens", "seed"})

# How a value is compared where two spellings make the same run.
_COMPARED_AS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "moe_layer_freq": _moe_layers,
    # Which dump is the dump's content (RolloutDumpIdentity), not its path: here only dump or not.
    "rollout_dump": lambda flags: flags.get("rollout_dump") is not None,
}


def flag_text(name: str, value: Any) -> str:
    """``--name value`` as a user writes it (``on``/``off`` for a switch, ``unset`` for no value)."""
    if isinstance(value, bool):
        value = "on" if value else "off"
    elif value is None:
        value = "unset"
    return f"--{name.replace('_', '-')} {value}"


def flag_mismatches(saved: Mapping[str, Any], given: Mapping[str, Any], checkpoint: str) -> list[str]:
    """One line per compared flag whose value differs: the saved value, the given value, what it changes.

    Args:
        saved: The checkpoint's flags (a flag it lacks, saved before the flag existed, is not
            compared; nor are the built-in task's when both runs train on a dump).
        given: This run's completed flags.
        checkpoint: The checkpoint's folder, for the lines.
    """
    lines = []
    dumps = saved.get("rollout_dump") is not None and given.get("rollout_dump") is not None
    for name, changes in COMPARED_FLAGS.items():
        if name not in saved or (dumps and name in _EMBEDDED_ONLY):
            continue
        compare = _COMPARED_AS.get(name, lambda flags: flags.get(name))
        if compare(saved) != compare(given):
            lines.append(f"--load {checkpoint} was saved with {flag_text(name, saved[name])}, this run gives "
                         f"{flag_text(name, given.get(name))}: it changes {changes}, so it must match to resume "
                         f"(--use-checkpoint-args takes the checkpoint's)")
    return lines


def take_checkpoint_flags(args, saved: Mapping[str, Any]) -> list[str]:
    """``--use-checkpoint-args``: sets every compared flag of ``args`` (parsed, not yet completed) to the
    checkpoint's; returns a line for each flag given another value, naming both."""
    taken = []
    for name in COMPARED_FLAGS:
        if name not in saved:
            continue
        if name == "rollout_dump" and None not in (args.rollout_dump, saved[name]):
            continue  # the dump given, wherever it lies now: its content is compared
        if getattr(args, name) is not None and getattr(args, name) != saved[name]:
            taken.append(f"--use-checkpoint-args: {flag_text(name, saved[name])} from the checkpoint (the flags say "
                         f"{flag_text(name, getattr(args, name))})")
        setattr(args, name, saved[name])
    return taken


def rollout_dump_problem(saved: Optional[Mapping[str, Any]], given: Mapping[str, Any], path: str,
                         checkpoint: str) -> Optional[str]:
    """Why ``--rollout-dump path`` (its identity ``given``) is not the dump the checkpoint trained on, or None.

    Identities are :meth:`~megatron_r3.rl.rollout.sources.DumpRollouts.identity`: the dump's record count
    and a digest of its records, so a dump moved or copied elsewhere resumes, another one does not.
    """
    if saved is None or dict(saved) == dict(given):
        return None
    return (f"--rollout-dump {os.fspath(path)} holds {given['records']} records of digest {given['digest']}, the "
            f"dump --load {checkpoint} trained on {saved['records']} of digest {saved['digest']}: it changes the "
            f"rollout data, so it must be the same dump to resume")
