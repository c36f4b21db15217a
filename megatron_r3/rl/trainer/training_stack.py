"""Megatron's training stack around the policy's model chunks: DDP, optimizer, gradient finalisation, LR schedule.

:func:`build_training_stack` sets the chunks up the way Megatron-LM's ``get_model`` and
``setup_model_and_optimizer`` do, under Megatron-LM's flag names
(:func:`add_training_stack_args`):

* every chunk in ``megatron.core.distributed.DistributedDataParallel``: gradients
  accumulate in fp32 buffers and are reduced bucket by bucket, overlapped with the
  backward pass under ``--overlap-grad-reduce``, reduce-scattered under
  ``--use-distributed-optimizer``;
* ``finalize_model_grads`` as the config's ``finalize_model_grads_func``: the schedule
  calls it after the last backward of a training pass with the pass's token count (the
  loss is a sum over completion tokens, ``calculate_per_token_loss``); it finishes the
  data-parallel reductions, all-reduces what SP, PP and EP need (layer norms, embeddings,
  expert-bias updates) and divides every gradient by the iteration's completion tokens
  over all ranks, so the step is that of the mean per-token loss;
* ``get_megatron_optimizer``: Adam, fp32 main weights for bf16 parameters, the
  optimizer state sharded over data-parallel ranks with ``--use-distributed-optimizer``,
  gradients clipped to ``--clip-grad``, and an update whose gradient norm is not finite
  skipped (``step()`` returns ``success=False``; the weights and the Adam moments stay
  as they were);
* ``OptimizerParamScheduler``, stepped once per iteration (its steps are iterations).

On a GPU, DDP is built on Megatron's shared capture stream, as Megatron-LM builds it for
full-iteration CUDA graphs: DDP keeps each parameter's ``AccumulateGrad`` node, and autograd
accumulates a gradient on the stream its node was made on. A backward issued on another stream
joins the two (the trainer runs its update passes on that stream, :func:`on_training_stream`);
a captured backward must not join a stream outside the capture.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.full_cuda_graph import get_shared_capture_stream
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def add_training_stack_args(parser: argparse.ArgumentParser) -> None:
    """The optimizer, learning-rate and data-parallel flags, with Megatron-LM's names."""
    group = parser.add_argument_group("optimizer and learning rate")
    group.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (Adam)")
    group.add_argument("--min-lr", type=float, default=0.0, help="the learning rate a decay ends at")
    group.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="constant",
                       help="learning-rate decay after the warmup (Megatron-LM's default is linear; an RL run "
                            "usually keeps its rate)")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="iterations the decay takes, warmup included (default: --train-iters)")
    group.add_argument("--lr-warmup-iters", type=int, default=0,
                       help="iterations of linear warmup from 0 to --lr (the first step is taken at rate 0)")
    group.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW)")
    group.add_argument("--clip-grad", type=float, default=1.0,
                       help="clip gradients to this global L2 norm (0: no clipping)")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.95,
                       help="(Megatron-LM's default is 0.999; its GPT and MoE examples use 0.95)")
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="shard the optimizer state and fp32 main weights over the data-parallel ranks "
                            "(gradients are reduce-scattered, weights all-gathered after the step)")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="reduce each gradient bucket as soon as the backward pass has filled it")
    group.add_argument("--ddp-bucket-size", type=int, default=None,
                       help="parameters per gradient bucket with --overlap-grad-reduce (default: "
                            "max(40M, 1M x data-parallel size), as in Megatron-LM)")
    resume = group.add_mutually_exclusive_group()
    resume.add_argument("--override-opt-param-scheduler", action="store_true",
                        help="on --load, take the learning-rate schedule from the flags, not the checkpoint")
    resume.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                        help="on --load, take the learning-rate schedule from the checkpoint, not the flags")


@dataclass(frozen=True)
class TrainingStackSettings:
    """The optimizer, learning-rate schedule and data-parallel settings (the flags of
    :func:`add_training_stack_args`, named as those flags).

    Attributes:
        lr_decay_iters: Iterations the decay takes, warmup included (the flag's default: the run's iterations).
        ddp_bucket_size: Parameters per gradient bucket with ``overlap_grad_reduce``; None: Megatron-LM's size.
        override_opt_param_scheduler: On a resume, take the schedule from these settings.
        use_checkpoint_opt_param_scheduler: On a resume, take the schedule from the checkpoint.
    """

    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int
    lr_warmup_iters: int
    weight_decay: float
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    ddp_bucket_size: Optional[int] = None
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False


