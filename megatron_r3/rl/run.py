"""A launcher run: build it, check what it reads and writes, resume, iterate, save.

:func:`train` is the whole run: :func:`check_outputs` (on every rank, before anything
is built), :func:`setup` (the policy on Megatron's training stack, the trainer, the
rollout source), :func:`resume` from a checkpoint, then :func:`run_iterations`.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_r3.dataplane.device.microbatches import RowLayout
from megatron_r3.dataplane.device.plan import RankLayout
from megatron_r3.dataplane.formats.output_files import OutputFileError, check_output
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.rl.checkpoint.checkpointing import (
    CheckpointReadError,
    CheckpointSaveError,
    NonFiniteCheckpointError,
    checkpoint_flags,
    load_checkpoint,
    save_checkpoint,
)
from megatron_r3.rl.checkpoint.dirs import find_checkpoint, iteration_dir, save_directory_problem
from megatron_r3.rl.checkpoint.resume_flags import flag_mismatches, rollout_dump_problem
from megatron_r3.rl.checkpoint.rng import RNGStateNotRestoredWarning
from megatron_r3.rl.checkpoint.space import checkpoint_bytes, space_problem
from megatron_r3.rl.initialize import note_metrics_file, noted_by_an_earlier_attempt
from megatron_r3.rl.metrics_file import (
    MetricsFile,
    cut_line_warning,
    metrics_file_problem,
    overwrite_warning,
    write_problem,
)
from megatron_r3.rl.model.factory import build_model, layers_summary, transformer_config
from megatron_r3.rl.profiling.phase_timer import PhaseTimer
from megatron_r3.rl.profiling.profiler import IterationProfiler
from megatron_r3.rl.rollout.engine import RolloutEngine
from megatron_r3.rl.rollout.engine_choice import build_rollout_engine, engine_summary
from megatron_r3.rl.rollout.megatron_engine import MegatronRolloutEngine
from megatron_r3.rl.rollout.sources import DumpRollouts, EmbeddedRollouts
from megatron_r3.rl.run_settings import RunSettings
from megatron_r3.rl.stop_signals import StopRequested, StopSignals, signal_name
from megatron_r3.rl.run_checks import RunCheckError, degenerate_groups_warning, metrics_file_mode, raise_on_any_rank
from megatron_r3.rl.trainer.metrics import iteration_metrics, progress_line
from megatron_r3.rl.trainer.policy_trainer import NonFiniteStepError, PolicyTrainer
from megatron_r3.rl.trainer.training_stack import build_training_stack


@dataclass
class TrainingRun:
    """Everything that decides the next iteration, in one place (what a checkpoint saves and loads).

    Attributes:
        settings: What the run is built from.
        trainer: The policy's chunks, optimizer and routing mode.
        source: Where each iteration's samples come from.
        engine: The rollout engine (``--rollout-engine``: its chunks and lagging weight snapshots),
            or None in dump mode.
        iteration: Iterations done.
        consumed_samples: Samples trained on so far.
    """

    settings: RunSettings
    trainer: PolicyTrainer
    source: Union[EmbeddedRollouts, DumpRollouts]
    engine: Optional[Union[RolloutEngine, MegatronRolloutEngine]]
    iteration: int = 0
    consumed_samples: int = 0


def setup(settings: RunSettings, device: torch.device, log: Callable[[str], None] = print) -> TrainingRun:
    """Builds the policy, the optimizer, the trainer and the rollout source (the engine, or the dump).

    In dump mode the dump is checked first, before anything is built.
    """
    dp_size = parallel_state.get_data_parallel_world_size()
    global_batch = settings.global_batch_size or settings.micro_batch_size * dp_size
    per_rank = global_batch // dp_size  # whole microbatches and groups: run_checks.world_problems
    model, rollouts = settings.model, settings.rollouts
    source = None if rollouts.dump is None else DumpRollouts(rollouts, model, settings.seq_length, global_batch, log)
    try:
        config = transformer_config(model, device)
        chunks = build_model(model, config, device)
        log(layers_summary(model, config))
        spec = RoutingSpec.from_config(config, model.hybrid_layer_pattern)
        rows = RowLayout(RankLayout.of_this_rank(config.sequence_parallel), config, settings.seq_length,
                         settings.micro_batch_size, device, model.hybrid_layer_pattern)
        stack = build_training_stack(chunks, config, settings.training_stack)
        trainer = PolicyTrainer(stack, config, spec, rows, settings.update,
                                PhaseTimer(device, settings.logging.count_host_syncs))
        log(trainer.update.summary())
    except BaseException:
        if source is not None:
            source.close()
        raise
    if source is not None:
        return TrainingRun(settings, trainer, source, None)
    # Built after the policy, so that the policy's initialisation does not depend on the mode.
    engine = build_rollout_engine(rollouts.engine, model, device, chunks, spec, rows, per_rank)
    log(engine_summary(engine, trainer_bf16=config.bf16))
    return TrainingRun(settings, trainer, EmbeddedRollouts(rollouts, engine, per_rank), engine)


def check_outputs(
    settings: RunSettings, log: Callable[[str], None] = print
) -> tuple[Optional[tuple[str, int]], str]:
    """What the run will write and read, checked on every rank before anything is built.

    ``--save`` must be writable on every rank (a probe file is created and removed);
    ``--load`` must name a checkpoint (a run directory or one ``iter_NNNNNNN`` folder in
    it) unless ``--load-optional``, and the flags that must match its own to resume do
    (:mod:`megatron_r3.rl.checkpoint.resume_flags`; one line per flag that does not, unless
    ``--use-checkpoint-args`` took them); an existing ``--metrics-file`` is only written by the
    run it belongs to (a resumed run, a torchrun restart of the run that created it), or
    with ``--append-metrics-file`` / ``--overwrite-metrics-file``.

    Returns:
        The checkpoint to resume from (``(run directory, iteration)``, or None) and the
        :class:`~megatron_r3.rl.metrics_file.MetricsFile` mode.

    Raises:
        RunCheckError: on every rank, naming the flag, the path and the rank.
    """
    rank = dist.get_rank()
    checkpoints, metrics = settings.checkpoints, settings.logging
    if checkpoints.save is not None:
        problem = save_directory_problem(checkpoints.save)
        raise_on_any_rank(None if problem is None else
                          f"--save {checkpoints.save} is not writable on rank {rank}: {problem}")
    checkpoint, problem = None, None
    if checkpoints.load is not None:
        try:
            checkpoint = find_checkpoint(checkpoints.load)
        except FileNotFoundError as error:
            if checkpoints.load_optional:
                log(f" {error}: starting from scratch (--load-optional)")
            else:
                problem = f"--load: {error}; pass --load-optional to start from scratch when there is none"
        except ValueError as error:
            problem = f"--load: {error}"
    raise_on_any_rank(problem)
    if checkpoint is not None and not settings.flags.get("use_checkpoint_args"):
        # One rank reads the checkpoint's flags (every rank would read the same file).
        raise_on_any_rank(resume_flags_problem(checkpoint, settings.flags, log) if rank == 0 else None)
    mode, problem = "new", None
    if metrics.metrics_file is not None and rank == dist.get_world_size() - 1:  # the rank that writes it
        try:
            check_output(metrics.metrics_file, overwrite=True, flag="--metrics-file")  # a folder, in a missing folder
        except OutputFileError as error:
            problem = str(error)
        else:
            mode, why = metrics_file_mode(os.path.exists(metrics.metrics_file), checkpoint is not None,
                                          metrics.append_metrics_file, metrics.overwrite_metrics_file,
                                          noted_by_an_earlier_attempt(metrics.metrics_file))
            resumed = None if checkpoint is None else checkpoint[1]
            problem = (f"--metrics-file {metrics.metrics_file} {why}" if why is not None else
                       metrics_file_problem(metrics.metrics_file, mode, resumed, metrics.drop_cut_metrics_line)
                       or write_problem(metrics.metrics_file))
            warning = None
            if mode == "overwrite":
                warning = overwrite_warning(metrics.metrics_file, resumed)
            elif mode == "resume" and problem is None:  # the file reads as a metrics file
                warning = cut_line_warning(metrics.metrics_file, resumed)
            if problem is None and warning is not None:
                log(f" {warning}")
    raise_on_any_rank(problem)
    return checkpoint, mode


def resume_flags_problem(checkpoint: tuple[str, int], flags: Mapping[str, Any],
                         log: Callable[[str], None]) -> Optional[str]:
    """The flags of this run that differ from ``checkpoint``'s where they must match, one line each, or None."""
    path = iteration_dir(*checkpoint)
    try:
        saved = checkpoint_flags(*checkpoint)
    except ValueError as error:
        return f"--load: {error}"
    if saved is None:
        log(f" warning: --load {path} was saved without its flags (by an earlier version): they are not compared "
            f"with this run's")
        return None
    return "\n".join(flag_mismatches(saved, flags, path)) or None


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
    state = {"consumed_samples": run.consumed_samples}
    if run.engine is not None:
        state["rollout_weight_advances"] = run.engine.weights.advances
    if isinstance(run.source, DumpRollouts):
        state["rollout_dump"] = run.source.identity()
    stack = run.trainer.stack
    try:
        save_checkpoint(run.settings.checkpoints.save, run.iteration, checkpoint_models(run), stack.optimizer, state,
                        stack.scheduler, flags=run.settings.flags)
    except (NonFiniteCheckpointError, CheckpointSaveError) as error:
        raise type(error)(f"--save: {error}") from None


