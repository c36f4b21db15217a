"""A step's microbatches, each prepared once and one ahead of its use, for every model chunk.

Megatron's schedules call ``prefetch_next()`` on the data iterator a forward step drew
from as soon as that microbatch's forward has been issued (patch "pipeline_parallel:
schedules let the data iterator prefetch the next microbatch"). The iterators here
answer by preparing the next microbatch: host packing, route upload on a side stream,
the exchange of host split sizes. Preparation covers every model chunk of the rank at
once (one upload and one exchange per microbatch, not per chunk), so under interleaved
1F1B a microbatch is ready for all chunks once any chunk asked for it. The host thus
prepares microbatch i + 1 while the device runs microbatch i, and a forward step never
waits for its routes, except the step's very first microbatch.

Preparation may include collectives (the exchange of split sizes): every rank of a
group runs the same schedule, so they prepare microbatches in the same order.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class PreparedMicrobatches:
    """Prepares microbatch ``i`` (for all chunks) once, when first asked, and hands it out.

    Args:
        num_microbatches: Microbatches in the step.
        prepare: ``prepare(i)`` returns one item per model chunk for microbatch ``i``.
        num_chunks: Model chunks on this rank (one data iterator each).

    Attributes:
        prepared_on_demand: Microbatches a forward step had to prepare itself, because no
            prefetch had asked for them first (the step's first one).
    """

    def __init__(self, num_microbatches: int, prepare: Callable[[int], Sequence[Any]], num_chunks: int = 1):
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.prepared_on_demand = 0
        self._prepare = prepare
        self._items: dict[int, list] = {}  # microbatch -> per chunk, None once handed out
        self._iterators = [_ChunkIterator(self, chunk) for chunk in range(num_chunks)]

    def iterators(self) -> list["_ChunkIterator"]:
        """One data iterator per model chunk, in ``vp_stage`` order."""
        return list(self._iterators)

    def data_iterator(self):
        """``get_forward_backward_func``'s ``data_iterator``: the iterator, or a list with VP."""
        return self._iterators[0] if self.num_chunks == 1 else self.iterators()

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
            self.prepared_on_demand += 1
            self._ensure(index)
        items = self._items[index]
        item, items[chunk] = items[chunk], None
        if item is None:
            raise RuntimeError(f"microbatch {index} was already taken on chunk {chunk}")
        if all(i is None for i in items):
            del self._items[index]  # every chunk has it: drop it (its device buffers with it)
        return item


class _ChunkIterator:
    """One model chunk's data iterator; ``prefetch_next`` is what the schedules call."""

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

    def prefetch_next(self) -> None:
        """Prepare the microbatch the next ``next()`` returns (all chunks' parts), if any."""
        self._owner._ensure(self._position)
