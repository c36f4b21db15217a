"""Test data and the per-layout microbatches each rank feeds to the model.

A test's data is a list of sequences (token ids and labels), independent of the
layout. Every token has a *global id*: its sequence's offset in the
concatenation of all sequences plus its position. Each rank's microbatches carry
``token_index`` (global id of every local token, -1 for padding), so per-token
results from any layout can be put back in global order and compared, and
per-token routing can be looked up by global id.

Slicing per layout:

* data parallelism: DP rank ``d`` of ``D`` takes the ``d``-th contiguous block of
  sequences;
* BSHD context parallelism: Megatron's own ``get_batch_on_this_cp_rank``;
* packed THD: sequences padded to a multiple of ``2 * cp`` (times ``tp`` with SP),
  packed, and each rank keeps its zigzag chunks sequence by sequence
  (:func:`megatron_r3.layers.context_parallel.zigzag_placement`);
* sequence parallelism slices inside the model (after the embedding).
"""

import dataclasses
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_r3.dataplane.device.microbatches import padded_thd_params
from megatron_r3.layers.context_parallel import zigzag_placement


@dataclasses.dataclass
class Sequences:
    """The data of a test: ``tokens[i]`` and ``labels[i]`` are int64 ``[L_i]``."""

    tokens: list
    labels: list

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def offsets(self) -> list[int]:
        """Global id of each sequence's first token."""
        out, total = [], 0
        for length in self.lengths:
            out.append(total)
            total += length
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def make_sequences(lengths: list[int], vocab_size: int, seed: int = 0) -> Sequences:
    """Random token ids and labels for sequences of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(vocab_size, (n,), generator=gen) for n in lengths]
    labels = [torch.randint(vocab_size, (n,), generator=gen) for n in lengths]
    return Sequences(tokens, labels)


@dataclasses.dataclass
class Microbatch:
    """What one rank feeds to the model for one microbatch.

    Attributes:
        tokens: ``[b, s_local]`` input ids (``b = 1`` when packed).
        labels: ``[b, s_local]``.
        loss_mask: ``[b, s_local]`` float; 0 on padding.
        position_ids: ``[b, s_local]`` position of each token in its sequence.
        token_index: ``[b, s_local]`` global id of each token; -1 for padding.
        packed_seq_params: THD parameters (full-batch cu_seqlens), or ``None``.
        seq_length: Full (not CP-split) sequence length, for pipeline buffers.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    token_index: torch.Tensor
    packed_seq_params: Optional[PackedSeqParams] = None
    seq_length: int = 0

    def to(self, device) -> "Microbatch":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        params = self.packed_seq_params
        if params is not None:
            # One copy per tensor: fields that share a tensor keep sharing it.
            copies = {}
            params = dataclasses.replace(
                params,
                **{
                    k: copies.setdefault(id(v), v.to(device))
                    for k, v in vars(params).items()
                    if isinstance(v, torch.Tensor)
                },
            )
        return dataclasses.replace(self, packed_seq_params=params, **moved)


def _dp_block(data: Sequences) -> list[int]:
    """Indices of the sequences this data-parallel rank takes."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    count = len(data.tokens)
    assert count % dp_size == 0, f"{count} sequences do not split over DP={dp_size}"
    per_rank = count // dp_size
    return list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))


def bshd_microbatches(
    data: Sequences, micro_batch_size: int, device: Optional[torch.device] = None
) -> list[Microbatch]:
    """This rank's BSHD microbatches: DP block, then Megatron's CP zigzag slicing.

    Sequences batched together must have equal lengths (any lengths with
    ``micro_batch_size=1``, e.g. a single-rank reference for packed data).
    """
    mine = _dp_block(data)
    assert len(mine) % micro_batch_size == 0, (len(mine), micro_batch_size)
    offsets = data.offsets
    out = []
    for start in range(0, len(mine), micro_batch_size):
        seqs = mine[start : start + micro_batch_size]
        length = data.lengths[seqs[0]]
        assert all(data.lengths[i] == length for i in seqs), "ragged BSHD microbatch"
        positions = torch.arange(length)
        batch = {
            "tokens": torch.stack([data.tokens[i] for i in seqs]),
            "labels": torch.stack([data.labels[i] for i in seqs]),
            "loss_mask": torch.ones(len(seqs), length),
            "position_ids": positions.repeat(len(seqs), 1),
            "token_index": torch.stack([offsets[i] + positions for i in seqs]),
        }
        batch = get_batch_on_this_cp_rank(
            batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
        )
        out.append(Microbatch(**batch, seq_length=length).to(device))
    return out


def thd_microbatches(
    data: Sequences,
    sequences_per_microbatch: int,
    sequence_parallel: bool = False,
    device: Optional[torch.device] = None,
) -> list[Microbatch]:
    """This rank's packed THD microbatches.

    Each sequence is padded to a multiple of ``2 * cp`` (times ``tp`` under SP),
    the padded sequences are packed into one row, and this CP rank keeps chunks
    ``r`` and ``2*cp-1-r`` of every sequence. ``packed_seq_params`` gives the attention the
    full-batch padded lengths, as the data plane does (``padded_thd_params``).
    """
    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    multiple = 2 * cp_size if cp_size > 1 else 1
    if sequence_parallel:
        multiple *= parallel_state.get_tensor_model_parallel_world_size()
    mine = _dp_block(data)
    assert len(mine) % sequences_per_microbatch == 0, (len(mine), sequences_per_microbatch)
    offsets = data.offsets
    out = []
    for start in range(0, len(mine), sequences_per_microbatch):
        seqs = mine[start : start + sequences_per_microbatch]
        fields = {k: [] for k in ("tokens", "labels", "loss_mask", "position_ids", "token_index")}
        lengths, padded = [], []
        for i in seqs:
            length = data.lengths[i]
            pad = -length % multiple
            positions = torch.arange(length + pad)
            fields["tokens"].append(torch.nn.functional.pad(data.tokens[i], (0, pad)))
            fields["labels"].append(torch.nn.functional.pad(data.labels[i], (0, pad)))
            fields["loss_mask"].append((positions < length).float())
            fields["position_ids"].append(positions)
            fields["token_index"].append(
                torch.where(
                    positions < length, offsets[i] + positions, torch.full_like(positions, -1)
                )
            )
            lengths.append(length)
            padded.append(length + pad)
        cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        index = zigzag_placement(cu_padded, cp_size, cp_rank, sum(padded) // cp_size).index
        batch = {k: torch.cat(v)[index].unsqueeze(0) for k, v in fields.items()}
        params = padded_thd_params(cu_padded, max(padded))
        out.append(
            Microbatch(**batch, packed_seq_params=params, seq_length=int(cu_padded[-1])).to(device)
        )
    return out


def layout_microbatches(layout, data: Sequences, micro_batch_size: int, device=None) -> list[Microbatch]:
    """This rank's microbatches for ``layout``: packed THD or padded BSHD."""
    if layout.packed:
        return thd_microbatches(data, micro_batch_size, sequence_parallel=layout.sp, device=device)
    return bshd_microbatches(data, micro_batch_size, device=device)
