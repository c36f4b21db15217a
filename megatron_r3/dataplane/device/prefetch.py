"""A step's microbatches, each prepared once and one ahead of its use, for every model chunk.

Megatron's schedules call ``config.microbatch_prefetch_func`` as soon as a microbatch's
forward has been issued (patch "pipeline_parallel: schedules call
config.microbatch_prefetch_func after each forward"). :meth:`PreparedMicrobatches.prefetch`
is that callable: it prepares the microbatch after the last one any chunk has taken (host
packing, route upload on a side stream, the exchange of host split sizes), so the host
prepares microbatch i + 1 while the device runs microbatch i, and a forward step never waits
for its routes, except the step's very first microbatch. Preparation covers every model chunk
of the rank at once (one upload and one exchange per microbatch, not per chunk), so under
interleaved 1F1B a microbatch is ready for all chunks once any chunk asked for it.

The hook is a config callable, not a method of the data iterator, so it works whatever wraps
the iterators (Megatron-LM's training loop wraps them in ``RerunDataIterator``). Use
:meth:`PreparedMicrobatches.installed` around the schedule call.

Preparation may include collectives (the exchange of split sizes): every rank of a group
runs the same schedule, so they prepare microbatches in the same order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence


class PreparedMicrobatches:
    """Prepares microbatch ``i`` (for all chunks) once, when first asked, and hands it out.

    Args:
        num_microbatches: Microbatches in the step.
        prepare: ``prepare(i)`` returns one item per model chunk for microbatch ``i``.
        num_chunks: Model chunks on this rank (one data iterator each).
        seq_length: The sequence length of every microbatch, for the schedule's p2p shapes.

    Attributes:
        prepared_on_demand: Microbatches a forward step had to prepare itself, because no
            prefetch had asked for them first (the step's first one).
    """

    def __init__(self, num_microbatches: int, prepare: Callable[[int], Sequence[Any]], num_chunks: int = 1,
                 seq_length: Optional[int] = None):
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.seq_length = seq_length
        self.prepared_on_demand = 0
        self._prepare = prepare
        self._items: dict[int, list] = {}  # microbatch -> per chunk, None once handed out
        self._next_new = 0  # the first microbatch no chunk has taken yet
        self._iterators = [_ChunkIterator(self, chunk) for chunk in range(num_chunks)]

    @classmethod
    def of(cls, items: Sequence[Sequence[Any]], seq_length: Optional[int] = None) -> "PreparedMicrobatches":
        """A pass over microbatches prepared already (:meth:`all_items`), e.g. the same rows run again."""
        return cls(len(items), items.__getitem__, len(items[0]), seq_length)

    def all_items(self) -> list[list]:
        """Every microbatch's items (one per chunk), prepared now and handed to no chunk."""
        return [list(self._prepare(index)) for index in range(self.num_microbatches)]

    def iterators(self) -> list["_ChunkIterator"]:
        """One data iterator per model chunk, in ``vp_stage`` order."""
        return list(self._iterators)

    def data_iterator(self):
        """``get_forward_backward_func``'s ``data_iterator``: the iterator, or a list with VP."""
        return self._iterators[0] if self.num_chunks == 1 else self.iterators()

    def prefetch(self, microbatch_id: Optional[int] = None, vp_stage: Optional[int] = None) -> None:
        """Prepare the next microbatch no chunk has taken yet (the schedules' prefetch hook).

        Args:
            microbatch_id: The schedule's index of the microbatch whose forward was issued;
                under interleaved 1F1B other chunks may have taken later ones, so the next
                one is counted here, over all chunks.
            vp_stage: That forward's model chunk.
        """
        self._ensure(self._next_new)

    @contextlib.contextmanager
    def installed(self, config):
        """Install :meth:`prefetch` as ``config.microbatch_prefetch_func`` for the schedule call."""
        previous = config.microbatch_prefetch_func
        config.microbatch_prefetch_func = self.prefetch
        try:
            yield self
        finally:
            config.microbatch_prefetch_func = previous

    def _ensure(self, index: int) -> None:
        if index < self.num_microbatches and index not in self._items:
            items = list(self._prepare(index))
            if len(items) != self.num_chunks:
                raise ValueError(f"prepare({index}) returned {len(items)} items for {self.num_chunks} chunks")
            self._items[index] = items

    def _take(self, index: int, chunk: int):
        if index >= self.num_microbatches:
            raise StopIteration
        if index not in self._items:
            if index < self._next_new:
                raise RuntimeError(f"microbatch {index} was already taken on chunk {chunk}")
            self.prepared_on_demand += 1
            self._ensure(index)
        items = self._items[index]
        item, items[chunk] = items[chunk], None
        if item is None:
            raise RuntimeError(f"microbatch {index} was already taken on chunk {chunk}")
        self._next_new = max(self._next_new, index + 1)
        if all(i is None for i in items):
            del self._items[index]  # every chunk has it: drop it (its device buffers with it)
        return item


class _ChunkIterator:
    """One model chunk's data iterator: microbatch 0, 1, ... of the step."""

    def __init__(self, owner: PreparedMicrobatches, chunk: int):
        self._owner = owner
        self._chunk = chunk
        self._position = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = self._owner._take(self._position, self._chunk)
        self._position += 1
        return item
