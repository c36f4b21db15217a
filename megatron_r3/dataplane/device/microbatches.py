"""Rollout samples -> one rank's packed (THD) microbatches.

A microbatch is a few rollout samples packed into one row (b = 1). Each sample is
padded to Megatron's alignment (``2*cp``, times ``tp`` under sequence parallelism)
and the last one further, so that the row is exactly ``seq_length`` long: pipeline
stages exchange activations of a fixed shape. This context-parallel rank keeps
chunks ``r`` and ``2*cp-1-r`` of every sample (Megatron's zigzag), the order in
which :class:`~megatron_r3.dataplane.device.plan.RoutingPlan` (built with the same ``padded_lens``)
lays out the routes.

:class:`RowLayout` packs a rank's samples ``micro_batch_size`` at a time and
builds the routing plans of each microbatch; the rollout engine and the trainer
share it, so both run exactly the same rows.

Position ``t`` of a sample predicts token ``t + 1``: its label, loss mask,
rollout log-prob and advantage are those of token ``t + 1``; the last position
predicts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_r3.dataplane.device.filler_routes import first_dead_positions
from megatron_r3.dataplane.device.plan import RankLayout, RoutingPlan, chunk_plans, padded_lengths, router_token_index, thd_source_rows
from megatron_r3.dataplane.device.transport import HostStaging
from megatron_r3.dataplane.samples import RolloutSample
from megatron_r3.layers.context_parallel import zigzag_placement_host
from megatron_r3.layers.moe_layers import chunk_vp_stages


@dataclass
class RolloutMicrobatch:
    """What one rank feeds to the model for one microbatch (all ``[1, s_local]`` but the params).

    Attributes:
        tokens: int64 input ids.
        labels: int64 next-token ids (0 where there is none).
        loss_mask: float32, 1 where the next token is trained on.
        rollout_logprobs: float32 rollout log-prob of the next token (0 where unknown).
        advantages: float32 advantage of the next token's sample (0 where none is given).
        dead_mask: bool, True at positions whose output no loss can see (from the last
            loss-bearing position of each sample on, and padding); Megatron's
            ``padding_mask`` for the MoE layers (:mod:`megatron_r3.dataplane.device.filler_routes`).
        position_ids: int64 position of each token within its sample.
        row_index: int64 ``[s_local]`` on the host: where each local token sits in the full row.
        packed_seq_params: THD parameters of the full (not CP-split) row.
        sample_lens: Token count of each sample, in packing order.
        padded_lens: Padded length of each sample (sums to ``seq_length``).
        seq_length: Length of the full packed row.
        old_logprobs: float32, R2's old-log-prob pass's log-prob of the next token, which the
            update pass's ratio takes instead of the rollout's (last pipeline stage); None under
            R3 and live routing.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    dead_mask: torch.Tensor
    position_ids: torch.Tensor
    row_index: torch.Tensor
    packed_seq_params: PackedSeqParams
    sample_lens: list[int]
    padded_lens: list[int]
    seq_length: int
    old_logprobs: Optional[torch.Tensor] = None


# The row's fields on the device, as RolloutMicrobatch names them, and their host dtypes.
_ROW_FIELDS = (("tokens", np.int64), ("labels", np.int64), ("position_ids", np.int64), ("loss_mask", np.float32),
               ("rollout_logprobs", np.float32), ("advantages", np.float32), ("dead_mask", np.bool_))


