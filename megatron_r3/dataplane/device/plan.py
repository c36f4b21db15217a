"""Which routes a rank needs, in the order its routers see tokens.

A :class:`RoutingPlan` is two small int32 index maps, built on the host once per
microbatch and parallel layout and reused by every packing path:

* ``token_index[n_local]``: for each token position the router sees (hidden
  states ``[s_local, b, h]`` flattened s-major: ``s_local_index * b + batch_index``),
  the row of the packing source that holds its routes, or -1 for padding.
* ``layer_index[L_local]``: for each MoE layer the chunk builds (increasing
  ``layer_number``), the layer row of the packing source.

The packing source is the microbatch's samples concatenated along tokens
(:func:`megatron_r3.dataplane.routes.concat_routes`): sample i's token t is row
``sum(sample_lens[:i]) + t``. Padding is never materialised on the host.

Token placement matches Megatron:

* CP, BSHD (``get_batch_on_this_cp_rank``): the padded sequence is cut into
  ``2*cp`` equal chunks; rank r keeps chunks r and ``2*cp-1-r``.
* CP, THD (TransformerEngine's ``thd_get_partitioned_indices``): the same, one
  padded sequence at a time, concatenated. Both CP cases come from
  :func:`megatron_r3.layers.context_parallel.zigzag_placement_host`, which also places
  the tokens of the packed microbatches (core attention computes the same on the device).
* SP (``scatter_to_sequence_parallel_region``): after the embedding each TP rank
  keeps a contiguous equal slice of the (CP-local) sequence dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from megatron_r3.dataplane.routes import layer_index as _layer_index
from megatron_r3.layers.context_parallel import HostZigzagPlacement, zigzag_placement_host
from megatron_r3.layers.moe_layers import chunk_layers, chunk_vp_stages

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True)
class RankLayout:
    """A rank's place in the parallel layout (only what changes the router's input).

    TP without sequence parallelism does not split tokens; EP and DP do not
    change what a router sees.
    """

    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    pp_rank: int = 0
    vp_stage: Optional[int] = None

    def __post_init__(self):
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.cp_rank < self.cp_size):
            raise ValueError(f"rank outside its group: {self}")

    @classmethod
    def of_this_rank(cls, sequence_parallel: bool) -> "RankLayout":
        """This process's place, from Megatron's parallel state."""
        from megatron.core import parallel_state

        return cls(
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sequence_parallel=sequence_parallel,
            cp_size=parallel_state.get_context_parallel_world_size(),
            cp_rank=parallel_state.get_context_parallel_rank(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        )

    @property
    def sp_size(self) -> int:
        """How many ways the sequence dim is split after the embedding."""
        return self.tp_size if self.sequence_parallel else 1

    @property
    def sp_rank(self) -> int:
        return self.tp_rank if self.sequence_parallel else 0

    @property
    def alignment(self) -> int:
        """Megatron's padding multiple for a sequence: ``2*cp`` (when cp > 1), times tp with SP."""
        return (2 * self.cp_size if self.cp_size > 1 else 1) * self.sp_size