def training_stack_problems(settings: TrainingStackSettings) -> list[str]:
    """The settings out of range or not fitting together, one line each, naming the flags."""
    problems = []
    for name, low, high in (("clip_grad", 0.0, None), ("min_lr", 0.0, None), ("adam_beta1", 0.0, 1.0),
                            ("adam_beta2", 0.0, 1.0)):
        value = getattr(settings, name)
        if not (math.isfinite(value) and value >= low and (high is None or value < high)):
            problems.append(f"{_flag(name)} must be a finite number >= {low}" + (f" and < {high}" if high else "")
                            + f", got {value}")
    if not (math.isfinite(settings.adam_eps) and settings.adam_eps > 0):
        problems.append(f"--adam-eps must be a finite number > 0, got {settings.adam_eps}")
    for name, low in (("lr_warmup_iters", 0), ("lr_decay_iters", 1), ("ddp_bucket_size", 1)):
        value = getattr(settings, name)
        if value is not None and value < low:
            problems.append(f"{_flag(name)} must be >= {low}, got {value}")
    if problems:
        return problems
    if settings.min_lr > settings.lr:
        problems.append(f"--min-lr {settings.min_lr} is larger than --lr {settings.lr}")
    if settings.lr_warmup_iters >= settings.lr_decay_iters:
        problems.append(f"--lr-warmup-iters {settings.lr_warmup_iters} must be smaller than --lr-decay-iters "
                        f"{settings.lr_decay_iters} (default: --train-iters)")
    return problems


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class TrainingStack:
    """The policy's chunks in Megatron's DDP, their optimizer and its learning-rate schedule.

    Attributes:
        model: The DDP-wrapped chunks, one per virtual pipeline stage: what the schedule runs.
        optimizer: Megatron's optimizer over them (a ``ChainedOptimizer`` of the dense and
            the expert parameters).
        scheduler: Sets the optimizer's learning rate and weight decay; one step per iteration.
    """

    model: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """The model chunks inside the DDP wrappers (what checkpoints and the rollout engine read)."""
        return [wrapper.module for wrapper in self.model]

    def zero_grad(self) -> None:
        """Zeroes the DDP gradient buffers and the optimizer's gradients, before a training pass."""
        for wrapper in self.model:
            wrapper.zero_grad_buffer()
        self.optimizer.zero_grad()


def build_training_stack(
    chunks: Sequence[torch.nn.Module], config: TransformerConfig, settings: TrainingStackSettings
) -> TrainingStack:
    """Wraps this rank's model ``chunks`` and builds their optimizer and scheduler from ``settings``.

    Sets ``config.finalize_model_grads_func`` (and, with ``--overlap-grad-reduce``,
    ``no_sync_func`` and ``grad_sync_func``), so that every training pass of Megatron's
    schedule over the wrapped chunks leaves reduced, token-averaged gradients.

    Args:
        chunks: The policy's chunks (``config.calculate_per_token_loss`` must be set).
        config: Their ``TransformerConfig``.
        settings: The optimizer, schedule and data-parallel settings.
    """
    if not config.calculate_per_token_loss:
        raise ValueError("the training stack divides gradients by the token count: it needs a config with "
                         "calculate_per_token_loss")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # Megatron-LM's choice for bf16; fp32 gradients are fp32 anyway
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        bucket_size=_bucket_size(settings),
    )
    with on_training_stream(next(chunks[0].parameters()).device):
        model = _wrap(chunks, config, ddp_config)
    config.finalize_model_grads_func = finalize_model_grads
    if settings.overlap_grad_reduce:
        config.no_sync_func = [wrapper.no_sync for wrapper in model]
        config.grad_sync_func = [wrapper.start_grad_sync for wrapper in model]
        if len(model) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=settings.lr, min_lr=settings.min_lr, weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
            clip_grad=settings.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
            use_distributed_optimizer=settings.use_distributed_optimizer, skip_non_finite_grad_norm=True,
        ),
        model,
        use_gloo_process_groups=False,  # gathers of the distributed optimizer's state use the default groups
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=settings.lr, min_lr=settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_iters, lr_decay_steps=settings.lr_decay_iters,
        lr_decay_style=settings.lr_decay_style, start_wd=settings.weight_decay, end_wd=settings.weight_decay,
        wd_incr_steps=settings.lr_decay_iters, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=settings.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=settings.override_opt_param_scheduler,
    )
    return TrainingStack(model, optimizer, scheduler)


