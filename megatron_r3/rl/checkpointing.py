"""Checkpoints of model chunks, their optimizer, its LR schedule and the run's state, through dist_checkpointing.

Layout on disk, as in Megatron-LM::

    DIR/latest_checkpointed_iteration.txt    the last complete checkpoint's iteration
    DIR/iter_0000010/                        a torch_dist checkpoint (one per saved iteration)

Every rank writes its shards into ``DIR/iter_0000010.saving/``; after all ranks
are done, rank 0 renames it to ``iter_0000010`` and then replaces the tracker
file (a temporary file renamed over it). A run killed during a save leaves the
tracker on the previous complete checkpoint, which is what
:func:`load_checkpoint` then loads.

Weights are saved through each chunk's ``sharded_state_dict()``: tensors are
keyed by their global name (layer and expert numbers global, TP/EP slices as
offsets into the full tensor), so a checkpoint saved under one parallel layout
(TP, SP, PP, VP, CP, EP, DP) loads under any other. The optimizer (Megatron's,
:mod:`megatron_r3.rl.training_stack`) saves itself through its own
``sharded_state_dict()``: Adam's moments (and the distributed optimizer's fp32 main
weights) keyed like the parameter they belong to
(``optimizer.state.exp_avg.<parameter key>``), the distributed optimizer's shards
gathered into that form (Megatron-LM's ``fully_reshardable`` format), so they follow
a layout change too.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import warnings
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_or_nonpersistent
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_r3.rl.training_stack import load_scheduler_state, scheduler_mismatch

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2
_STAGING_SUFFIX = ".saving"
_FORMAT_KEY = "megatron_r3_checkpoint_format"
# Top-level keys of the checkpoint's state dict besides the models'.
_RESERVED_KEYS = frozenset({_FORMAT_KEY, "iteration", "parallel_layout", "rng_device", "state", "rng_state",
                            "optimizer", "optimizer_step", "optimizer_tensors", "opt_param_scheduler"})
# How Megatron's optimizers shape their sharded state (Megatron-LM's metadata for torch_dist): the
# distributed optimizer's in the fully reshardable, per-parameter form; no "chained_<i>." prefixes.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                       "singleton_local_shards": False}


class RNGStateNotRestoredWarning(UserWarning):
    """:func:`load_checkpoint` left this rank's RNG states as they were.

    Per-rank RNG states only map back onto the same ranks: the checkpoint was
    saved under another parallel layout, or on another device type (CUDA vs CPU).
    """


def iteration_dir(directory: str, iteration: int) -> str:
    """The checkpoint directory of ``iteration`` under ``directory`` (``iter_0000010``)."""
    return os.path.join(directory, f"iter_{iteration:07d}")


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration of the last complete checkpoint in ``directory``, or ``None`` if there is none.

    Raises:
        ValueError: the tracker file does not hold an iteration number.
    """
    path = os.path.join(directory, TRACKER_FILENAME)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} should hold an iteration number, not {text!r}") from None


def save_directory_problem(directory: str) -> Optional[str]:
    """Why this process could not write checkpoints into ``directory``, or None when it could.

    Creates and removes a probe file in ``directory``, or, while it does not exist, in the
    nearest folder above it that does (where :func:`save_checkpoint` would create it):
    the check a run makes on every rank before it trains, so that an unwritable
    ``--save`` fails at once rather than at the first save. Nothing is left behind.
    """
    target = os.path.abspath(directory)
    while not os.path.exists(target):
        target = os.path.dirname(target)
    if not os.path.isdir(target):
        return f"{target} is a file, not a folder"
    probe = os.path.join(target, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "x"):
            pass
        os.remove(probe)
    except OSError as error:
        return f"cannot create a file in {target} ({type(error).__name__}: {error.strerror or error})"
    return None