def check_save_space(run: TrainingRun) -> None:
    """Before the first iteration: ``--save`` has room for one checkpoint (its size from the model and the
    optimizer, :mod:`megatron_r3.rl.checkpoint.space`), on every rank."""
    if run.settings.checkpoints.save is None:
        return
    save = run.settings.checkpoints.save
    problem = space_problem(save, checkpoint_bytes(checkpoint_models(run), run.trainer.stack.optimizer))
    raise_on_any_rank(None if problem is None else f"--save {save}: {problem}")


def resume(run: TrainingRun, checkpoint: Optional[tuple[str, int]], log: Callable[[str], None] = print) -> None:
    """Loads ``checkpoint`` (``(run directory, iteration)`` from :func:`check_outputs`) into the run.

    Weights and optimizer state load under any parallel layout (dist_checkpointing);
    per-rank RNG states only under the layout they were saved with.
    """
    if checkpoint is None:
        return
    directory, iteration = checkpoint
    resumed = run.settings.checkpoints
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RNGStateNotRestoredWarning)  # sampling is seeded per iteration
        stack = run.trainer.stack
        try:
            run.iteration, state = load_checkpoint(
                directory, checkpoint_models(run), stack.optimizer if resumed.load_optim else None, iteration,
                stack.scheduler if resumed.load_optim else None, load_rng=resumed.load_rng)
        except (NonFiniteCheckpointError, CheckpointReadError) as error:
            raise type(error)(f"--load: {error}") from None
        except ValueError as error:  # a checkpoint that does not fit this run: the same on every rank
            raise RunCheckError(f"--load: {error}") from None
    if isinstance(run.source, DumpRollouts):
        raise_on_any_rank(rollout_dump_problem(state.get("rollout_dump"), run.source.identity(), run.source.path,
                                               iteration_dir(directory, iteration)))
    run.consumed_samples = state["consumed_samples"]
    run.source.resume(run.consumed_samples)
    if run.engine is not None:
        run.engine.weights.advances = state["rollout_weight_advances"]
    log(f" resumed from {directory} at iteration {run.iteration} ({run.consumed_samples} samples consumed)")


