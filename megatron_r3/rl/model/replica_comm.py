"""Collectives among the ranks of one model replica: its tensor-, context- and pipeline-parallel peers.

A model replica is every rank with the same data-parallel rank: together they
hold all layers (PP), all of the vocabulary (TP) and all token positions (CP,
SP) of the microbatches that replica runs. The rollout engine uses these to turn
what each rank computed into what the whole replica needs: the logits of a
sample's last position, sampled tokens, and recorded routes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def sum_over_context_parallel(tensor: torch.Tensor) -> torch.Tensor:
    """Sums ``tensor`` over the context-parallel group, in place (each rank holds its own positions)."""
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(tensor, group=parallel_state.get_context_parallel_group())
    return tensor


def gather_vocab_parallel(tensor: torch.Tensor) -> torch.Tensor:
    """The full vocabulary from each tensor-parallel rank's slice of the last dimension."""
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """Gives every pipeline stage the last stage's ``tensor`` (in place; same shape on every stage)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return tensor


def gather_objects_in_replica(obj: Any) -> list[Any]:
    """Every rank of this replica gets the ``obj`` of every rank of it (TP, then CP, then PP).

    Objects are pickled (``all_gather_object``): meant for small host-side results
    such as recorded routes of a few microbatches, not for activations.
    """
    gathered = [obj]
    for group, size in (
        (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_pipeline_model_parallel_world_size()),
    ):
        if size > 1:
            parts: list[Any] = [None] * size
            dist.all_gather_object(parts, gathered, group=group)
            gathered = [item for part in parts for item in part]
    return gathered


def is_replica_lead() -> bool:
    """True on one rank per replica (first TP, CP and PP rank): where per-replica counts are taken."""
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
        and parallel_state.get_pipeline_model_parallel_rank() == 0
    )