def bshd_token_index(sample_lens: Sequence[int], seq_len: int, rank: RankLayout) -> np.ndarray:
    """Router-order source rows for a BSHD microbatch ``[b, seq_len]``.

    Args:
        sample_lens: Real token count of each of the b samples (<= seq_len); the
            rest of each row is padding.
        seq_len: Padded sequence length: a multiple of ``2*cp`` whose CP-local part
            ``seq_len / cp`` splits evenly over the SP ranks.
        rank: This rank's layout.

    Returns:
        int32 ``[seq_len // (cp * sp) * b]``, s-major.
    """
    lens = np.asarray(sample_lens, dtype=np.int64)
    if len(lens) == 0 or (lens < 0).any() or (lens > seq_len).any():
        raise ValueError(f"sample lengths {list(lens)} must lie in [0, seq_len={seq_len}]")
    two_cp = 2 * rank.cp_size if rank.cp_size > 1 else 1
    if seq_len % two_cp or (seq_len // rank.cp_size) % rank.sp_size:
        raise ValueError(
            f"seq_len {seq_len} must be a multiple of {two_cp} (2*cp) and seq_len/cp of {rank.sp_size} (SP)"
        )
    # One padded sequence per row, every row placed alike.
    positions = zigzag_placement_host([seq_len], rank.cp_size, rank.cp_rank).position
    positions = _sp_slice(positions, rank)
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    rows = offsets[None, :] + positions[:, None]  # [s_local, b]
    rows = np.where(positions[:, None] < lens[None, :], rows, -1)
    return _int32(rows.reshape(-1))


def padded_lengths(sample_lens: Sequence[int], rank: RankLayout, pad_multiple: int = 1) -> np.ndarray:
    """THD padded lengths: each sequence rounded up to ``lcm(rank.alignment, pad_multiple)``."""
    multiple = int(np.lcm(rank.alignment, pad_multiple))
    lens = np.asarray(sample_lens, dtype=np.int64)
    return (lens + multiple - 1) // multiple * multiple


def thd_token_index(
    sample_lens: Sequence[int], rank: RankLayout, padded_lens: Optional[Sequence[int]] = None
) -> np.ndarray:
    """Router-order source rows for a packed THD microbatch (b = 1).

    Args:
        sample_lens: Real token count of each packed sequence.
        rank: This rank's layout.
        padded_lens: Each sequence's padded length (``diff(cu_seqlens_padded)``);
            default :func:`padded_lengths`. Each must be a multiple of ``2*cp``
            and their sum a multiple of the SP size.

    Returns:
        int32 ``[sum(padded_lens) // (cp * sp)]``.
    """
    lens = np.asarray(sample_lens, dtype=np.int64)
    padded = padded_lengths(lens, rank) if padded_lens is None else np.asarray(padded_lens, dtype=np.int64)
    placement = zigzag_placement_host(padded, rank.cp_size, rank.cp_rank)
    return router_token_index(thd_source_rows(lens, padded, placement, rank), rank)


def thd_source_rows(sample_lens: Sequence[int], padded_lens: Sequence[int], placement: HostZigzagPlacement,
                    rank: RankLayout) -> np.ndarray:
    """int64 source row of each token a CP rank holds (``placement``, its local order), -1 for padding.

    These are the tokens of the rank's row, before the embedding; :func:`router_token_index`
    turns them into the routers' order.
    """
    lens = np.asarray(sample_lens, dtype=np.int64)
    padded = np.asarray(padded_lens, dtype=np.int64)
    if len(lens) == 0 or padded.shape != lens.shape or (padded < lens).any() or (lens < 0).any():
        raise ValueError(f"padded lengths {list(padded)} must cover sample lengths {list(lens)}")
    two_cp = 2 * rank.cp_size if rank.cp_size > 1 else 1
    if (padded % two_cp).any() or padded.sum() % (rank.cp_size * rank.sp_size):
        raise ValueError(
            f"padded lengths {list(padded)}: each must be a multiple of {two_cp} (2*cp) and the total "
            f"a multiple of cp*sp = {rank.cp_size * rank.sp_size}"
        )
    offsets = np.cumsum(lens) - lens
    seq, pos = placement.seq_id, placement.position
    return np.where(pos < lens[seq], offsets[seq] + pos, -1)


def router_token_index(source_rows: np.ndarray, rank: RankLayout) -> np.ndarray:
    """A THD row's source rows (:func:`thd_source_rows`) as the routers see them: this SP rank's slice, int32."""
    return _int32(_sp_slice(source_rows, rank))


def _sp_slice(values: np.ndarray, rank: RankLayout) -> np.ndarray:
    if len(values) % rank.sp_size:
        raise ValueError(f"{len(values)} local tokens do not split over {rank.sp_size} SP ranks")
    n = len(values) // rank.sp_size
    return values[rank.sp_rank * n : (rank.sp_rank + 1) * n]


def _int32(values: np.ndarray) -> np.ndarray:
    if len(values) and values.max(initial=-1) >= 2**31:
        raise ValueError("more than 2**31 source tokens in one microbatch")
    return np.ascontiguousarray(values, dtype=np.int32)


@dataclass(frozen=True)
class RoutingPlan:
    """Where each of a rank's router inputs comes from in the packing source.

    Attributes:
        token_index: int32 ``[n_local]``, source row per router token (s-major), -1 = padding.
        layer_index: int32 ``[L_local]``, source layer row per MoE layer this chunk builds.
        layer_numbers: The chunk's MoE layer numbers (1-based, increasing); dim 0 of
            ``expert_ids``.
        num_source_tokens: Rows of the packing source (sum of sample lengths).
        num_source_layers: Layer rows of the packing source.
    """

    token_index: np.ndarray
    layer_index: np.ndarray
    layer_numbers: tuple[int, ...]
    num_source_tokens: int
    num_source_layers: int

    @property
    def num_local_tokens(self) -> int:
        return len(self.token_index)

    @property
    def num_padding_rows(self) -> int:
        return int((self.token_index < 0).sum())

    def with_padding_rows(self) -> "RoutingPlan":
        """The plan with its padding rows read from source rows appended after the samples.

        Padding row ``k`` (in router order) reads source row ``num_source_tokens + k``, so
        filler routes for the padding (:mod:`megatron_r3.dataplane.device.filler_routes`) can be packed like
        any sample's.
        """
        padding = self.token_index < 0
        token_index = self.token_index.copy()
        token_index[padding] = self.num_source_tokens + np.arange(int(padding.sum()), dtype=np.int32)
        return replace(self, token_index=token_index,
                       num_source_tokens=self.num_source_tokens + int(padding.sum()))

    @property
    def num_local_layers(self) -> int:
        return len(self.layer_index)

    @classmethod
    def build(
        cls,
        rank: RankLayout,
        sample_lens: Sequence[int],
        *,
        source_layer_numbers: Sequence[int],
        config: Optional[TransformerConfig] = None,
        hybrid_layer_pattern: Optional[str] = None,
        layer_numbers: Optional[Sequence[int]] = None,
        qkv_format: str = "bshd",
        seq_len: Optional[int] = None,
        padded_lens: Optional[Sequence[int]] = None,
        token_index: Optional[np.ndarray] = None,
    ) -> "RoutingPlan":
        """Plans one microbatch for one rank and model chunk.

        Args:
            rank: This rank's layout (TP/SP, CP, PP rank, VP stage).
            sample_lens: Token count of each sample in the microbatch, in batch (BSHD)
                or packing (THD) order.
            source_layer_numbers: MoE layer numbers of the routes (``RolloutRoutes.layer_numbers``).
            config: The model's ``TransformerConfig``; with it the chunk's layers are the
                source layers that chunk ``(rank.pp_rank, rank.vp_stage)`` builds
                (:func:`~megatron_r3.layers.moe_layers.chunk_layers`).
            hybrid_layer_pattern: With ``config``, a HybridModel's layer pattern (its ``|``
                segments are the chunks); None for a GPTModel.
            layer_numbers: The chunk's MoE layer numbers, given directly instead of ``config``.
            qkv_format: ``"bshd"`` (``[b, seq_len]`` rows) or ``"thd"`` (packed, b = 1).
            seq_len: BSHD padded sequence length (default: the longest sample,
                rounded up to ``rank.alignment``).
            padded_lens: THD per-sequence padded lengths (``diff(cu_seqlens_padded)``).
            token_index: The router-order source rows, already computed for this rank and
                microbatch (every chunk of a rank shares them), instead of ``qkv_format``,
                ``seq_len`` and ``padded_lens``.
        """
        if (config is None) == (layer_numbers is None):
            raise ValueError("give exactly one of config= and layer_numbers=")
        if layer_numbers is None:
            built = chunk_layers(config, rank.pp_rank, rank.vp_stage, hybrid_layer_pattern=hybrid_layer_pattern)
            layer_numbers = [n for n in source_layer_numbers if n in built]
        if token_index is not None:
            if seq_len is not None or padded_lens is not None:
                raise ValueError("token_index is the placement already: give no seq_len or padded_lens with it")
            tokens = _int32(token_index)
        elif qkv_format == "bshd":
            if padded_lens is not None:
                raise ValueError("padded_lens is for THD; BSHD takes seq_len")
            if seq_len is None:
                longest = max(sample_lens)
                seq_len = -(-longest // rank.alignment) * rank.alignment
            tokens = bshd_token_index(sample_lens, seq_len, rank)
        elif qkv_format == "thd":
            if seq_len is not None:
                raise ValueError("seq_len is for BSHD; THD takes padded_lens")
            tokens = thd_token_index(sample_lens, rank, padded_lens)
        else:
            raise ValueError(f"qkv_format must be 'bshd' or 'thd', got {qkv_format!r}")
        return cls(
            token_index=tokens,
            layer_index=_layer_index(source_layer_numbers, layer_numbers),
            layer_numbers=tuple(int(n) for n in layer_numbers),
            num_source_tokens=int(np.sum(sample_lens)),
            num_source_layers=len(source_layer_numbers),
        )


def chunk_plans(
    rank: RankLayout, sample_lens: Sequence[int], *, source_layer_numbers: Sequence[int],
    config: TransformerConfig, hybrid_layer_pattern: Optional[str] = None, **layout,
) -> list[RoutingPlan]:
    """One plan per model chunk of ``rank.pp_rank``, in ``vp_stage`` order (one chunk without VP).

    ``hybrid_layer_pattern`` is a HybridModel's (None for a GPTModel); ``layout`` takes
    :meth:`RoutingPlan.build`'s ``qkv_format``, ``seq_len``, ``padded_lens`` or ``token_index``.
    The chunks share one token placement, computed once.
    """
    plans = []
    for stage in chunk_vp_stages(config):
        plans.append(RoutingPlan.build(replace(rank, vp_stage=stage), sample_lens,
                                       source_layer_numbers=source_layer_numbers, config=config,
                                       hybrid_layer_pattern=hybrid_layer_pattern, **layout))
        layout = {"token_index": plans[0].token_index}
    return plans
