"""Tokens per expert known on the host: the alltoall dispatcher's split sizes without a device sync.

Under routing replay with a route for every token, how many tokens each rank sends
to each expert at each MoE layer follows from the routes, which the trainer holds on
the host before the forward. Megatron's alltoall dispatcher needs those counts for
every rank of its expert tensor-and-model-parallel group (``tp_ep``): its own for the
input splits, the others' for the output splits. :func:`local_expert_counts` counts
this rank's tokens from the compact host routes and the microbatch's
:class:`~megatron_r3.dataplane.device.plan.RoutingPlan`; :class:`ExpertCountExchange` gathers every
rank's counts, for all MoE layers of all model chunks and all microbatches of a batch
at once, with one small collective per batch on a CPU (gloo) group. The result goes to the model as
``MoERouting.host_tokens_per_expert`` (patch "moe: the alltoall dispatcher takes split
sizes from host token counts under replay"), and the MoE layers then neither copy to
the host nor wait for the device.

A token without a route (padding, the last sampled token, a capture gap) is routed
live, so only the device knows where it goes: a microbatch with such a token on any
rank of the group gets no host counts and takes Megatron's own path, as before.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_r3.dataplane.device.plan import RoutingPlan


def local_expert_counts(
    ids: np.ndarray, valid: np.ndarray, plan: RoutingPlan, num_experts: int
) -> Optional[np.ndarray]:
    """This rank's tokens per expert at each MoE layer of one model chunk.

    Args:
        ids: The packing source ``[N, L, K]`` (:func:`megatron_r3.dataplane.routes.concat_routes`).
        valid: ``[N]``, False for tokens without a route.
        plan: The chunk's plan for this microbatch.
        num_experts: Routed experts per MoE layer.

    Returns:
        int64 ``[plan.num_local_layers, num_experts]``, or None when a token this rank
        routes has no route (padding or an invalid token): it will be routed live.
    """
    rows = plan.token_index
    if (rows < 0).any() or not valid[rows].all():
        return None
    # Counts do not depend on the tokens' order: where the rank routes every source token once
    # (no CP or SP split), the source is counted as it is, without gathering it first.
    whole = len(rows) == len(ids) and bool((np.bincount(rows, minlength=len(ids)) == 1).all())
    source = ids if whole else ids[rows]
    counts = [np.bincount(source[:, layer].reshape(-1), minlength=num_experts) for layer in plan.layer_index]
    return np.stack(counts).astype(np.int64) if counts else np.zeros((0, num_experts), np.int64)


def gloo_group_like(group: dist.ProcessGroup) -> Optional[dist.ProcessGroup]:
    """A CPU (gloo) process group with the same ranks as ``group``, in the same rank order.

    Every rank of the default group must call this together: process groups are created
    collectively, so each rank learns every rank's group and all create them in one order.
    Returns None for a group of one rank (nothing to exchange).
    """
    mine = tuple(dist.get_process_group_ranks(group))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result = None
    for ranks in sorted(set(everyone)):
        created = dist.new_group(list(ranks), backend="gloo")
        if ranks == mine:
            result = created
    return result if len(mine) > 1 else None


class ExpertCountExchange:
    """Gathers host token counts over the expert tensor-and-model-parallel group.

    Args:
        tp_ep_group: Megatron's expert tensor-and-model-parallel group
            (``parallel_state.get_expert_tensor_and_model_parallel_group()``), whose rank
            order the dispatcher's counts follow. Construction is collective over the
            default group (see :func:`gloo_group_like`).
        num_experts: Routed experts per MoE layer.
    """

    def __init__(self, tp_ep_group: dist.ProcessGroup, num_experts: int):
        self.size = dist.get_world_size(tp_ep_group)
        self.num_experts = num_experts
        self._group = gloo_group_like(tp_ep_group)

    def gather(self, local: Sequence[Optional[np.ndarray]], num_layers: Sequence[int]) -> list:
        """Every rank's counts for one microbatch, per model chunk: :meth:`gather_batch` of one microbatch."""
        return self.gather_batch([local], num_layers)[0]

    def gather_batch(self, local: Sequence[Sequence[Optional[np.ndarray]]], num_layers: Sequence[int]) -> list:
        """Every rank's counts for several microbatches at once, per microbatch and model chunk.

        Collective over the group: every rank calls it with the same number of microbatches, in
        the same order (one all-gather of a few integers per MoE layer and microbatch).

        Args:
            local: Per microbatch, this rank's ``[L_chunk, num_experts]`` counts per chunk
                (:func:`local_expert_counts`), None where it has none.
            num_layers: MoE layers of each chunk (``plan.num_local_layers``): the
                message has the same size on every rank, with or without counts.

        Returns:
            Per microbatch, per chunk, int64 CPU ``[group_size, L_chunk, num_experts]`` (the
            ``MoERouting.host_tokens_per_expert`` of that chunk), or all None for a microbatch
            where some rank lacks them.
        """
        shapes = [(n, self.num_experts) for n in num_layers]
        complete = [all(c is not None for c in chunks) for chunks in local]
        if self.size == 1:
            return [[torch.from_numpy(c)[None] if whole else None for c in chunks]
                    for chunks, whole in zip(local, complete)]
        # One flat message of the same size on every rank: per microbatch [complete, counts of each chunk].
        width = 1 + sum(a * b for a, b in shapes)
        message = torch.zeros(len(local), width, dtype=torch.int64)
        for row, (chunks, whole) in zip(message, zip(local, complete)):
            if whole:
                row[0] = 1
                row[1:] = torch.from_numpy(np.concatenate([c.reshape(-1) for c in chunks]))
        parts = [torch.empty_like(message) for _ in range(self.size)]
        dist.all_gather(parts, message, group=self._group)
        gathered = torch.stack(parts, dim=1)  # [microbatch, rank, width]
        out = []
        for per_rank, chunks in zip(gathered, local):
            if not bool(per_rank[:, 0].all()):
                out.append([None] * len(chunks))  # some rank routes a token live
                continue
            per_chunk, start = [], 1
            for shape in shapes:
                n = shape[0] * shape[1]
                per_chunk.append(per_rank[:, start:start + n].reshape(self.size, *shape).contiguous())
                start += n
            out.append(per_chunk)
        return out
