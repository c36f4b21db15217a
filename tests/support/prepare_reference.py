"""The host's microbatch preparation as it was before the batch plan: a reference for tests and benchmarks.

Until commit cd9be66 the microbatch pipeline prepared each microbatch inside the pass, one
microbatch ahead: it packed the row sample by sample, placed the context-parallel tokens
with the device placement (``zigzag_placement``, torch on the host) once for the row and
once more for the routing plan, counted the host token counts layer by layer and handed
every field to the device with its own pinned copy. :func:`reference_items` is that
preparation, kept here unchanged in what it computes, so that tests prove the batch plan
(:mod:`megatron_r3.dataplane.device.batch_plan`) gives exactly the same microbatches, and
the host benchmark (``bench.host_prepare``) times both side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_r3.dataplane.device.filler_routes import filler_expert_ids, first_dead_position, with_fillers
from megatron_r3.dataplane.device.microbatches import RolloutMicrobatch, RowLayout, padded_thd_params
from megatron_r3.dataplane.device.packing import gather_routes
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan, padded_lengths
from megatron_r3.dataplane.routes import RolloutRoutes, concat_routes, layer_index
from megatron_r3.dataplane.samples import RolloutSample, RoutingSpec
from megatron_r3.layers.context_parallel import zigzag_placement
from megatron_r3.layers.moe_layers import chunk_layers, chunk_vp_stages


@dataclass
class ReferenceItem:
    """What the old pipeline handed one chunk's forward step (``PassItem`` without its device routes'
    event), with the chunk's host counts before the exchange."""

    batch: RolloutMicrobatch
    expert_ids: Optional[torch.Tensor]
    layer_numbers: Optional[tuple]
    every_token_routed: Optional[bool]
    local_counts: Optional[np.ndarray]
    filler_rows: Optional[np.ndarray]
    token_index: Optional[np.ndarray]