def find_checkpoint(path: str) -> tuple[str, int]:
    """The checkpoint ``path`` names, as ``(run directory, iteration)``.

    ``path`` is a run's checkpoint directory (its latest complete checkpoint, by the tracker
    file) or one iteration folder in it (``DIR/iter_0000010``: that iteration of ``DIR``).

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint yet: it does not exist, or has no
            tracker file (a run that has not saved).
        ValueError: ``path`` is a file; an iteration folder that is not a complete checkpoint
            (naming its run directory and the complete iterations there); a tracker that
            names an iteration whose checkpoint is not complete.
    """
    normal = os.path.normpath(path)
    parent, name = os.path.split(normal)
    if name.startswith("iter_"):
        complete = _complete_iterations(parent)
        iteration = int(name[5:]) if name[5:].isdigit() else None
        if iteration in complete and normal == os.path.normpath(iteration_dir(parent, iteration)):
            return parent, iteration
        raise ValueError(f"{path} is not a complete checkpoint; its run's checkpoint directory is {parent or '.'} "
                         f"(complete iterations there: {complete})")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint in {path}: the directory does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a checkpoint directory")
    iteration = latest_iteration(path)
    if iteration is None:
        complete = _complete_iterations(path)
        raise FileNotFoundError(f"no checkpoint in {path}: it has no {TRACKER_FILENAME}"
                                + (f" (complete iterations {complete} are there: name one, e.g. "
                                   f"{iteration_dir(path, complete[-1])})" if complete else ""))
    if not _is_complete(iteration_dir(path, iteration)):
        raise ValueError(f"{os.path.join(path, TRACKER_FILENAME)} names iteration {iteration}, whose checkpoint is "
                         f"not complete (complete iterations: {_complete_iterations(path)})")
    return path, iteration


