"""Megatron's optimizer in a checkpoint: the form of its sharded state, and Adam's step count.

Megatron's optimizers keep their parameter groups and Adam's step per member of the
ChainedOptimizer, a split that follows the layout (experts get an optimizer of their own
only under EP > 1 or expert-TP != TP), so that part of their state loads only under a
layout that splits the same way. A checkpoint therefore holds the per-parameter tensors,
keyed by parameter, and Adam's step once (:func:`adam_step`); a load allocates the
optimizer's state with that step (:func:`prepare_for_load`) and keeps the optimizer's own
parameter groups (the flags'; the scheduler sets the rate).
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import MegatronOptimizer

# How Megatron's optimizers shape their sharded state (Megatron-LM's metadata for torch_dist): the
# distributed optimizer's in the fully reshardable, per-parameter form; no "chained_<i>." prefixes.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                      "singleton_local_shards": False}


def adam_step(optimizer: MegatronOptimizer) -> int:
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


def prepare_for_load(optimizer: MegatronOptimizer, step: int) -> None:
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
