"""DataParallelDumpShard: each data-parallel rank reads its slice of every global batch, and only that."""

import io
import itertools

import numpy as np
import pytest

from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
from megatron_r3.dataplane.formats.rollout_dump import RolloutDumpError
from megatron_r3.dataplane.formats.rollout_shards import DataParallelDumpShard
from megatron_r3.dataplane.samples import RolloutSample
from tests.support.counting_file import CountingFile


def dump_bytes(num_samples, finish=True):
    """A dump whose sample i has ``i % 5 + 1`` tokens and ``meta["i"] = i``."""
    buffer = io.BytesIO()
    writer = RolloutDumpWriter(buffer, num_experts=4, topk=2, layer_numbers=(1,))
    for i in range(num_samples):
        n = i % 5 + 1
        writer.write(RolloutSample(np.full(n, i, np.int32), np.ones(n, bool), meta={"i": i}))
    if finish:
        writer.close()
    return buffer.getvalue()


def global_batches(data, global_batch_size, iterations):
    """The global batches of a sequential, cyclic read: the reference the shards must add up to."""
    samples = itertools.cycle(s.meta["i"] for s in RolloutDumpReader(io.BytesIO(data)))
    return [[next(samples) for _ in range(global_batch_size)] for _ in range(iterations)]


@pytest.mark.parametrize("num_samples, dp_size, global_batch_size", [(7, 2, 4), (5, 3, 6), (12, 4, 4), (3, 1, 5)])
@pytest.mark.parametrize("finish", [True, False], ids=["footer", "scan"])
def test_shards_of_all_ranks_add_up_to_the_global_batches(num_samples, dp_size, global_batch_size, finish):
    data = dump_bytes(num_samples, finish)
    iterations = 2 * num_samples // global_batch_size + 2  # reads the dump more than twice: wraps around
    shards = [DataParallelDumpShard(RolloutDumpReader(io.BytesIO(data)), d, dp_size, global_batch_size)
              for d in range(dp_size)]
    for want in global_batches(data, global_batch_size, iterations):
        got = [s.meta["i"] for shard in shards for s in shard.next_batch()]
        assert got == want
    assert all(shard.consumed_samples == iterations * global_batch_size for shard in shards)


def test_each_rank_reads_only_its_records():
    data = dump_bytes(11)
    index = RolloutDumpReader(io.BytesIO(data)).index
    size = [16 + index.body_length(i) for i in range(11)]
    for dp_rank in range(3):
        f = CountingFile(data)
        shard = DataParallelDumpShard(RolloutDumpReader(f), dp_rank, 3, 6)
        for _ in range(4):
            records = shard.next_records()
            before = f.bytes_read
            batch = shard.next_batch()
            assert [s.meta["i"] for s in batch] == records
            assert f.bytes_read - before == sum(size[r] for r in records)


@pytest.mark.parametrize("finish", [True, False], ids=["footer", "scan"])
def test_resuming_from_consumed_samples_reads_what_an_uninterrupted_run_reads(finish):
    data = dump_bytes(9, finish)
    for dp_rank in range(2):
        uninterrupted = DataParallelDumpShard(RolloutDumpReader(io.BytesIO(data)), dp_rank, 2, 4)
        run = [[s.meta["i"] for s in uninterrupted.next_batch()] for _ in range(7)]
        for stop in (1, 3, 5):
            resumed = DataParallelDumpShard(RolloutDumpReader(io.BytesIO(data)), dp_rank, 2, 4,
                                            consumed_samples=stop * 4)
            assert [[s.meta["i"] for s in resumed.next_batch()] for _ in range(7 - stop)] == run[stop:]


def test_shard_errors(tmp_path):
    data = dump_bytes(4)
    with pytest.raises(ValueError, match="global batch size 5 must be a positive multiple of the data-parallel size 2"):
        DataParallelDumpShard(RolloutDumpReader(io.BytesIO(data)), 0, 2, 5)
    with pytest.raises(ValueError, match="data-parallel rank 2 is outside the data-parallel size 2"):
        DataParallelDumpShard(RolloutDumpReader(io.BytesIO(data)), 2, 2, 4)
    empty = tmp_path / "empty.r3dump"
    empty.write_bytes(dump_bytes(0))
    with pytest.raises(RolloutDumpError, match=f"rollout dump {empty} holds no samples"):
        DataParallelDumpShard(str(empty), 0, 1, 1)
