"""The rollout engine's generation rows: every sample in a slot of fixed length, tokens written in place.

Generation runs one forward-only pass per sampled token. Rather than pack the samples
again for every pass, each sample gets a slot of its prompt plus ``max_new_tokens - 1``
positions (every token a pass can read: the last sampled token never runs), packed once
per rollout into this rank's THD microbatches like any row (padding, context-parallel
split). A pass then runs those same microbatches, and a sampled token is written into
the rank's tokens on the device, where its position lies (under context parallelism, on
the rank that holds it).

Step ``s`` reads the logits of each sample's position ``prompt + s - 1``. The slot's later
positions hold earlier draws or the slot's initial filler; under causal attention within
each sample they reach no position up to the one read, so the step sees exactly the
sample's tokens so far. Every position of an engine row is already outside any loss (its
samples train nothing), so the slot changes no masking either.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megatron_r3.dataplane.device.microbatch_pipeline import MicrobatchPipeline, PassItem
from megatron_r3.dataplane.device.prefetch import PreparedMicrobatches
from megatron_r3.dataplane.samples import RolloutSample

SLOT_FILLER = 0
"""The token of a slot's positions not sampled yet (any id in the vocabulary would do)."""


def local_positions(row_index: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``positions`` (of the full row) this rank holds, and where in its local tokens.

    Returns:
        ``(held, local)``: the indices into ``positions`` this rank holds, and for each the index
        of its token in ``row_index`` (where each local token sits in the full row).
    """
    if len(row_index) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(row_index, kind="stable")
    at = np.minimum(np.searchsorted(row_index[order], positions), len(order) - 1)
    found = row_index[order][at] == positions
    return np.flatnonzero(found), order[at[found]]


class GenerationRows:
    """The microbatches every generation pass of one rollout runs.

    Args:
        pipeline: Packs this rank's rows (the engine's generation layout).
        prompts: The replica's prompts, in order.
        max_new_tokens: Most tokens a completion gets.
    """

    def __init__(self, pipeline: MicrobatchPipeline, prompts: Sequence[np.ndarray], max_new_tokens: int):
        tail = np.full(max_new_tokens - 1, SLOT_FILLER, dtype=np.int64)
        slots = [RolloutSample.unscored(np.concatenate([p, tail])) for p in prompts]
        self.items: list[list[PassItem]] = pipeline.prepare(slots).all_items()
        device = pipeline.rows.device
        self._where: list[torch.Tensor] = []  # per microbatch: [samples, max_new_tokens] local index, -1 elsewhere
        self._tokens: list[torch.Tensor] = []  # per microbatch: the local tokens and one spare slot
        first = 0
        for per_chunk in self.items:
            batch = per_chunk[0].batch  # every chunk of the rank shares the microbatch's row
            count = len(batch.sample_lens)
            starts = np.cumsum(np.concatenate([[0], batch.padded_lens[:-1]]))[:count]
            prompt_lens = np.array([len(p) for p in prompts[first:first + count]])
            first += count
            # Where step k reads (k = s) and writes (k = s + 1): position prompt - 1 + k of each slot.
            positions = (starts + prompt_lens - 1)[:, None] + np.arange(max_new_tokens)[None, :]
            held, local = local_positions(batch.row_index.numpy(), positions.ravel())
            where = np.full(positions.size, -1, dtype=np.int64)
            where[held] = local
            self._where.append(torch.from_numpy(where.reshape(positions.shape)).to(device))
            tokens = torch.cat([batch.tokens[0], batch.tokens.new_zeros(1)])
            batch.tokens = tokens[:-1].unsqueeze(0)  # a view: writes to the spare slot land nowhere
            self._tokens.append(tokens)
        self.num_samples = first

    def microbatches(self) -> PreparedMicrobatches:
        """One more pass over the rollout's microbatches, with the tokens written so far."""
        first = self.items[0][0].batch
        return PreparedMicrobatches.of(self.items, first.seq_length)

    def last_position_rows(self, index: int, logits: torch.Tensor, step: int) -> torch.Tensor:
        """float32 ``[samples, vocab / tp]``: microbatch ``index``'s logits at each sample's position read at
        ``step``, zero where another context-parallel rank holds it (their sum is the row)."""
        where = self._where[index][:, step]
        held = (where >= 0).unsqueeze(-1)
        return torch.where(held, logits[0, where.clamp(min=0)].float(), 0.0)

    def write(self, step: int, tokens: torch.Tensor) -> None:
        """Puts ``tokens`` (int64 ``[num_samples]``, drawn at ``step - 1``) where step ``step`` reads them."""
        first = 0
        for where, local in zip(self._where, self._tokens):
            count = where.shape[0]
            index = where[:, step]
            index = torch.where(index >= 0, index, local.shape[0] - 1)  # not held here: the spare slot
            local.index_put_((index,), tokens[first:first + count])
            first += count
