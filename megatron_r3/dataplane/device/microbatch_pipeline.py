"""One pipeline from an iteration's samples to what each forward step feeds the model.

Every pass of the loop (the rollout engine's generation and recording passes, the
trainer's R2 old-log-prob, comparison and update passes, the step and loop
benchmarks) takes its microbatches from here. For microbatch ``i`` it

1. packs the samples into this rank's THD row
   (:func:`~megatron_r3.dataplane.device.microbatches.pack_rollout_microbatch`), with the mask of
   the positions no loss can see;
2. builds the routing plan of each of the rank's model chunks;
3. for a pass that replays the rollout's routes: gives every dead route-less position,
   and the row's padding, a filler route (:mod:`megatron_r3.dataplane.device.filler_routes`), uploads the
   routes of all chunks at once (:class:`~megatron_r3.dataplane.device.transport.RouteUploader`) and, when
   every token of every rank of the expert tensor-and-model-parallel group then has a
   route, exchanges the host token counts (:mod:`megatron_r3.dataplane.device.expert_counts`): the
   alltoall dispatcher takes its split sizes from them, with no device sync;
4. for a pass that replays recorded routes (R2), hands them out per chunk.

Microbatch ``i + 1`` is prepared while the device runs microbatch ``i``: the schedules
call the prefetch hook once a forward is issued (:mod:`megatron_r3.dataplane.device.prefetch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from megatron_r3.dataplane.device.expert_counts import ExpertCountExchange, local_expert_counts
from megatron_r3.dataplane.device.filler_routes import filler_expert_ids, with_fillers
from megatron_r3.dataplane.device.microbatches import RolloutMicrobatch, RowLayout, pack_rollout_microbatch
from megatron_r3.dataplane.device.prefetch import PreparedMicrobatches
from megatron_r3.dataplane.device.transport import PackedRoutes, RouteUploader
from megatron_r3.dataplane.routes import RolloutRoutes, concat_routes
from megatron_r3.dataplane.samples import RoutingSpec
from megatron_r3.dataplane.samples import RolloutSample


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
    """Prepares the microbatches of one pass, one ahead, for all of this rank's model chunks.

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

    def prepare(
        self,
        samples: Sequence[RolloutSample],
        advantages: Optional[Sequence[float]] = None,
        *,
        rollout_routes: bool = False,
        recorded: Optional[Sequence[Sequence[PackedRoutes]]] = None,
        fillers: bool = True,
        then: Optional[Callable[[list[PassItem]], None]] = None,
    ) -> PreparedMicrobatches:
        """The pass's microbatches, ``rows.micro_batch_size`` samples each, as chunk data iterators.

        Args:
            samples: This rank's samples, in order.
            advantages: One per sample, for the update pass.
            rollout_routes: Replay the samples' routes (R3), with fillers where no loss sees.
            recorded: Per microbatch and chunk, recorded routes to replay (R2).
            fillers: With ``rollout_routes``, give the positions no loss can see filler routes;
                False routes them live (the microbatch then takes Megatron's device path).
            then: Called with each microbatch's items once they are prepared (the step
                benchmark hands the routes to upstream ``RouterReplay`` this way).
        """
        size = self.rows.micro_batch_size
        if len(samples) % size:
            raise ValueError(f"{len(samples)} samples do not make whole microbatches of --micro-batch-size {size}")
        groups = [list(range(i, i + size)) for i in range(0, len(samples), size)]
        if recorded is not None and len(recorded) != len(groups):
            raise ValueError(f"recorded routes for {len(recorded)} microbatches, the pass has {len(groups)}")

        def prepare(index: int) -> list[PassItem]:
            items = prepare_items(index)
            if then is not None:
                then(items)
            return items

        def prepare_items(index: int) -> list[PassItem]:
            members = groups[index]
            batch = pack_rollout_microbatch([samples[i] for i in members], self.rows.rank, self.rows.seq_length,
                                            self.rows.device,
                                            None if advantages is None else [advantages[i] for i in members])
            if recorded is not None:
                return [PassItem(index, batch, routes) for routes in recorded[index]]
            if not rollout_routes:
                return [PassItem(index, batch) for _ in range(self.num_chunks)]
            return self._with_rollout_routes(index, batch, [samples[i] for i in members], fillers)

        return PreparedMicrobatches(len(groups), prepare, self.num_chunks, self.rows.seq_length)

    def _with_rollout_routes(self, index: int, batch: RolloutMicrobatch,
                             samples: Sequence[RolloutSample], fillers: bool) -> list[PassItem]:
        spec = self.spec
        routes, next_filler = [self._routes_of(s) for s in samples], 0
        if fillers:
            routes, next_filler = with_fillers(routes, [s.loss_mask for s in samples])
        plans = self.rows.plans(batch, spec.model_moe_layers)
        padding = plans[0].num_padding_rows
        if padding and fillers:  # the row's padding reads filler routes appended to the source
            ids = filler_expert_ids(padding, next_filler, len(spec.model_moe_layers), spec.topk, spec.num_experts,
                                    routes[0].ids.dtype)
            routes.append(RolloutRoutes(ids, np.ones(padding, dtype=bool), spec.num_experts,
                                        tuple(spec.model_moe_layers)))
            plans = [plan.with_padding_rows() for plan in plans]
        packed = self.uploader.upload(routes, plans)
        source_ids, source_valid = concat_routes(routes)
        counts = [None] * len(plans)
        if self.exchange is not None:
            local = [local_expert_counts(source_ids, source_valid, plan, spec.num_experts) for plan in plans]
            counts = self.exchange.gather(local, [plan.num_local_layers for plan in plans])
        filler = _filler_source_rows(samples, routes)
        return [PassItem(index, batch, chunk_routes, chunk_counts, filler[plan.token_index])
                for chunk_routes, chunk_counts, plan in zip(packed, counts, plans)]

    def _routes_of(self, sample: RolloutSample) -> RolloutRoutes:
        """A sample's routes; a sample without any has none, token by token."""
        if sample.routes is not None:
            return sample.routes
        spec = self.spec
        return RolloutRoutes.empty(len(sample.token_ids), num_experts=spec.num_experts, topk=spec.topk,
                                   layer_numbers=spec.model_moe_layers)


def _filler_source_rows(samples: Sequence[RolloutSample], filled: Sequence[RolloutRoutes]) -> np.ndarray:
    """bool per packing-source row: the row's route is a filler (it had no engine route)."""
    original = [s.routes.valid if s.routes is not None else np.zeros(len(s.token_ids), bool) for s in samples]
    rows = [~valid for valid in original]
    rows += [np.ones(r.num_tokens, bool) for r in filled[len(samples):]]  # the padding's
    return np.concatenate(rows)