@contextlib.contextmanager
def on_training_stream(device: torch.device) -> Iterator[None]:
    """Runs the block on the stream DDP is built on (module docstring); on a CPU, as it is.

    The stream waits for the current one's work before the block, and the current stream for
    the block's work after it.
    """
    if device.type != "cuda":
        yield
        return
    stream = get_shared_capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream().wait_stream(stream)


def _bucket_size(settings: TrainingStackSettings) -> Optional[int]:
    """Megatron-LM's bucket size: one bucket without overlap, else large enough to stay bandwidth-bound."""
    if not settings.overlap_grad_reduce:
        return None
    if settings.ddp_bucket_size is not None:
        return settings.ddp_bucket_size
    return max(40_000_000, 1_000_000 * parallel_state.get_data_parallel_world_size(with_context_parallel=True))


def _wrap(chunks: Sequence[torch.nn.Module], config: TransformerConfig,
          ddp_config: DistributedDataParallelConfig) -> list[DistributedDataParallel]:
    """Each chunk in DDP, as Megatron-LM's ``get_model`` wraps them.

    Only the first chunk of the first pipeline stage is bucketed: the other chunks' reductions are
    not on the critical path. With the distributed optimizer each chunk gets the parameter layout
    its shards follow, computed beforehand as Megatron-LM does.
    """
    first_stage = parallel_state.get_pipeline_model_parallel_rank() == 0
    wrapped = []
    for index, chunk in enumerate(chunks):
        bucketed = index == 0 and first_stage
        layout = None
        if ddp_config.use_distributed_optimizer:
            layout = DistributedOptimizer.compute_full_param_layout(
                [p for p in chunk.parameters() if p.requires_grad],
                ddp_config.bucket_size if bucketed else None,
                parallel_state.get_data_parallel_world_size(with_context_parallel=True),
                ddp_config,
                expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size(),
            )
        wrapped.append(DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=not bucketed,
                                               full_param_layout=layout))
    return wrapped


# The flags behind each value of OptimizerParamScheduler.state_dict(); num_steps is the progress, not the schedule.
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--weight-decay", "end_wd": "--weight-decay", "wd_incr_steps": "--lr-decay-iters",
                   "wd_incr_style": "--weight-decay"}


def scheduler_mismatch(scheduler: OptimizerParamScheduler, saved: dict) -> Optional[str]:
    """How a checkpoint's schedule (``saved``, a ``state_dict()``) differs from ``scheduler``'s, or None.

    Megatron's scheduler refuses to load another schedule (with an assertion) unless it was
    built to override it or to take it; this says so in one line naming the flags first. Values
    the schedules do not read need not agree: the decay length of a constant rate, and the
    weight-decay ramp (the weight decay is constant).
    """
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return None
    differences = [f"{_SCHEDULE_FLAGS[key]} {value} here, {saved.get(key)} there"
                   for key, value in _read_schedule(scheduler.state_dict(), saved).items()
                   if saved.get(key) != value]
    if not differences:
        return None
    return (f"its learning-rate schedule is not this run's ({'; '.join(dict.fromkeys(differences))}): pass "
            f"--override-opt-param-scheduler to take the flags', --use-checkpoint-opt-param-scheduler the checkpoint's")


def load_scheduler_state(scheduler: OptimizerParamScheduler, saved: dict) -> None:
    """``scheduler.load_state_dict(saved)`` once :func:`scheduler_mismatch` found none: the checkpoint's step
    count, and its schedule where the scheduler takes it."""
    here = scheduler.state_dict()
    unread = {key: here[key] for key in here if key not in _read_schedule(here, saved) and key != "num_steps"}
    scheduler.load_state_dict({**saved, **unread})


def _read_schedule(here: dict, saved: dict) -> dict:
    """The values of ``here`` that decide the learning rate and weight decay, given ``saved``."""
    read = {key: value for key, value in here.items() if key != "num_steps"}
    del read["wd_incr_steps"]  # the weight decay is constant
    if here["lr_decay_style"] == saved.get("lr_decay_style") == "constant":
        del read["lr_decay_steps"]
    return read
