"""Where a context-parallel rank's tokens sit in the full batch, and a K/V gather.

Megatron splits every sequence into ``2 * cp`` equal chunks and gives rank ``r``
chunks ``r`` and ``2 * cp - 1 - r`` (a "zigzag" that balances causal work):
``get_batch_on_this_cp_rank`` does it for BSHD batches, TransformerEngine's
``thd_get_partitioned_indices`` does it sequence by sequence for packed THD
batches, whose sequences are first padded to a multiple of ``2 * cp``.

:func:`zigzag_placement` computes this placement on the device, where core attention
builds its causal mask from it; :func:`zigzag_placement_host` computes the same on the
host in numpy, where the data plane places a microbatch's tokens
(:mod:`megatron_r3.dataplane.device.microbatches`) and routes
(:mod:`megatron_r3.dataplane.device.plan`) with one call, so replayed routes and tokens
cannot disagree. The two agree exactly (tests check both against a brute-force split).
The host one is numpy: torch's small CPU kernels go through its intra-op thread pool,
whose start-up per kernel dominates on a busy host (docs/benchmarks.md, "Host preparation").
"""

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist


class ZigzagPlacement(NamedTuple):
    """Where each token a CP rank holds sits, each an int64 ``[num_local_tokens]`` tensor.

    Attributes:
        index: The token's index in the full (not CP-split) packed batch.
        seq_id: Its sequence.
        position: Its position within that sequence.
    """

    index: torch.Tensor
    seq_id: torch.Tensor
    position: torch.Tensor


def zigzag_placement(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, num_local_tokens: int
) -> ZigzagPlacement:
    """Where the tokens of a context-parallel rank sit in the full batch, in local order.

    Sequence ``i`` occupies ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`` of the
    full packed (THD) batch, a length divisible by ``2 * cp_size`` when ``cp_size > 1``.
    Rank ``r`` holds, sequence by sequence, that sequence's chunks ``r`` and
    ``2 * cp_size - 1 - r``. A BSHD batch is the one-sequence case,
    ``cu_seqlens_padded = [0, seq_len]``: every row of the batch is placed alike.

    Runs on the device of ``cu_seqlens_padded`` with no host sync.

    Args:
        cu_seqlens_padded: int tensor ``[num_seqs + 1]``, cumulative padded lengths
            of the full (not CP-split) batch.
        cp_size: Context-parallel world size.
        cp_rank: This rank in the context-parallel group.
        num_local_tokens: ``cu_seqlens_padded[-1] // cp_size``, known to the caller
            (reading it from the tensor would be a device-to-host copy).
    """
    cu = cu_seqlens_padded.to(torch.int64)
    local_lengths = (cu[1:] - cu[:-1]) // cp_size
    local_ends = torch.cumsum(local_lengths, 0)
    local = torch.arange(num_local_tokens, device=cu.device)
    seq_id = torch.bucketize(local, local_ends, right=True)
    offset = local - (local_ends - local_lengths)[seq_id]
    position = offset
    if cp_size > 1:
        # The first half of a sequence's local tokens is chunk cp_rank, the second its mirror.
        chunk = local_lengths[seq_id] // 2
        mirror = 2 * cp_size - 1 - cp_rank
        position = torch.where(offset < chunk, cp_rank * chunk + offset, (mirror - 1) * chunk + offset)
    return ZigzagPlacement(cu[seq_id] + position, seq_id, position)


class HostZigzagPlacement(NamedTuple):
    """:class:`ZigzagPlacement` on the host: int64 numpy ``[num_local_tokens]`` arrays."""

    index: np.ndarray
    seq_id: np.ndarray
    position: np.ndarray


def zigzag_placement_host(padded_lens: Sequence[int], cp_size: int, cp_rank: int) -> HostZigzagPlacement:
    """:func:`zigzag_placement` of ``cu_seqlens_padded = [0, cumsum(padded_lens)]``, on the host.

    Args:
        padded_lens: Padded length of each sequence of the full packed batch, each
            divisible by ``2 * cp_size`` when ``cp_size > 1``.
        cp_size: Context-parallel world size.
        cp_rank: This rank in the context-parallel group.
    """
    lengths = np.asarray(padded_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    local_lengths = lengths // cp_size
    seq_id = np.repeat(np.arange(len(lengths), dtype=np.int64), local_lengths)
    local_starts = np.cumsum(local_lengths) - local_lengths
    offset = np.arange(len(seq_id), dtype=np.int64) - local_starts[seq_id]
    position = offset
    if cp_size > 1:
        # The first half of a sequence's local tokens is chunk cp_rank, the second its mirror.
        chunk = (local_lengths // 2)[seq_id]
        mirror = 2 * cp_size - 1 - cp_rank
        position = np.where(offset < chunk, cp_rank * chunk + offset, (mirror - 1) * chunk + offset)
    return HostZigzagPlacement(starts[seq_id] + position, seq_id, position)


class _AllGatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0; the backward pass reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = tensor.new_empty((size * tensor.size(0), *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.size(0) // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather_first_dim(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, differentiably.

    Each rank's gradient is the sum over ranks of the gradient slice that belongs
    to it, so keys and values gathered for attention get the contributions of
    every rank's queries.

    Args:
        tensor: The local tensor; the same shape on every rank.
        group: The process group; ``None`` or a group of one returns ``tensor``.
    """
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return _AllGatherFirstDim.apply(tensor, group)
