"""A data-parallel rank's share of a rollout dump, read without touching the other ranks' records.

Iteration ``i`` (0-based) trains on the global batch of samples
``[i*G, (i+1)*G)`` of the dump read cyclically (sample position ``p`` is record
``p % N``: the dump is read again from the start when it runs out). Data-parallel
rank ``d`` of ``D`` takes the contiguous slice ``[d*G/D, (d+1)*G/D)`` of each
global batch and reads only those records, each with one seek through the
dump's index (:attr:`RolloutDumpReader.index`). The slice is contiguous in the
file but where it wraps, so a rank's reads run forward.

The position is one number, the samples consumed by all ranks together
(``consumed_samples``, what a checkpoint stores): a shard built from it reads
exactly what an uninterrupted run reads next.
"""

from __future__ import annotations

from typing import Union

from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.rollout_dump import RolloutDumpError
from megatron_r3.dataplane.samples import RolloutSample


class DataParallelDumpShard:
    """Reads one data-parallel rank's slice of every global batch of a rollout dump.

    Args:
        dump: Path of the dump, or an open reader (which the shard then does not close).
        dp_rank: This rank's data-parallel rank ``d``.
        dp_size: The data-parallel size ``D``.
        global_batch_size: Samples per iteration over all ranks ``G``, a multiple of ``D``.
        consumed_samples: Samples all ranks have trained on before (a checkpoint's position).

    Raises:
        ValueError: sizes that do not split; RolloutDumpError: the dump holds no samples.
    """

    def __init__(
        self,
        dump: Union[str, RolloutDumpReader],
        dp_rank: int,
        dp_size: int,
        global_batch_size: int,
        consumed_samples: int = 0,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is outside the data-parallel size {dp_size}")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ValueError(f"global batch size {global_batch_size} must be a positive multiple of the "
                             f"data-parallel size {dp_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed samples must be >= 0, got {consumed_samples}")
        self._owns = not isinstance(dump, RolloutDumpReader)
        self.reader = RolloutDumpReader(dump) if self._owns else dump
        self.num_samples = len(self.reader)
        if self.num_samples == 0:
            self.close()
            raise RolloutDumpError(f"rollout dump {self.reader.name} holds no samples")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch_size = global_batch_size
        self.samples_per_rank = global_batch_size // dp_size
        self._consumed = consumed_samples

    @property
    def consumed_samples(self) -> int:
        """Samples all ranks have trained on: where the next global batch starts."""
        return self._consumed

    def next_records(self) -> list[int]:
        """The record numbers of this rank's part of the next global batch, in order."""
        first = self._consumed + self.dp_rank * self.samples_per_rank
        return [p % self.num_samples for p in range(first, first + self.samples_per_rank)]

    def next_batch(self) -> list[RolloutSample]:
        """This rank's samples of the next global batch; then the position moves by a global batch."""
        batch = [self.reader.read(record) for record in self.next_records()]
        self._consumed += self.global_batch_size
        return batch

    def close(self) -> None:
        if self._owns:
            self.reader.close()

    def __enter__(self) -> "DataParallelDumpShard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