def run_iterations(run: TrainingRun, log: Callable[[str], None] = print, metrics_mode: str = "new",
                   stops: Optional[StopSignals] = None) -> list[dict]:
    """Runs iterations ``run.iteration + 1`` to ``--train-iters``, logging every ``--log-interval``.

    Args:
        run: The run, at the iteration it continues from.
        log: Where the logging rank prints.
        metrics_mode: How ``--metrics-file`` is opened (:func:`check_outputs`).
        stops: The stop signals noted meanwhile; before each iteration and after the last,
            :func:`stop_if_signalled` asks every rank.

    Returns:
        The metrics of every iteration run (the same on every rank).

    Raises:
        NonFiniteStepError: on every rank, naming the iteration whose loss or gradients are not
            finite; its optimizer step was not taken, and it saved nothing.
        StopRequested: on every rank, when a rank received SIGTERM or SIGINT (:mod:`megatron_r3.rl.stop_signals`).
    """
    settings = run.settings
    checkpoints, logs = settings.checkpoints, settings.logging
    moe_layers = run.trainer.spec.model_moe_layers
    logging_rank = dist.get_rank() == dist.get_world_size() - 1
    metrics_file = MetricsFile(logs.metrics_file if logging_rank else None, metrics_mode, keep_through=run.iteration,
                               drop_cut_line=logs.drop_cut_metrics_line)
    if logging_rank and logs.metrics_file is not None:
        note_metrics_file(logs.metrics_file)
    profiler = IterationProfiler(settings.profiling, dist.get_rank(), log)
    history, window_tokens, first = [], 0, run.iteration
    saved_at = None  # the iteration of the last checkpoint this run saved
    start = window_start = time.perf_counter()
    try:
        while True:
            if stops is not None:  # a safe point: between two iterations, no save in progress
                stop_if_signalled(run, stops, first, saved_at, log if logging_rank else lambda line: None)
            if run.iteration >= settings.train_iters:
                break
            iteration = run.iteration + 1
            timer = run.trainer.timer
            timer.reset()
            profiler.before(iteration)
            with timer.phase("rollout"):
                if run.engine is not None:  # the policy's weights of --rollout-staleness steps ago
                    run.engine.weights.advance()
                batch = run.source.batch(iteration)
            try:
                sums = run.trainer.step(batch.samples, batch.advantages, batch.rewards)
            except NonFiniteStepError as error:
                raise NonFiniteStepError(f"iteration {iteration}: {error}") from None
            profiler.after(iteration)
            run.iteration = iteration
            run.consumed_samples += int(sums["samples"][0])
            window_tokens += int(sums["tokens"][0])
            now = time.perf_counter()
            elapsed = now - start
            metrics = iteration_metrics(
                sums, moe_layers, iteration=iteration, consumed_samples=run.consumed_samples,
                tokens_per_s=window_tokens / max(now - window_start, 1e-9), elapsed_s=elapsed,
                eta_s=elapsed / (iteration - first) * (settings.train_iters - iteration), seconds=timer.seconds,
                host_syncs=timer.host_syncs if timer.count_host_syncs else None)
            history.append(metrics)
            if iteration % logs.interval == 0:
                window_tokens, window_start = 0, now
                if logging_rank:
                    log(progress_line(metrics, settings.train_iters, timers=logs.phase_times))
                    metrics_file.write(metrics)
            if checkpoints.save and (iteration == settings.train_iters
                                     or (checkpoints.save_interval and iteration % checkpoints.save_interval == 0)):
                try:
                    save(run)
                except CheckpointSaveError as error:  # on every rank
                    if stops is not None:  # a stop signal that came meanwhile still stops the run, saying so
                        stop_if_signalled(run, stops, first, None, log if logging_rank else lambda line: None,
                                          failed_save=error)
                    raise
                saved_at = iteration
                if logging_rank:
                    log(f" saved checkpoint at iteration {iteration} to {checkpoints.save}")
    finally:
        metrics_file.close()
    return history


