"""Each rank's RNG states in a checkpoint: saved per rank, restored only onto the same ranks.

Per-rank states map back only under the parallel layout (TP, PP, CP, EP, expert-TP and
DP sizes) and device type they were saved under; :func:`parallel_layout` and
:func:`rng_device` say what a checkpoint must match.
"""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject


class RNGStateNotRestoredWarning(UserWarning):
    """A checkpoint load left this rank's RNG states as they were.

    Per-rank RNG states only map back onto the same ranks: the checkpoint was
    saved under another parallel layout, or on another device type (CUDA vs CPU).
    """


def parallel_layout() -> dict[str, int]:
    """This run's parallel sizes, as a checkpoint records them."""
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "etp": parallel_state.get_expert_tensor_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def rng_device() -> str:
    """The device type whose RNG states :func:`rng_states` holds."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def rng_state_object(states: Optional[dict]) -> ShardedObject:
    """This rank's :func:`rng_states` as one object per rank, at the rank's (pp, tp, cp, dp) coordinates
    (the layout fixes its EP rank); ``None`` asks a load for it."""
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
    return ShardedObject("rng_state", states, shape, offset, replica_id=0)


def rng_states() -> dict:
    """This rank's RNG states: Python, NumPy, torch CPU, CUDA if available, Megatron's RNG tracker."""
    states = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tracker_states(tensor_parallel.get_cuda_rng_tracker()),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    """Restores what :func:`rng_states` returned."""
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    set_tracker_states(tensor_parallel.get_cuda_rng_tracker(), states["tracker"])


def tracker_states(tracker) -> dict[str, torch.Tensor]:
    """Megatron's RNG tracker's states as tensors: a graph-safe tracker (``use_cudagraphable_rng``) holds
    generators, whose states are saved, so that a checkpoint restores under either kind."""
    return {name: state.get_state() if isinstance(state, torch.Generator) else state
            for name, state in tracker.get_states().items()}


def set_tracker_states(tracker, states: dict[str, torch.Tensor]) -> None:
    """Restores :func:`tracker_states` into ``tracker``: a graph-safe one keeps its generators (its graphs
    and forks read them) and takes the states into them."""
    if not tracker.use_cudagraphable_rng:
        tracker.set_states(dict(states))
        return
    generators = tracker.get_states()
    if set(generators) != set(states):
        raise ValueError(f"the checkpoint's RNG tracker states are {sorted(states)}, this run's tracker has "
                         f"{sorted(generators)}")
    for name, state in states.items():
        generators[name].set_state(state)
