"""Causal core attention in plain torch with context parallelism and packed sequences."""

import math
import weakref
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from megatron_r3.layers.context_parallel import all_gather_first_dim, zigzag_placement


class ContextParallelDotProductAttention(MegatronModule):
    """Drop-in ``core_attention`` for ``SelfAttention`` that runs every layout without TE.

    Megatron's ``DotProductAttention`` rejects context parallelism and packed
    sequences, which leaves CP and THD to TransformerEngine. This module takes the
    same constructor arguments and forward signature and supports:

    * BSHD input ``[s, b, heads, dim]``, with or without context parallelism. Under
      CP each rank holds chunks ``r`` and ``2*cp-1-r`` of the sequence (Megatron's
      ``get_batch_on_this_cp_rank``).
    * Packed THD input ``[t, heads, dim]`` described by ``PackedSeqParams``; under CP
      every sequence is padded to a multiple of ``2*cp`` (``cu_seqlens_*_padded``)
      and split the same zigzag way, sequence by sequence.

    Keys and values are all-gathered across the CP group (the backward pass
    reduce-scatters their gradients), and the causal mask is built from each
    token's global position, so the result equals single-rank attention over the
    full sequences. Padding tokens of packed sequences are never attended to.

    Attention is materialised as ``[b, heads, s_local, s_full]`` scores: meant for
    tests, CPU runs and small models, not for long-context throughput.

    Args:
        config: Transformer config.
        layer_number: Global 1-based layer number; kept for signature compatibility.
        attn_mask_type: ``causal`` or ``padding_causal``.
        attention_type: ``"self"``; kept for signature compatibility.
        attention_dropout: Dropout probability; defaults to ``config.attention_dropout``.
        softmax_scale: Defaults to ``1 / sqrt(head_dim)``.
        cp_comm_type: Accepted for signature compatibility; K/V are all-gathered.
        pg_collection: Process groups; ``tp`` and ``cp`` are used. Defaults to the
            global parallel state.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"only causal attention is supported, got {attn_mask_type}")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported")
        if config.window_size is not None:
            raise ValueError("sliding-window attention is not supported")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp

        head_dim = config.kv_channels
        self.hidden_size_per_partition = divide(
            head_dim * config.num_attention_heads, self.tp_group.size()
        )
        # apply_query_key_layer_scaling needs no special case: queries are scaled
        # before the product and the softmax runs in fp32.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Causal attention of the local queries over the keys of the whole sequence.

        Args:
            query: ``[sq, b, heads, dim]`` (BSHD) or ``[t, heads, dim]`` (THD).
            key: ``[sk, b, groups, dim]`` or ``[t, groups, dim]``; ``heads`` must be a
                multiple of ``groups`` (grouped-query attention).
            value: Same shape as ``key``.
            attention_mask: Optional boolean ``[b, 1, sq, sk]`` mask, ``True`` where
                attention is not allowed; combined with the causal mask. Only without
                CP and packed sequences (where the global mask is implied).
            attn_mask_type: Must be causal if given.
            attention_bias: Not supported; must be ``None``.
            packed_seq_params: ``qkv_format='thd'`` parameters of a packed batch.

        Returns:
            ``[sq, b, heads * dim]`` for BSHD, ``[t, heads * dim]`` for THD.
        """
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported")
        if attn_mask_type not in (None, AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"only causal attention is supported, got {attn_mask_type}")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed_seq_params is not None and not packed:
            raise ValueError(f"unsupported qkv_format {packed_seq_params.qkv_format!r}")
        cp_size = self.cp_group.size()
        if attention_mask is not None and (packed or cp_size > 1):
            raise ValueError(
                "an explicit attention_mask is only supported without CP and packed sequences"
            )
        if packed:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)

        allowed = self._allowed(query.size(0), query.device, packed_seq_params if packed else None)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask
        key = all_gather_first_dim(key, self.cp_group)
        value = all_gather_first_dim(value, self.cp_group)
        context = self._attend(query, key, value, allowed)
        if packed:
            return context.squeeze(1)
        return context

    def _allowed(
        self, local_len: int, device: torch.device, packed_seq_params: Optional[PackedSeqParams]
    ) -> Tensor:
        """Boolean ``[local_len, cp * local_len]``: which gathered key each local query sees.

        Every layer of a microbatch asks for the same mask, so the last one built is reused
        while its inputs are the same tensors, unchanged (:class:`_LastMask`).
        """
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        if packed_seq_params is None:
            if cp_size > 1 and local_len % 2:
                raise ValueError(f"a CP rank holds two equal chunks of the sequence; got {local_len} tokens")
            sources = ()
        else:
            sources = (packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded)
        key = (local_len, str(device), cp_size, cp_rank)
        mask = _LAST_MASK.get(key, sources)
        if mask is None:
            mask = self._build_allowed(local_len, device, packed_seq_params)
            _LAST_MASK.put(key, sources, mask)
        return mask

    def _build_allowed(
        self, local_len: int, device: torch.device, packed_seq_params: Optional[PackedSeqParams]
    ) -> Tensor:
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        if packed_seq_params is None:
            # BSHD: one sequence of cp * local_len real tokens per row, every row alike.
            cu_padded = torch.arange(2, device=device) * (cp_size * local_len)
            lengths = cu_padded.diff()
        else:
            cu_padded = packed_seq_params.cu_seqlens_q_padded
            if cu_padded is None:
                cu_padded = packed_seq_params.cu_seqlens_q
            cu_padded = cu_padded.to(device)
            lengths = packed_seq_params.cu_seqlens_q.to(device).diff().to(torch.int64)

        placements = [zigzag_placement(cu_padded, cp_size, rank, local_len) for rank in range(cp_size)]
        q_seq, q_pos = placements[cp_rank].seq_id, placements[cp_rank].position
        k_seq = torch.cat([placement.seq_id for placement in placements])
        k_pos = torch.cat([placement.position for placement in placements])
        k_real = k_pos < lengths[k_seq]
        same_seq = q_seq[:, None] == k_seq[None, :]
        return same_seq & (k_pos[None, :] <= q_pos[:, None]) & k_real[None, :]

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor) -> Tensor:
        """Masked softmax attention; ``query [sq, b, np, hn]``, ``key/value [sk, b, ng, hn]``."""
        groups = query.size(2) // key.size(2)
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(q * self.softmax_scale, k.transpose(-1, -2)).float()
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        if not self.training or self.attention_dropout.p == 0:
            pass  # no random numbers: no RNG state to fork (its get/set cannot be graph-captured)
        elif self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, n, sq, d]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), self.hidden_size_per_partition)


class _LastMask:
    """The last attention mask built, with what it was built from.

    A mask is a function of its key (local length, device, CP rank) and of the ``cu_seqlens``
    tensors it was built from. :meth:`get` returns it only for the same key and the very same
    tensors (held by weak reference, so a freed tensor's reused id cannot match) at the same
    version (an in-place change invalidates it), and only to a CUDA graph capture if it was
    built in one: a capture must compute the mask from its inputs, not bake in one built
    before from the inputs it then held.
    """

    def __init__(self):
        self._key, self._sources, self._mask = None, (), None

    def get(self, key: tuple, sources: tuple) -> Optional[Tensor]:
        key = (*key, _capturing())
        if key != self._key or len(sources) != len(self._sources):
            return None
        for tensor, (ref, version) in zip(sources, self._sources):
            if tensor is None and ref is None:
                continue
            if tensor is None or ref is None or ref() is not tensor or tensor._version != version:
                return None
        return self._mask

    def put(self, key: tuple, sources: tuple, mask: Tensor) -> None:
        self._key, self._mask = (*key, _capturing()), mask
        self._sources = tuple((None, None) if t is None else (weakref.ref(t), t._version) for t in sources)


_LAST_MASK = _LastMask()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