def stop_if_signalled(run: TrainingRun, stops: StopSignals, first: int, saved_at: Optional[int],
                      log: Callable[[str], None], failed_save: Optional[CheckpointSaveError] = None) -> None:
    """At a safe point: when any rank received a stop signal, save the run (unless no iteration ran since
    ``first``, or ``saved_at``, the last save, is of this iteration), say what was saved in one line, and
    raise :class:`StopRequested` (on every rank).

    A save that fails once a rank has the signal (``failed_save``, or this one) is abandoned as any failed
    save is (its partial folder removed), and the run stops all the same, saying so.
    """
    signum = stops.agreed()
    if signum is None:
        return
    save_dir = run.settings.checkpoints.save
    if failed_save is not None:
        kept = f"its save was abandoned: {failed_save}"
    elif run.iteration == first:
        kept = "nothing saved (no iteration ran)"
    elif save_dir is None:
        kept = "nothing saved (no --save)"
    elif saved_at == run.iteration:
        kept = f"its checkpoint at iteration {run.iteration} is in {save_dir}"
    else:
        try:
            save(run)
            kept = f"saved checkpoint at iteration {run.iteration} to {save_dir}"
        except CheckpointSaveError as error:
            kept = f"its save was abandoned: {error}"
    message = f"{signal_name(signum)} received: stopped after iteration {run.iteration}; {kept}"
    log(f" {message}")
    raise StopRequested(signum, message)


def train(settings: RunSettings, device: torch.device, log: Callable[[str], None] = print) -> list[dict]:
    """:func:`check_outputs`, :func:`setup`, :func:`resume`, then :func:`run_iterations`; returns every iteration's
    metrics. Everything that can be checked is checked before the first iteration. While the iterations run,
    SIGTERM and SIGINT stop the run at its next safe point (:mod:`megatron_r3.rl.stop_signals`)."""
    rank_log = log if dist.get_rank() == dist.get_world_size() - 1 else lambda line: None
    checkpoint, metrics_mode = check_outputs(settings, rank_log)
    started = time.perf_counter()
    run = setup(settings, device, rank_log)
    rank_log(f" time to build the policy, its training stack and the rollout source (seconds): "
             f"{time.perf_counter() - started:.1f}")
    warning = degenerate_groups_warning(settings.rollouts.group_size,
                                        normalised=run.source.loss_field == "reward")
    if warning is not None:
        rank_log(f" {warning}")
    try:
        resume(run, checkpoint, rank_log)
        check_save_space(run)
        if isinstance(run.source, DumpRollouts):
            run.source.check_microbatches(run.trainer.rows, run.iteration, run.settings.train_iters)
        with StopSignals() as stops:
            return run_iterations(run, log, metrics_mode, stops)
    finally:
        run.source.close()
        run.trainer.update.reset()  # before the process group: a graph holding NCCL's collectives keeps it
