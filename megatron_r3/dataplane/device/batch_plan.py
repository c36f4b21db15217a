"""A batch's host work, done once before its passes: rows, routing plans, fillers, staged routes, host counts.

Every pass over a batch runs the same rows: the trainer's comparison, old-log-prob (R2) and
update passes, the rollout engine's recording pass, the step benchmark's repeated passes.
What the host computes for those rows is computed here, once per batch and before the
first pass, vectorised over each microbatch's tokens (numpy; no Python loop over tokens):

1. each microbatch's THD row on this rank, with its context-parallel placement computed
   once and shared by the row and the routing plans of every model chunk
   (:func:`~megatron_r3.dataplane.device.microbatches.pack_rollout_row`), staged in one host
   buffer;
2. for passes that replay the rollout's routes: the filler routes of the positions no loss
   can see and of the row's padding (:mod:`megatron_r3.dataplane.device.filler_routes`), the
   routes and plans staged in one host buffer (:func:`~megatron_r3.dataplane.device.transport.stage_routes`),
   and the host token counts of the expert tensor-and-model-parallel group
   (:mod:`megatron_r3.dataplane.device.expert_counts`), exchanged for all microbatches in one
   collective.

A pass then only copies each microbatch's two buffers to the device and gathers its routes
there (:class:`~megatron_r3.dataplane.device.microbatch_pipeline.MicrobatchPipeline`). Buffers are
pinned when the rows go to a GPU, so those copies are asynchronous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange, local_expert_counts
from megatron_r3.dataplane.device.filler_routes import filler_expert_ids, with_fillers
from megatron_r3.dataplane.device.microbatches import HostRow, RowLayout, pack_rollout_row
from megatron_r3.dataplane.device.plan import RoutingPlan
from megatron_r3.dataplane.device.transport import StagedRoutes, stage_routes
from megatron_r3.dataplane.routes import RolloutRoutes
from megatron_r3.dataplane.samples import RolloutSample, RoutingSpec


@dataclass
class HostRoutes:
    """One microbatch's rollout routes to replay, staged on the host.

    Attributes:
        staged: The routes (fillers included) and every chunk's plan (with the row's padding
            reading the padding's filler rows, when there are fillers).
        host_tokens_per_expert: Per chunk, the group's host token counts (the dispatcher's
            split sizes), or None.
        filler_rows: Per chunk, bool ``[n_local]`` in router order: True where the route is
            a filler (the engine gave none); False at padding that has no route.
    """

    staged: StagedRoutes
    host_tokens_per_expert: list[Optional[torch.Tensor]]
    filler_rows: list[np.ndarray]


@dataclass
class HostMicrobatch:
    """One microbatch of a batch on this rank, as the host prepares it.

    Attributes:
        index: Its index in the pass.
        members: The indices of its samples in the batch.
        row: This rank's row.
        plans: Each model chunk's routing plan (no filler rows).
    """

    index: int
    members: list[int]
    row: HostRow
    plans: list[RoutingPlan]


class PlannedBatch:
    """A batch's microbatches, prepared on the host once for every pass over them.

    Build it with :meth:`MicrobatchPipeline.plan <megatron_r3.dataplane.device.microbatch_pipeline.MicrobatchPipeline.plan>`.

    Args:
        samples: This rank's samples, in order.
        advantages: One per sample, or None.
        rows: How this rank packs rows.
        spec: The model's MoE layers, experts and top-k.
        exchange: Gathers host token counts over the expert tensor-and-model-parallel group,
            or None.
    """

    def __init__(self, samples: Sequence[RolloutSample], advantages: Optional[Sequence[float]], rows: RowLayout,
                 spec: RoutingSpec, exchange: Optional[ExpertCountExchange] = None):
        size = rows.micro_batch_size
        if len(samples) % size:
            raise ValueError(f"{len(samples)} samples do not make whole microbatches of --micro-batch-size {size}")
        if advantages is not None and len(advantages) != len(samples):
            raise ValueError(f"{len(advantages)} advantages for {len(samples)} samples")
        self.samples = list(samples)
        self.advantages = advantages
        self.rows = rows
        self.spec = spec
        self.exchange = exchange
        self.pinned = rows.device.type == "cuda"
        self.microbatches = []
        for index, first in enumerate(range(0, len(samples), size)):
            members = list(range(first, first + size))
            row = pack_rollout_row([self.samples[i] for i in members], rows.rank, rows.seq_length,
                                   None if advantages is None else [advantages[i] for i in members], self.pinned)
            plans = rows.row_plans(row, spec.model_moe_layers)
            self.microbatches.append(HostMicrobatch(index, members, row, plans))
        self._routes: dict[bool, list[HostRoutes]] = {}

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def rollout_routes(self, fillers: bool) -> list[HostRoutes]:
        """Per microbatch, the samples' routes to replay, staged once per value of ``fillers``.

        Args:
            fillers: Give the positions no loss can see filler routes; False routes them live
                (the microbatch then takes Megatron's device path).

        The first call for a value exchanges host token counts: collective over the expert
        tensor-and-model-parallel group, whose ranks plan their batches in the same order.
        """
        if fillers not in self._routes and self.microbatches:
            staged = [self._stage(mb, fillers) for mb in self.microbatches]
            counts = [[None] * len(mb.plans) for mb in self.microbatches]
            if self.exchange is not None:
                local = [[local_expert_counts(s.ids, s.valid, plan, self.spec.num_experts) for plan in s.plans]
                         for s in staged]
                counts = self.exchange.gather_batch(local, [plan.num_local_layers for plan in
                                                            self.microbatches[0].plans])
            self._routes[fillers] = [HostRoutes(s, c, _filler_rows(self._member_samples(mb), s))
                                     for mb, s, c in zip(self.microbatches, staged, counts)]
        return self._routes.get(fillers, [])

    def _member_samples(self, mb: HostMicrobatch) -> list[RolloutSample]:
        return [self.samples[i] for i in mb.members]

    def _stage(self, mb: HostMicrobatch, fillers: bool) -> StagedRoutes:
        spec = self.spec
        samples = self._member_samples(mb)
        routes = [s.routes if s.routes is not None else RolloutRoutes.empty(
            len(s.token_ids), num_experts=spec.num_experts, topk=spec.topk, layer_numbers=spec.model_moe_layers)
            for s in samples]
        plans = mb.plans
        if fillers:
            routes, next_filler = with_fillers(routes, [s.loss_mask for s in samples])
            padding = plans[0].num_padding_rows
            if padding:  # the row's padding reads filler routes appended to the source
                ids = filler_expert_ids(padding, next_filler, len(spec.model_moe_layers), spec.topk,
                                        spec.num_experts, routes[0].ids.dtype)
                routes.append(RolloutRoutes(ids, np.ones(padding, dtype=bool), spec.num_experts,
                                            tuple(spec.model_moe_layers)))
                plans = [plan.with_padding_rows() for plan in plans]
        return stage_routes(routes, plans, self.pinned)


def _filler_rows(samples: Sequence[RolloutSample], staged: StagedRoutes) -> list[np.ndarray]:
    """Per chunk, in router order: the token's route is a filler (the engine gave it none)."""
    engine = [s.routes.valid if s.routes is not None else np.zeros(len(s.token_ids), bool) for s in samples]
    padding = len(staged.valid) - sum(len(v) for v in engine)
    # Padding that has no route at all (fillers off) reads the last entry: no filler.
    filler = np.concatenate([~v for v in engine] + [np.ones(padding, bool), [False]])
    return [filler[plan.token_index] for plan in staged.plans]
