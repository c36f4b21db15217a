"""What a launcher run is built from: the settings :func:`megatron_r3.rl.arguments.run_settings`
reads from the flags, and what :mod:`megatron_r3.rl.run` and :mod:`megatron_r3.rl.initialize` take."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megatron_r3.rl.model.factory import ModelSettings
from megatron_r3.rl.profiling.profiler import ProfilingSettings
from megatron_r3.rl.rollout.sources import RolloutSettings
from megatron_r3.rl.trainer.policy_trainer import PolicyUpdateSettings
from megatron_r3.rl.trainer.training_stack import TrainingStackSettings


@dataclass(frozen=True)
class CheckpointSettings:
    """Where a run saves and resumes.

    Attributes:
        save: Directory to save checkpoints to, or None.
        save_interval: Iterations between checkpoints; None: only at the end of training.
        load: Directory (or one ``iter_NNNNNNN`` folder in it) to resume from, or None.
        load_optional: Start from scratch when ``load`` holds no checkpoint yet.
        load_optim: Resume the optimizer's state and learning-rate schedule (``--no-load-optim``: not).
        load_rng: Resume the RNG states (``--no-load-rng``: not).
    """

    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    load_optional: bool = False
    load_optim: bool = True
    load_rng: bool = True


@dataclass(frozen=True)
class LoggingSettings:
    """What a run reports, and where.

    Attributes:
        interval: Iterations between progress lines (and metrics-file lines).
        phase_times: The progress line also gives each phase's seconds.
        count_host_syncs: Count the host's waits for the device in each phase.
        metrics_file: One JSON object per logged iteration goes there, or None.
        append_metrics_file: A run from scratch appends to an existing ``metrics_file``.
        overwrite_metrics_file: A run from scratch replaces an existing ``metrics_file``.
        drop_cut_metrics_line: Appending, drop a last line of ``metrics_file`` that was cut.
    """

    interval: int = 1
    phase_times: bool = False
    count_host_syncs: bool = False
    metrics_file: Optional[str] = None
    append_metrics_file: bool = False
    overwrite_metrics_file: bool = False
    drop_cut_metrics_line: bool = False


@dataclass(frozen=True)
class RunSettings:
    """Everything a launcher run is built from (:func:`megatron_r3.rl.arguments.run_settings` reads it from
    the flags).

    Attributes:
        model: The policy's model (and the rollout engine's).
        rollouts: Where the samples come from.
        update: How the trainer routes and what it optimises.
        training_stack: The optimizer, learning-rate schedule and data-parallel settings.
        profiling: What to profile.
        checkpoints: Where the run saves and resumes.
        logging: What the run reports, and where.
        train_iters: Iterations the run trains to.
        global_batch_size: Samples per iteration over all data-parallel ranks; None: one microbatch
            per data-parallel rank.
        micro_batch_size: Samples packed per microbatch row.
        seq_length: Length of a packed microbatch row.
        seed: Seeds Megatron's RNG and torch's.
        distributed_backend: The process groups' backend; None: NCCL on GPUs, gloo on CPUs.
        flags: The parsed flags by name, saved with each checkpoint: a resumed run compares them
            (:mod:`megatron_r3.rl.checkpoint.resume_flags`).
    """

    model: ModelSettings
    rollouts: RolloutSettings
    update: PolicyUpdateSettings
    training_stack: TrainingStackSettings
    profiling: ProfilingSettings
    checkpoints: CheckpointSettings
    logging: LoggingSettings
    train_iters: int
    global_batch_size: Optional[int]
    micro_batch_size: int
    seq_length: int
    seed: int
    distributed_backend: Optional[str] = None
    flags: Mapping[str, Any] = field(default_factory=dict)