@dataclass
class HostRow:
    """One rank's row of a microbatch, packed on the host (:func:`pack_rollout_row`), one copy from the device.

    Attributes:
        staging: The row's fields (``_ROW_FIELDS``, each ``[s_local]`` in local order) and
            ``cu_seqlens`` (int32 cumulative padded lengths) in one host buffer.
        source_rows: int64 ``[s_local]``: the packing-source row (sample ``i``'s token ``t`` is
            row ``sum(sample_lens[:i]) + t``) of each local token, -1 for padding.
        row_index: int64 ``[s_local]``: where each local token sits in the full row.
        sample_lens: Token count of each sample, in packing order.
        padded_lens: Padded length of each sample (sums to ``seq_length``).
        seq_length: Length of the full packed row.
    """

    staging: HostStaging
    source_rows: np.ndarray
    row_index: np.ndarray
    sample_lens: list[int]
    padded_lens: list[int]
    seq_length: int

    def to_device(self, device: torch.device) -> RolloutMicrobatch:
        """The microbatch on ``device``: one asynchronous copy of the staging buffer to a GPU (on the
        current stream, which the forward runs on), a copy of it on the host (numpy's: torch's would
        go through its intra-op thread pool)."""
        data = self.staging.data
        if device.type == "cuda":
            data = data.to(device, non_blocking=True)
        else:
            data = torch.from_numpy(data.numpy().copy())
        views = self.staging.views(data)
        row = {name: views[name].unsqueeze(0) for name, _ in _ROW_FIELDS}
        return RolloutMicrobatch(
            **row,
            row_index=torch.from_numpy(self.row_index),
            packed_seq_params=padded_thd_params(views["cu_seqlens"], max(self.padded_lens)),
            sample_lens=self.sample_lens,
            padded_lens=self.padded_lens,
            seq_length=self.seq_length,
        )


def pack_rollout_row(
    samples: Sequence[RolloutSample],
    rank: RankLayout,
    seq_length: int,
    advantages: Optional[Sequence[float]] = None,
    pinned: bool = False,
) -> HostRow:
    """Packs ``samples`` into this rank's THD row of ``seq_length`` tokens, on the host.

    Vectorised over the row: the samples are concatenated once and every local token reads
    its values from there through its packing-source row.

    Args:
        samples: The microbatch's samples (their ``logprobs`` may be None).
        rank: This rank's layout; only TP/SP and CP matter here.
        seq_length: Length of the packed row, a multiple of ``rank.alignment``.
        advantages: One advantage per sample, spread over its trained tokens (default 0).
        pinned: Stage the row in page-locked memory (for a GPU).

    Raises:
        ValueError: the padded samples do not fit in ``seq_length``.
    """
    if not samples:
        raise ValueError("a microbatch needs at least one sample")
    if advantages is not None and len(advantages) != len(samples):
        raise ValueError(f"{len(advantages)} advantages for a microbatch of {len(samples)} samples")
    if seq_length % rank.alignment:
        raise ValueError(f"--seq-length {seq_length} must be a multiple of {rank.alignment} (2*cp, times tp with SP)")
    lens = np.array([len(s.token_ids) for s in samples], dtype=np.int64)
    padded = padded_lengths(lens, rank)
    if padded.sum() > seq_length:
        raise ValueError(
            f"samples of {lens.tolist()} tokens need {int(padded.sum())} positions once padded to multiples of "
            f"{rank.alignment}; --seq-length is {seq_length}: raise it or lower --micro-batch-size"
        )
    padded[-1] += seq_length - padded.sum()
    placement = zigzag_placement_host(padded, rank.cp_size, rank.cp_rank)
    source = thd_source_rows(lens, padded, placement, rank)
    seq, pos = placement.seq_id, placement.position

    # The samples end to end, and one zero row after them that padding rows read (and never keep).
    tokens = np.concatenate([s.token_ids for s in samples] + [[0]])
    loss_mask = np.concatenate([s.loss_mask for s in samples] + [[False]])
    logprobs = np.concatenate([np.zeros(n, np.float32) if s.logprobs is None else s.logprobs
                               for s, n in zip(samples, lens)] + [[0]])
    # Position t predicts token t + 1 of its sample: the label, mask, log-prob and advantage of the next row.
    predicts = pos < lens[seq] - 1
    after = np.where(predicts, source + 1, -1)
    staging = HostStaging([(name, dtype, (len(source),)) for name, dtype in _ROW_FIELDS]
                          + [("cu_seqlens", np.int32, (len(padded) + 1,))], pinned)
    staging.host("tokens")[:] = tokens[source]
    staging.host("labels")[:] = tokens[after]
    staging.host("position_ids")[:] = pos
    staging.host("loss_mask")[:] = loss_mask[after]
    staging.host("rollout_logprobs")[:] = logprobs[after]
    weights = np.zeros(len(lens)) if advantages is None else np.asarray(advantages, dtype=np.float64)
    staging.host("advantages")[:] = np.where(predicts, weights[seq] * loss_mask[after], 0)
    staging.host("dead_mask")[:] = pos >= first_dead_positions(loss_mask[:-1], lens)[seq]
    staging.host("cu_seqlens")[:] = np.concatenate([[0], np.cumsum(padded)])
    return HostRow(staging, source, placement.index, lens.tolist(), [int(p) for p in padded], seq_length)


