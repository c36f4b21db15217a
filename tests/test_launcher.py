"""The multi-process launcher: results by rank, devices by backend, worker errors with tracebacks, timeouts."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.launcher import WorkerError, run_workers, worker_device


def sum_of_ranks(offset):
    value = torch.tensor([float(dist.get_rank() + offset)], device=worker_device())
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": value.cpu(), "device": str(value.device)}


def megatron_device():
    from megatron.core.utils import get_current_device

    return str(get_current_device())


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


def test_gloo_workers_compute_on_the_cpu():
    """Even where GPUs are visible to the parent, a gloo worker's Megatron device is the CPU."""
    assert run_workers(megatron_device, 2, backend="gloo") == ["cpu", "cpu"]


@pytest.mark.gpu
def test_nccl_workers_each_get_their_gpu():
    """NCCL workers fork from the preloaded forkserver and still initialise CUDA on their own GPU."""
    world = min(2, torch.cuda.device_count())
    results = run_workers(sum_of_ranks, world, 10, backend="nccl")
    assert [r["device"] for r in results] == [f"cuda:{rank}" for rank in range(world)]
    assert all(r["sum"].item() == sum(range(world)) + 10 * world for r in results)
    assert run_workers(megatron_device, world, backend="nccl") == [f"cuda:{rank}" for rank in range(world)]


def test_worker_exception_is_raised_with_its_traceback():
    with pytest.raises(WorkerError) as info:
        run_workers(fail_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "ValueError: rank one is broken" in message
    assert "fail_on_rank_one" in message


def test_hung_workers_time_out_with_where_each_rank_was():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="timed out") as info:
        run_workers(sleep_forever, 2, timeout=3)
    assert time.monotonic() - start < 30
    for rank in (0, 1):
        report = str(info.value).split(f"--- rank {rank} was at:\n")[1]
        assert "in sleep_forever" in report.split("--- rank")[0]
