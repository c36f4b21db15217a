"""The multi-process launcher: results by rank, worker errors with tracebacks, timeouts."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.launcher import WorkerError, run_workers, worker_device


def sum_of_ranks(offset):
    value = torch.tensor([float(dist.get_rank() + offset)], device=worker_device())
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": value.cpu()}


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # left waiting for its failed peer


def sleep_forever():
    time.sleep(600)


def test_results_come_back_by_rank():
    results = run_workers(sum_of_ranks, 3, 10)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"].item() == 33 for r in results)


def test_worker_exception_is_raised_with_its_traceback():
    with pytest.raises(WorkerError) as info:
        run_workers(fail_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "ValueError: rank one is broken" in message
    assert "fail_on_rank_one" in message


def test_hung_workers_time_out():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="timed out"):
        run_workers(sleep_forever, 2, timeout=3)
    assert time.monotonic() - start < 30