def pack_rollout_microbatch(
    samples: Sequence[RolloutSample],
    rank: RankLayout,
    seq_length: int,
    device: torch.device,
    advantages: Optional[Sequence[float]] = None,
) -> RolloutMicrobatch:
    """:func:`pack_rollout_row` on ``device``."""
    return pack_rollout_row(samples, rank, seq_length, advantages, pinned=device.type == "cuda").to_device(device)


def padded_thd_params(cu_seqlens_padded: torch.Tensor, max_seqlen: int) -> PackedSeqParams:
    """Self-attention over packed samples whose alignment padding follows each sample's last token.

    Under causal attention no real token sees the padding after it, so the attention is told
    the padded lengths, as one tensor for every ``cu_seqlens`` field: the real tokens' outputs
    and gradients are those of the unpadded samples, and the padded rows are ordinary causal
    rows whose outputs reach no loss. TransformerEngine reads the shared tensor as "no padding
    between sequences" without a host sync; told real lengths with padding between sequences,
    its p2p context-parallel backward left the padded rows' query gradients unwritten
    (TE 2.20.2, docs/routing_replay.md).
    """
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens_padded, cu_seqlens_kv=cu_seqlens_padded,
                           cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


@dataclass(frozen=True)
class RowLayout:
    """How a rank packs samples into the rows the model runs (shared by engine and trainer).

    Attributes:
        rank: This rank's place in the layout (TP/SP, CP, PP rank).
        config: The model's ``TransformerConfig`` (its pipeline split: which chunk builds which layers).
        seq_length: Length of a packed row.
        micro_batch_size: Samples per row.
        device: Where the rows go.
        hybrid_layer_pattern: A HybridModel's layer pattern (its ``|`` segments are the chunks);
            None for a GPTModel.
    """

    rank: RankLayout
    config: TransformerConfig
    seq_length: int
    micro_batch_size: int
    device: torch.device
    hybrid_layer_pattern: Optional[str] = None

    @property
    def num_chunks(self) -> int:
        """Model chunks on this rank (virtual pipeline stages)."""
        return len(chunk_vp_stages(self.config))

    def plans(self, batch: RolloutMicrobatch, source_layer_numbers: Sequence[int]) -> list[RoutingPlan]:
        """The routing plan of each of this rank's model chunks for ``batch``.

        ``source_layer_numbers`` are the MoE layers the batch's routes hold (``RolloutRoutes.layer_numbers``).
        """
        return chunk_plans(self.rank, batch.sample_lens, source_layer_numbers=source_layer_numbers,
                           config=self.config, hybrid_layer_pattern=self.hybrid_layer_pattern, qkv_format="thd",
                           padded_lens=batch.padded_lens)

    def row_plans(self, row: HostRow, source_layer_numbers: Sequence[int]) -> list[RoutingPlan]:
        """:meth:`plans` of a row packed on the host, from the token placement the row was packed with."""
        return chunk_plans(self.rank, row.sample_lens, source_layer_numbers=source_layer_numbers,
                           config=self.config, hybrid_layer_pattern=self.hybrid_layer_pattern,
                           token_index=router_token_index(row.source_rows, self.rank))