def pack_rollout_microbatch(samples: Sequence[RolloutSample], rank: RankLayout, seq_length: int,
                            advantages: Optional[Sequence[float]] = None) -> RolloutMicrobatch:
    """The old row packing: sample by sample into full-row arrays, then the CP rank's tokens picked (on CPU)."""
    lens = [len(s.token_ids) for s in samples]
    padded = padded_lengths(lens, rank)
    padded[-1] += seq_length - padded.sum()
    row = {name: np.zeros(seq_length, dtype) for name, dtype in
           (("tokens", np.int64), ("labels", np.int64), ("loss_mask", np.float32), ("logprobs", np.float32),
            ("advantages", np.float32), ("dead", np.bool_))}
    start = 0
    for i, (sample, length, width) in enumerate(zip(samples, lens, padded)):
        row["dead"][start + first_dead_position(sample.loss_mask):start + int(width)] = True
        row["tokens"][start:start + length] = sample.token_ids
        row["labels"][start:start + length - 1] = sample.token_ids[1:]
        row["loss_mask"][start:start + length - 1] = sample.loss_mask[1:]
        if sample.logprobs is not None:
            row["logprobs"][start:start + length - 1] = sample.logprobs[1:]
        if advantages is not None:
            row["advantages"][start:start + length - 1] = advantages[i] * sample.loss_mask[1:]
        start += int(width)
    cu_padded = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32)
    index, _, position = zigzag_placement(cu_padded, rank.cp_size, rank.cp_rank, seq_length // rank.cp_size)

    def local(name):
        return torch.from_numpy(row[name])[index].unsqueeze(0)

    return RolloutMicrobatch(
        tokens=local("tokens"), labels=local("labels"), loss_mask=local("loss_mask"),
        rollout_logprobs=local("logprobs"), advantages=local("advantages"), dead_mask=local("dead"),
        position_ids=position.unsqueeze(0), row_index=index.to(torch.int64),
        packed_seq_params=padded_thd_params(cu_padded, int(padded.max())),
        sample_lens=lens, padded_lens=[int(p) for p in padded], seq_length=seq_length,
    )


def thd_token_index(sample_lens: Sequence[int], rank: RankLayout, padded_lens: Sequence[int]) -> np.ndarray:
    """The old plan's router-order source rows: the device placement run on the host, then the SP slice."""
    lens = np.asarray(sample_lens, dtype=np.int64)
    padded = np.asarray(padded_lens, dtype=np.int64)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(padded, dtype=np.int64)]))
    placement = zigzag_placement(cu, rank.cp_size, rank.cp_rank, int(cu[-1]) // rank.cp_size)
    seq, pos = placement.seq_id.numpy(), placement.position.numpy()
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    rows = np.where(pos < lens[seq], offsets[seq] + pos, -1)
    n = len(rows) // rank.sp_size
    return np.ascontiguousarray(rows[rank.sp_rank * n:(rank.sp_rank + 1) * n], dtype=np.int32)


def chunk_plans(rows: RowLayout, batch: RolloutMicrobatch, source_layers: Sequence[int]) -> list[RoutingPlan]:
    """The old plans: the token placement computed again for every chunk."""
    plans = []
    for stage in chunk_vp_stages(rows.config):
        rank = replace(rows.rank, vp_stage=stage)
        built = chunk_layers(rows.config, rank.pp_rank, rank.vp_stage, hybrid_layer_pattern=rows.hybrid_layer_pattern)
        layers = [n for n in source_layers if n in built]
        plans.append(RoutingPlan(thd_token_index(batch.sample_lens, rank, batch.padded_lens),
                                 layer_index(source_layers, layers), tuple(int(n) for n in layers),
                                 int(np.sum(batch.sample_lens)), len(source_layers)))
    return plans


def local_expert_counts(ids: np.ndarray, valid: np.ndarray, plan: RoutingPlan, num_experts: int):
    """The old host counts: one bincount per MoE layer."""
    rows = plan.token_index
    if (rows < 0).any() or not valid[rows].all():
        return None
    counts = np.empty((plan.num_local_layers, num_experts), dtype=np.int64)
    for i, layer in enumerate(plan.layer_index):
        counts[i] = np.bincount(ids[rows, layer].reshape(-1), minlength=num_experts)
    return counts


def reference_items(samples: Sequence[RolloutSample], advantages: Optional[Sequence[float]], rows: RowLayout,
                    spec: RoutingSpec, *, rollout_routes: bool = False, fillers: bool = True,
                    counts: bool = False) -> list[list[ReferenceItem]]:
    """Per microbatch and chunk, what the old pipeline prepared (on CPU; ``counts``: also the host counts)."""
    size = rows.micro_batch_size
    out = []
    for start in range(0, len(samples), size):
        members = list(range(start, start + size))
        group = [samples[i] for i in members]
        batch = pack_rollout_microbatch(group, rows.rank, rows.seq_length,
                                        None if advantages is None else [advantages[i] for i in members])
        plans = chunk_plans(rows, batch, spec.model_moe_layers)
        if not rollout_routes:
            out.append([ReferenceItem(batch, None, None, None, None, None, None) for _ in plans])
            continue
        routes = [s.routes if s.routes is not None else RolloutRoutes.empty(
            len(s.token_ids), num_experts=spec.num_experts, topk=spec.topk, layer_numbers=spec.model_moe_layers)
            for s in group]
        next_filler = 0
        if fillers:
            routes, next_filler = with_fillers(routes, [s.loss_mask for s in group])
        padding = plans[0].num_padding_rows
        if padding and fillers:
            ids = filler_expert_ids(padding, next_filler, len(spec.model_moe_layers), spec.topk, spec.num_experts,
                                    routes[0].ids.dtype)
            routes.append(RolloutRoutes(ids, np.ones(padding, dtype=bool), spec.num_experts,
                                        tuple(spec.model_moe_layers)))
            plans = [plan.with_padding_rows() for plan in plans]
        source_ids, source_valid = concat_routes(routes)
        original = [s.routes.valid if s.routes is not None else np.zeros(len(s.token_ids), bool) for s in group]
        filler = np.concatenate([~v for v in original] + [np.ones(r.num_tokens, bool) for r in routes[len(group):]])
        items = []
        for plan in plans:
            complete = bool((plan.token_index >= 0).all() and source_valid[plan.token_index].all())
            expert_ids = gather_routes(torch.from_numpy(np.ascontiguousarray(source_ids)),
                                       torch.from_numpy(source_valid), torch.from_numpy(plan.token_index),
                                       torch.from_numpy(plan.layer_index))
            local = local_expert_counts(source_ids, source_valid, plan, spec.num_experts) if counts else None
            items.append(ReferenceItem(batch, expert_ids, plan.layer_numbers, complete, local,
                                       filler[plan.token_index], plan.token_index))
        out.append(items)
    return out
