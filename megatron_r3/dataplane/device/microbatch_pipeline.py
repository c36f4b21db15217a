"""One pipeline from an iteration's samples to what each forward step feeds the model.

Every pass of the loop (the rollout engine's generation and recording passes, the
trainer's R2 old-log-prob, comparison and update passes, the step and loop
benchmarks) takes its microbatches from here, in two steps:

1. :meth:`MicrobatchPipeline.plan`, once per batch and before its passes, does the host's
   work (:mod:`megatron_r3.dataplane.device.batch_plan`): each microbatch's THD row on this
   rank with the mask of the positions no loss can see, the routing plan of each model chunk
   and, for passes that replay the rollout's routes, the filler routes of every dead
   route-less position and of the row's padding, the routes staged for upload and the host
   token counts of the expert tensor-and-model-parallel group (when every token of every rank
   of the group then has a route, the alltoall dispatcher takes its split sizes from them,
   with no device sync; :mod:`megatron_r3.dataplane.device.expert_counts`);
2. :meth:`MicrobatchPipeline.prepare`, per pass, hands microbatch ``i`` to the schedule:
   one copy of its row to the device, and for a pass that replays routes, one copy of its
   staged routes and a gather per chunk (:class:`~megatron_r3.dataplane.device.transport.RouteUploader`),
   or the recorded routes of a pass that replays them (R2), per chunk.

Microbatch ``i + 1`` is handed over while the device runs microbatch ``i``: the schedules
call the prefetch hook once a forward is issued (:mod:`megatron_r3.dataplane.device.prefetch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from megatron_r3.dataplane.device.batch_plan import PlannedBatch
from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange
from megatron_r3.dataplane.device.microbatches import RolloutMicrobatch, RowLayout
from megatron_r3.dataplane.device.prefetch import PreparedMicrobatches
from megatron_r3.dataplane.device.transport import PackedRoutes, RouteUploader
from megatron_r3.dataplane.samples import RolloutSample, RoutingSpec


@dataclass
class PassItem:
    """What one model chunk's forward step gets for one microbatch.

    Attributes:
        index: The microbatch's index in the pass.
        batch: The packed row (this rank's part).
        routes: This chunk's routes to replay, or None to route live.
        host_tokens_per_expert: The chunk's host token counts (sync-free dispatch), or None.
        filler_rows: With rollout routes: bool ``[n_local]`` in router order, True where the
            route is a filler (no engine route), on the host.
    """

    index: int
    batch: RolloutMicrobatch
    routes: Optional[PackedRoutes] = None
    host_tokens_per_expert: Optional[torch.Tensor] = None
    filler_rows: Optional[np.ndarray] = None


class MicrobatchPipeline:
    """Plans a batch's microbatches once and hands them to each pass, for all of this rank's model chunks.

    Args:
        rows: How this rank packs rows.
        spec: The model's MoE layers, experts and top-k.
        exchange: Gathers host token counts over the expert tensor-and-model-parallel
            group; None keeps every microbatch on Megatron's device path.
    """

    def __init__(self, rows: RowLayout, spec: RoutingSpec, exchange: Optional[ExpertCountExchange] = None):
        self.rows = rows
        self.spec = spec
        self.exchange = exchange
        self.uploader = RouteUploader(rows.device)
        self.num_chunks = rows.num_chunks

    def plan(self, samples: Sequence[RolloutSample], advantages: Optional[Sequence[float]] = None, *,
             rollout_routes: bool = False, fillers: bool = True) -> PlannedBatch:
        """The batch's host work, done now (:mod:`megatron_r3.dataplane.device.batch_plan`).

        Args:
            samples: This rank's samples, in order, ``rows.micro_batch_size`` per microbatch.
            advantages: One per sample, for the update pass.
            rollout_routes: Also stage the samples' routes for passes that replay them (and
                exchange the host token counts: collective over the expert group); a pass
                that replays them stages them on first use otherwise.
            fillers: With ``rollout_routes``, the filler setting of those passes.
        """
        batch = PlannedBatch(samples, advantages, self.rows, self.spec, self.exchange)
        if rollout_routes:
            batch.rollout_routes(fillers)
        return batch

    def prepare(
        self,
        batch: Union[PlannedBatch, Sequence[RolloutSample]],
        advantages: Optional[Sequence[float]] = None,
        *,
        rollout_routes: bool = False,
        recorded: Optional[Sequence[Sequence[PackedRoutes]]] = None,
        fillers: bool = True,
        old_logprobs: Optional[Sequence[torch.Tensor]] = None,
        then: Optional[Callable[[list[PassItem]], None]] = None,
    ) -> PreparedMicrobatches:
        """One pass's microbatches, ``rows.micro_batch_size`` samples each, as chunk data iterators.

        Args:
            batch: The batch, planned (:meth:`plan`), or its samples, planned now.
            advantages: With samples, one per sample, for the update pass.
            rollout_routes: Replay the samples' routes (R3), with fillers where no loss sees.
            recorded: Per microbatch and chunk, recorded routes to replay (R2).
            fillers: With ``rollout_routes``, give the positions no loss can see filler routes;
                False routes them live (the microbatch then takes Megatron's device path).
            old_logprobs: Per microbatch, R2's old log-probs for the update pass's ratio
                (``RolloutMicrobatch.old_logprobs``; the last pipeline stage has them).
            then: Called with each microbatch's items once they are prepared (the step
                benchmark hands the routes to upstream ``RouterReplay`` this way).
        """
        if not isinstance(batch, PlannedBatch):
            batch = self.plan(batch, advantages)
        elif advantages is not None:
            raise ValueError("a planned batch holds its advantages already")
        if recorded is not None and len(recorded) != batch.num_microbatches:
            raise ValueError(f"recorded routes for {len(recorded)} microbatches, the pass has {batch.num_microbatches}")
        routes = batch.rollout_routes(fillers) if rollout_routes and recorded is None else None
        device = self.rows.device

        def prepare(index: int) -> list[PassItem]:
            row = batch.microbatches[index].row.to_device(device)
            if old_logprobs is not None:
                row.old_logprobs = old_logprobs[index]
            if recorded is not None:
                items = [PassItem(index, row, chunk_routes) for chunk_routes in recorded[index]]
            elif routes is None:
                items = [PassItem(index, row) for _ in range(self.num_chunks)]
            else:
                host = routes[index]
                items = [PassItem(index, row, packed, counts, filler)
                         for packed, counts, filler in zip(self.uploader.upload_staged(host.staged),
                                                            host.host_tokens_per_expert, host.filler_rows)]
            if then is not None:
                then(items)
            return items

        return PreparedMicrobatches(batch.num_microbatches, prepare, self.num_chunks, self.rows.seq_length)
