"""Checkpoints of model chunks, their optimizer, its LR schedule and the run's state, through dist_checkpointing.

A checkpoint lies on disk as in Megatron-LM and is published atomically
(:mod:`megatron_r3.rl.checkpoint.dirs`). Weights are saved through each chunk's
``sharded_state_dict()``: tensors are keyed by their global name (layer and expert
numbers global, TP/EP slices as offsets into the full tensor), so a checkpoint saved
under one parallel layout (TP, SP, PP, VP, CP, EP, DP) loads under any other. The
optimizer (Megatron's, :mod:`megatron_r3.rl.trainer.training_stack`) saves itself through its own
``sharded_state_dict()``: Adam's moments (and the distributed optimizer's fp32 main
weights) keyed like the parameter they belong to
(``optimizer.state.exp_avg.<parameter key>``), the distributed optimizer's shards
gathered into that form (Megatron-LM's ``fully_reshardable`` format), so they follow
a layout change too (:mod:`megatron_r3.rl.checkpoint.optimizer`). Each rank's RNG states
are saved beside them and restored under the same layout only
(:mod:`megatron_r3.rl.checkpoint.rng`).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import CheckpointException  # a BaseException: every rank's failures
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_or_nonpersistent
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_r3.rl.checkpoint.dirs import (
    TRACKER_FILENAME,
    complete_iterations,
    is_complete,
    iteration_dir,
    latest_iteration,
    publish,
    staging_dir,
    start_staging,
)
from megatron_r3.rl.checkpoint.finite import describe, loaded_tensors, non_finite_tensors, sharded_tensors
from megatron_r3.rl.checkpoint.optimizer import OPTIMIZER_METADATA, adam_step, prepare_for_load
from megatron_r3.rl.checkpoint.rng import (
    RNGStateNotRestoredWarning,
    parallel_layout,
    rng_device,
    rng_state_object,
    rng_states,
    set_rng_states,
)
from megatron_r3.rl.trainer.training_stack import load_scheduler_state, scheduler_mismatch

FORMAT_VERSION = 3  # 3: the run's flags in the common state ("args")
_READABLE_FORMATS = (2, 3)
_FORMAT_KEY = "megatron_r3_checkpoint_format"
# Top-level keys of the checkpoint's state dict besides the models'.
_RESERVED_KEYS = frozenset({_FORMAT_KEY, "iteration", "parallel_layout", "rng_device", "state", "rng_state",
                            "optimizer", "optimizer_step", "optimizer_tensors", "opt_param_scheduler", "args"})


class NonFiniteCheckpointError(ValueError):
    """A save or a load met a tensor holding a NaN or an Inf; nothing was written or used."""


class CheckpointReadError(ValueError):
    """A file of a checkpoint cannot be read (a shard deleted or cut)."""


class CheckpointSaveError(OSError):
    """A save failed while writing (a full disk, another OSError): its partial folder was removed."""


def save_checkpoint(
    directory: str,
    iteration: int,
    models: Mapping[str, Sequence[torch.nn.Module]],
    optimizer: Optional[MegatronOptimizer],
    state: Any,
    scheduler: Optional[OptimizerParamScheduler] = None,
    flags: Optional[Mapping[str, Any]] = None,
) -> str:
    """Save a checkpoint of ``iteration``; call it on every rank.

    Args:
        directory: The run's checkpoint directory (created if missing).
        iteration: The iteration number (``>= 0``); a checkpoint of the same
            iteration already in ``directory`` is replaced.
        models: Model chunks by name, e.g. ``{"model": chunks}`` or ``{"model": chunks,
            "rollout0": lagging_copy}``: each rank's chunks (unwrapped, not their DDP
            wrappers), one per virtual pipeline stage. The tensors of ``"model"`` are keyed
            like Megatron-LM's; those of any other name are prefixed with ``"<name>."``.
        optimizer: Megatron's optimizer over the parameters of ``models["model"]`` (or ``None``).
        state: Any picklable object, e.g. ``{"consumed_samples": ..., "args": args}``;
            rank 0's is saved. Each rank's RNG states (Python, NumPy, torch CPU,
            CUDA if available, Megatron's RNG tracker) are saved besides it.
        scheduler: The optimizer's learning-rate schedule (or ``None``).
        flags: The run's flags by name (plain values: numbers, strings, lists), rank 0's saved
            where :func:`checkpoint_flags` reads them without a process group, as Megatron-LM's
            ``args`` (or ``None``).

    Returns:
        The directory of the checkpoint.

    Raises:
        ValueError: a bad iteration or model name.
        NonFiniteCheckpointError: a tensor to save holds a NaN or an Inf (named; checked on
            every rank before anything is written): nothing is written or marked.
        CheckpointSaveError: writing failed on some rank (a full disk, another OSError):
            the partial folder is removed, the tracker is untouched; names the folder and
            the error.
    """
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, not {iteration!r}")
    model_state = _models_sharded_state_dict(models)
    sharded = {
        _FORMAT_KEY: FORMAT_VERSION,
        "iteration": iteration,
        "parallel_layout": parallel_layout(),
        "rng_device": rng_device(),
        "state": _common_object(state),
        "rng_state": rng_state_object(rng_states()),
        **model_state,
    }
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(_policy_state(models, model_state),
                                                            metadata=OPTIMIZER_METADATA)
        sharded["optimizer_step"] = adam_step(optimizer)
    if scheduler is not None:
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    if flags is not None:
        sharded["args"] = dict(flags)

    bad = _first_on_any_rank(non_finite_tensors(sharded_tensors(sharded)) or None)
    if bad is not None:
        raise NonFiniteCheckpointError(
            f"not saving iteration {iteration} to {directory}: {describe(bad)} holds a NaN or an Inf; nothing was "
            f"written, {_latest_text(directory)}")

    staging = staging_dir(directory, iteration)
    failure = _attempt(lambda: start_staging(directory, iteration)) if dist.get_rank() == 0 else None
    if _first_on_any_rank(failure) is None:
        # Synchronous and not fully parallel: every rank writes its main replicas itself.
        failure = _attempt(lambda: dist_checkpointing.save(
            sharded, staging, sharded_strategy=get_default_save_sharded_strategy("torch_dist")))
        # dist_checkpointing.save ends with a barrier: every rank has written its shards.
        if _first_on_any_rank(failure) is None and dist.get_rank() == 0:
            failure = _attempt(lambda: publish(directory, iteration))
    failure = _first_on_any_rank(failure)
    if failure is not None:
        # The writer passes on a full disk's OSError as a bare RuntimeError (torch.save's "unexpected pos"):
        # the free space, measured before the partial folder goes, tells.
        free = shutil.disk_usage(directory).free if os.path.isdir(directory) else None
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a partial checkpoint is of no use to anyone
        dist.barrier()
        on_disk = "" if free is None else f" ({free} bytes were free on its filesystem)"
        raise CheckpointSaveError(f"saving iteration {iteration} into {staging} failed{on_disk}: {failure}; the "
                                  f"partial folder was removed, {_latest_text(directory)}")
    return iteration_dir(directory, iteration)


def load_checkpoint(
    directory: str,
    models: Mapping[str, Sequence[torch.nn.Module]],
    optimizer: Optional[MegatronOptimizer],
    iteration: Optional[int] = None,
    scheduler: Optional[OptimizerParamScheduler] = None,
    load_rng: bool = True,
) -> tuple[int, Any]:
    """Load a checkpoint into ``models``, ``optimizer`` and ``scheduler``; call it on every rank.

    The parallel layout may differ from the one the checkpoint was saved under:
    weights and optimizer state are resharded. Each rank's RNG states are
    restored only under the same layout (TP, PP, CP, EP, expert-TP and DP sizes)
    and device type; otherwise they are left as they are and a
    :class:`RNGStateNotRestoredWarning` says so.

    Args:
        directory: The run's checkpoint directory.
        models: Model chunks by name, as given to :func:`save_checkpoint`; every
            tensor must be in the checkpoint with the same full shape. The
            checkpoint may hold more (e.g. copies not asked for).
        optimizer: Gets the saved optimizer state (or ``None``: not loaded).
        iteration: The iteration to load; by default the last complete one.
        scheduler: Gets the saved schedule's step count; the schedule itself must be the
            checkpoint's unless the scheduler was built to override it or to take it
            (``--override-opt-param-scheduler``, ``--use-checkpoint-opt-param-scheduler``).
        load_rng: Restore the RNG states (under the same layout); False: every rank keeps its own,
            without a warning (``--no-load-rng``).

    Returns:
        ``(iteration, state)``: the loaded iteration and the ``state`` given to
        :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: no complete checkpoint in ``directory``, or none of ``iteration``.
        ValueError: the checkpoint does not fit: a tensor it lacks or holds with
            another shape (named), no optimizer state or schedule, another schedule; a file
            of it cannot be read (a shard deleted or cut).
        NonFiniteCheckpointError: a tensor read holds a NaN or an Inf (named, checked on
            every rank before anything is loaded into the models or the optimizer).
    """
    if iteration is None:
        iteration = latest_iteration(directory)
        if iteration is None:
            raise FileNotFoundError(f"no checkpoint in {directory}: {TRACKER_FILENAME} is missing"
                                    + ("" if os.path.isdir(directory) else " (the directory does not exist)"))
    path = iteration_dir(directory, iteration)
    if not is_complete(path):
        raise FileNotFoundError(f"no checkpoint of iteration {iteration} in {directory}; complete checkpoints: "
                                f"iterations {complete_iterations(directory)}")
    _check_index(path)
    common = _read(path, lambda: _common_state(path))
    _check_format(path, common)
    for name, wanted in (("optimizer", optimizer), ("opt_param_scheduler", scheduler)):
        if wanted is not None and name not in common:
            raise ValueError(f"{path} holds no {name} state (it was saved without one)")
    if scheduler is not None:
        mismatch = scheduler_mismatch(scheduler, common["opt_param_scheduler"])
        if mismatch is not None:
            raise ValueError(f"{path} does not fit: {mismatch}")

    model_state = _models_sharded_state_dict(models)
    sharded = {"state": _common_object(None), **model_state}
    if optimizer is not None:
        # Only the per-parameter tensors load, into this optimizer's own structure, at the
        # checkpoint's step (checkpoint_optimizer says why).
        prepare_for_load(optimizer, common["optimizer_step"])
        request = optimizer.sharded_state_dict(_policy_state(models, model_state), is_loading=True,
                                               metadata=OPTIMIZER_METADATA)
        sharded["optimizer_tensors"], optimizer_structure = extract_sharded_tensors_or_nonpersistent(request)
    same_ranks = common["parallel_layout"] == parallel_layout() and common["rng_device"] == rng_device()
    if same_ranks and load_rng:
        sharded["rng_state"] = rng_state_object(None)
    _check_tensors_fit(path, sharded)

    loaded = _read(path, lambda: dist_checkpointing.load(sharded, path))
    bad = _first_on_any_rank(non_finite_tensors(loaded_tensors(sharded, loaded)) or None)
    if bad is not None:
        raise NonFiniteCheckpointError(f"{path}: {describe(bad)} holds a NaN or an Inf: the checkpoint is not "
                                       f"loaded (the run that saved it predates this check, or the file changed)")
    for key, (prefix, chunk) in _chunks_by_key(models).items():
        chunk.load_state_dict({name[len(prefix):]: value for name, value in loaded[key].items()})
    if optimizer is not None:
        optimizer.load_state_dict(merge(optimizer_structure, loaded["optimizer_tensors"]))
    if scheduler is not None:
        load_scheduler_state(scheduler, loaded["opt_param_scheduler"])
    if same_ranks and load_rng:
        set_rng_states(loaded["rng_state"])
    elif load_rng:
        warnings.warn(
            f"RNG states not restored from {path}: it was saved under {common['parallel_layout']} on "
            f"{common['rng_device']}, this run is {parallel_layout()} on {rng_device()}; every rank keeps "
            "its current RNG states", RNGStateNotRestoredWarning, stacklevel=2)
    return iteration, loaded["state"]


def checkpoint_flags(directory: str, iteration: int) -> Optional[dict]:
    """The flags the checkpoint of ``iteration`` in ``directory`` was saved with (:func:`save_checkpoint`'s
    ``flags``), or None for one saved without them; reads its common state only, on this process alone.

    Raises:
        CheckpointReadError: the checkpoint's common state cannot be read.
        ValueError: not a megatron_r3 checkpoint of a readable format.
    """
    path = iteration_dir(directory, iteration)
    _check_index(path)
    try:
        common = _common_state(path)
    except (Exception, CheckpointException) as error:  # as _read, without the other ranks
        raise CheckpointReadError(f"{path}: cannot read the checkpoint: {_cause(error)}") from None
    _check_format(path, common)
    return common.get("args")


def _check_index(path: str) -> None:
    if not os.path.isfile(os.path.join(path, ".metadata")):  # torch's reader would log tracebacks looking for it
        raise CheckpointReadError(f"{path}: cannot read the checkpoint: its index of tensors, .metadata, is missing")


def _common_state(path: str) -> dict:
    """The checkpoint's common state (rank 0's objects), read by this process alone."""
    with warnings.catch_warnings():  # torch says it assumes a read by one process: that is the intent
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        return dist_checkpointing.load_common_state_dict(path)


def _check_format(path: str, common: Mapping) -> None:
    if common.get(_FORMAT_KEY) not in _READABLE_FORMATS:
        raise ValueError(f"{path} is not a megatron_r3 checkpoint of format {', '.join(map(str, _READABLE_FORMATS))} "
                         f"({_FORMAT_KEY} is {common.get(_FORMAT_KEY)!r})")


def _chunks_by_key(models: Mapping[str, Sequence[torch.nn.Module]]) -> dict[str, tuple[str, torch.nn.Module]]:
    """Each chunk with its tensor-key prefix, under its state-dict key: ``name`` for a single
    chunk, ``name0``, ``name1``, ... for virtual pipeline stages (Megatron-LM's ``model0``, ...)."""
    out = {}
    for name, chunks in models.items():
        chunks = list(chunks)
        if not chunks:
            raise ValueError(f"models[{name!r}] holds no model chunk")
        prefix = "" if name == "model" else f"{name}."
        for i, chunk in enumerate(chunks):
            key = name if len(chunks) == 1 else f"{name}{i}"
            if key in _RESERVED_KEYS or key in out:
                raise ValueError(f"model name {name!r} collides with the checkpoint key {key!r}")
            out[key] = (prefix, chunk)
    return out


def _models_sharded_state_dict(models: Mapping[str, Sequence[torch.nn.Module]]) -> dict:
    return {key: chunk.sharded_state_dict(prefix=prefix) for key, (prefix, chunk) in _chunks_by_key(models).items()}


def models_sharded_state_dict(models: Mapping[str, Sequence[torch.nn.Module]]) -> dict:
    """The sharded state a checkpoint of ``models`` holds for them (keys as :func:`save_checkpoint` gives them)."""
    return _models_sharded_state_dict(models)


def _policy_state(models: Mapping[str, Sequence[torch.nn.Module]], model_state: dict) -> dict:
    """The sharded state of ``models["model"]``, the chunks the optimizer trains."""
    return {key: model_state[key] for key, (prefix, _) in _chunks_by_key(models).items() if not prefix}


def _common_object(data: Any) -> ShardedObject:
    """One object for all ranks: rank 0's copy is saved, every rank loads it."""
    return ShardedObject("state", data, (1,), (0,), replica_id=dist.get_rank())


def _check_tensors_fit(path: str, sharded: dict) -> None:
    """Every tensor to load is in the checkpoint with the same full shape; raises on every rank otherwise."""
    saved = _read(path, lambda: dist_checkpointing.load_tensors_metadata(path))
    problem = None
    for tensor in nested_values(sharded):
        if not isinstance(tensor, ShardedTensor):
            continue
        if tensor.key not in saved:
            problem = f"the checkpoint has no tensor {tensor.key}"
            if tensor.key.startswith("optimizer."):
                problem += (" (the optimizer that saved it kept other state: distributed or not, fp32 or bf16 "
                            "parameters)")
            break
        if tuple(saved[tensor.key].global_shape) != tuple(tensor.global_shape):
            problem = (f"tensor {tensor.key} has shape {tuple(saved[tensor.key].global_shape)} in the checkpoint, "
                       f"{tuple(tensor.global_shape)} in the model")
            break
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    for rank_problem in gathered:
        if rank_problem is not None:
            raise ValueError(f"{path} does not fit: {rank_problem}")


def _read(path: str, read: Callable[[], Any]) -> Any:
    """``read()`` of the checkpoint ``path`` on every rank, a file it cannot read (a shard or the metadata
    deleted or cut) named in one line on every rank."""
    failure, result = None, None
    try:
        result = read()
    except (Exception, CheckpointException) as error:  # Megatron's and torch's wrappers, OSError, unpickling
        failure = _cause(error)
    failure = _first_on_any_rank(failure)
    if failure is not None:
        raise CheckpointReadError(f"{path}: cannot read the checkpoint: {failure}")
    return result


def _attempt(write) -> Optional[str]:
    """Runs ``write``; None, or what went wrong in one line."""
    try:
        write()
    except (Exception, CheckpointException) as error:  # an OSError, or a checkpoint writer's wrapper of one
        return _cause(error)
    return None


def _cause(error: BaseException) -> str:
    """The innermost error behind ``error`` in one line (an OSError names its file and errno)."""
    while True:
        failures = getattr(error, "failures", None)  # torch's CheckpointException: {rank: (error, traceback)}
        if failures:
            error = next(iter(failures.values()))[0]
        elif error.__cause__ is not None:
            error = error.__cause__
        else:
            break
    return " ".join(f"{type(error).__name__}: {error}".split())


def _first_on_any_rank(problem):
    """The first rank's problem (anything picklable, or None) on every rank; call it on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p is not None), None)


def _latest_text(directory: str) -> str:
    """What the tracker names now, for a message about a save that did not happen."""
    try:
        latest = latest_iteration(directory)
    except ValueError:
        latest = None
    if latest is None:
        return f"{os.path.join(directory, TRACKER_FILENAME)} was not written"
    return f"{os.path.join(directory, TRACKER_FILENAME)} still names iteration {latest}"