def save_checkpoint(
    directory: str,
    iteration: int,
    models: Mapping[str, Sequence[torch.nn.Module]],
    optimizer: Optional[MegatronOptimizer],
    state: Any,
    scheduler: Optional[OptimizerParamScheduler] = None,
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

    Returns:
        The directory of the checkpoint.

    Raises:
        ValueError: a bad iteration or model name.
    """
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, not {iteration!r}")
    model_state = _models_sharded_state_dict(models)
    sharded = {
        _FORMAT_KEY: FORMAT_VERSION,
        "iteration": iteration,
        "parallel_layout": _parallel_layout(),
        "rng_device": _rng_device(),
        "state": _common_object(state),
        "rng_state": _rank_object("rng_state", _rng_states()),
        **model_state,
    }
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(_policy_state(models, model_state),
                                                            metadata=_OPTIMIZER_METADATA)
        sharded["optimizer_step"] = _adam_step(optimizer)
    if scheduler is not None:
        sharded["opt_param_scheduler"] = scheduler.state_dict()

    final = iteration_dir(directory, iteration)
    staging = final + _STAGING_SUFFIX
    if dist.get_rank() == 0:
        # A leftover of an interrupted save of this iteration is incomplete: start afresh.
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    # Synchronous and not fully parallel: every rank writes its main replicas itself.
    dist_checkpointing.save(sharded, staging, sharded_strategy=get_default_save_sharded_strategy("torch_dist"))

    # dist_checkpointing.save ends with a barrier: every rank has written its shards.
    if dist.get_rank() == 0:
        _publish(directory, iteration, staging, final)
    dist.barrier()
    return final


def load_checkpoint(
    directory: str,
    models: Mapping[str, Sequence[torch.nn.Module]],
    optimizer: Optional[MegatronOptimizer],
    iteration: Optional[int] = None,
    scheduler: Optional[OptimizerParamScheduler] = None,
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

    Returns:
        ``(iteration, state)``: the loaded iteration and the ``state`` given to
        :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: no complete checkpoint in ``directory``, or none of ``iteration``.
        ValueError: the checkpoint does not fit: a tensor it lacks or holds with
            another shape (named), no optimizer state or schedule, another schedule.
    """
    if iteration is None:
        iteration = latest_iteration(directory)
        if iteration is None:
            raise FileNotFoundError(f"no checkpoint in {directory}: {TRACKER_FILENAME} is missing"
                                    + ("" if os.path.isdir(directory) else " (the directory does not exist)"))
    path = iteration_dir(directory, iteration)
    if not _is_complete(path):
        raise FileNotFoundError(f"no checkpoint of iteration {iteration} in {directory}; complete checkpoints: "
                                f"iterations {_complete_iterations(directory)}")
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get(_FORMAT_KEY) != FORMAT_VERSION:
        raise ValueError(f"{path} is not a megatron_r3 checkpoint of format {FORMAT_VERSION} "
                         f"({_FORMAT_KEY} is {common.get(_FORMAT_KEY)!r})")
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
        # Megatron's optimizers keep their parameter groups and Adam's step per member of the
        # ChainedOptimizer, a split that follows the layout (experts get an optimizer of their own
        # only under EP > 1 or expert-TP != TP), so that part of "optimizer" loads only under a
        # layout that splits the same way. The per-parameter tensors are keyed by parameter: this
        # optimizer loads those into its own structure, keeps its parameter groups (the flags';
        # the scheduler sets the rate) and takes the checkpoint's step.
        _prepare_for_load(optimizer, common["optimizer_step"])
        request = optimizer.sharded_state_dict(_policy_state(models, model_state), is_loading=True,
                                               metadata=_OPTIMIZER_METADATA)
        sharded["optimizer_tensors"], optimizer_structure = extract_sharded_tensors_or_nonpersistent(request)
    same_ranks = common["parallel_layout"] == _parallel_layout() and common["rng_device"] == _rng_device()
    if same_ranks:
        sharded["rng_state"] = _rank_object("rng_state", None)
    _check_tensors_fit(path, sharded)

    loaded = dist_checkpointing.load(sharded, path)
    for key, (prefix, chunk) in _chunks_by_key(models).items():
        chunk.load_state_dict({name[len(prefix):]: value for name, value in loaded[key].items()})
    if optimizer is not None:
        optimizer.load_state_dict(merge(optimizer_structure, loaded["optimizer_tensors"]))
    if scheduler is not None:
        load_scheduler_state(scheduler, loaded["opt_param_scheduler"])
    if same_ranks:
        _set_rng_states(loaded["rng_state"])
    else:
        warnings.warn(
            f"RNG states not restored from {path}: it was saved under {common['parallel_layout']} on "
            f"{common['rng_device']}, this run is {_parallel_layout()} on {_rng_device()}; every rank keeps "
            "its current RNG states", RNGStateNotRestoredWarning, stacklevel=2)
    return iteration, loaded["state"]


def _publish(directory: str, iteration: int, staging: str, final: str) -> None:
    """Rank 0, once every rank has written: the checkpoint takes its name, then the tracker points to it."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(staging, final)
    tracker = os.path.join(directory, TRACKER_FILENAME)
    temporary = tracker + ".tmp"
    with open(temporary, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, tracker)


def _is_complete(path: str) -> bool:
    # dist_checkpointing writes metadata.json last, after every rank's shards.
    return os.path.isfile(os.path.join(path, "metadata.json"))


def _complete_iterations(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        if name.startswith("iter_") and name[5:].isdigit() and _is_complete(os.path.join(directory, name)):
            found.append(int(name[5:]))
    return sorted(found)


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


def _policy_state(models: Mapping[str, Sequence[torch.nn.Module]], model_state: dict) -> dict:
    """The sharded state of ``models["model"]``, the chunks the optimizer trains."""
    return {key: model_state[key] for key, (prefix, _) in _chunks_by_key(models).items() if not prefix}


def _adam_step(optimizer: MegatronOptimizer) -> int:
    """The steps Adam has taken (the same for every parameter: every one gets a gradient each step)."""
    steps = set()
    for inner in _inner_optimizers(optimizer):
        if isinstance(inner, torch.optim.Adam):  # torch.optim keeps the count per parameter
            steps |= {int(state["step"]) for state in inner.state.values() if "step" in state}
        else:  # TransformerEngine's and Apex's FusedAdam per group
            steps |= {int(group["step"]) for group in inner.param_groups if "step" in group}
    if len(steps) > 1:
        raise ValueError(f"cannot save the optimizer: its parameters are at different steps {sorted(steps)}")
    return steps.pop() if steps else 0


def _prepare_for_load(optimizer: MegatronOptimizer, step: int) -> None:
    """Allocates the optimizer's state as Megatron does before a load, with Adam at ``step``: the
    load request then carries the step where each of Megatron's optimizers keeps it."""
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    for member in members:
        if member.optimizer is not None:
            member.init_state_fn(member.optimizer, member.config)
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if not isinstance(inner, torch.optim.Adam):
                group["step"] = step
                continue
            for param in group["params"]:
                inner.state[param]["step"] = torch.tensor(float(step))


def _inner_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (one per member of its ChainedOptimizer that has parameters)."""
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    return [member.optimizer for member in members if member.optimizer is not None]


def _parallel_layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "etp": parallel_state.get_expert_tensor_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def _common_object(data: Any) -> ShardedObject:
    """One object for all ranks: rank 0's copy is saved, every rank loads it."""
    return ShardedObject("state", data, (1,), (0,), replica_id=dist.get_rank())


def _rank_object(key: str, data: Any) -> ShardedObject:
    """One object per rank, at the rank's (pp, tp, cp, dp) coordinates (the layout fixes its EP rank)."""
    shape = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
    )
    offset = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    return ShardedObject(key, data, shape, offset, replica_id=0)


def _rng_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rng_states() -> dict:
    states = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def _check_tensors_fit(path: str, sharded: dict) -> None:
    """Every tensor to load is in the checkpoint with the same full shape; raises on every rank otherwise."""
    saved = dist_checkpointing.load_tensors_metadata(path)
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
