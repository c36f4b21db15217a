"""Where a context-parallel rank's tokens sit in the full sequence, and a K/V gather.

Megatron splits every sequence into ``2 * cp`` equal chunks and gives rank ``r``
chunks ``r`` and ``2 * cp - 1 - r`` (a "zigzag" that balances causal work):
``get_batch_on_this_cp_rank`` does it for BSHD batches, TransformerEngine's
``thd_get_partitioned_indices`` does it sequence by sequence for packed THD
batches, whose sequences are first padded to a multiple of ``2 * cp``.

The functions here compute, on the device and without host syncs, the global
index of each local token; core attention uses them to build its causal mask and
test harnesses use them to slice inputs.
"""

from typing import Optional

import torch
import torch.distributed as dist


def zigzag_positions(local_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions in the full sequence of the tokens a CP rank holds (BSHD).

    Args:
        local_len: Tokens this rank holds, ``seq_len // cp_size``; even when
            ``cp_size > 1``.
        cp_size: Context-parallel world size.
        cp_rank: This rank in the context-parallel group.
        device: Device of the result.

    Returns:
        int64 tensor ``[local_len]``: the global position of each local token.
    """
    local = torch.arange(local_len, device=device)
    if cp_size == 1:
        return local
    if local_len % 2:
        raise ValueError(f"a CP rank holds two equal chunks; got {local_len} tokens")
    chunk = local_len // 2
    first = local < chunk
    chunk_id = torch.where(first, cp_rank, 2 * cp_size - 1 - cp_rank)
    return chunk_id * chunk + local % chunk


def thd_zigzag_index(
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    num_local_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the tokens of a CP rank sit in a packed (THD) batch.

    Each sequence ``i`` occupies ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`` of
    the full packed batch, a length divisible by ``2 * cp_size``. Rank ``r`` holds,
    sequence by sequence, that sequence's chunks ``r`` and ``2 * cp_size - 1 - r``.

    Args:
        cu_seqlens_padded: int tensor ``[num_seqs + 1]``, cumulative padded lengths
            of the full (not CP-split) packed batch.
        cp_size: Context-parallel world size.
        cp_rank: This rank in the context-parallel group.
        num_local_tokens: ``cu_seqlens_padded[-1] // cp_size`` if the caller knows
            it (saves a device-to-host copy).

    Returns:
        ``(index, seq_id, position)``, each int64 ``[total_padded // cp_size]``:
        the token's index in the full packed batch, its sequence, and its position
        within that sequence.
    """
    cu = cu_seqlens_padded.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    local_cu = torch.nn.functional.pad(torch.cumsum(lengths // cp_size, 0), (1, 0))
    if num_local_tokens is None:
        num_local_tokens = int(cu[-1]) // cp_size  # a host sync; callers that know it pass it
    local = torch.arange(num_local_tokens, device=cu.device)
    seq_id = torch.bucketize(local, local_cu[1:], right=True)
    offset = local - local_cu[seq_id]
    position = offset
    if cp_size > 1:
        chunk = lengths[seq_id] // (2 * cp_size)
        chunk_id = torch.where(offset < chunk, cp_rank, 2 * cp_size - 1 - cp_rank)
        position = chunk_id * chunk + offset % chunk
    return cu[seq_id] + position, seq_id, position


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
