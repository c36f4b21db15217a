"""Sequence-parallel all-gather and reduce-scatter with uneven split sizes (patch: uneven
all-gather through padding on gloo).

Expert-TP > 1 with the alltoall dispatcher gathers and reduce-scatters parts of
different lengths over the expert-TP group. Gloo's all-gather wants one shape on
every rank, so the patched ``_gather_along_first_dim`` pads the parts to the largest
one there; NCCL keeps the uneven list all-gather. Each rank's output and input
gradient must equal a single-process computation of the same parts exactly: the
values are small integers, so sums in any order are exact.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from tests.support.launcher import run_workers, worker_device

pytestmark = pytest.mark.slow

ROW_SHAPE = (3, 2)


def _random_uneven_sizes(world_size: int, count: int, seed: int) -> list[list[int]]:
    """``count`` uneven size lists, each with one empty part at a random rank."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    while len(cases) < count:
        sizes = torch.randint(1, 7, (world_size,), generator=gen)
        sizes[torch.randint(world_size, (1,), generator=gen)] = 0
        if len(set(sizes.tolist())) > 1:
            cases.append(sizes.tolist())
    return cases


GLOO_CASES = [
    [5, 0, 3],
    [0, 4, 4],  # the largest part on two ranks: they send it unpadded
    [2, 2, 2],  # even: the plain list all-gather
    [0, 0, 0],
] + _random_uneven_sizes(3, 3, seed=5)
NCCL_CASES = [[3, 0], [0, 5], [4, 4]] + _random_uneven_sizes(2, 2, seed=6)


def _case_tensors(case: int, sizes: list[int]) -> dict[str, list[torch.Tensor]]:
    """Every rank's inputs and upstream gradients for one case, small integer values."""
    gen = torch.Generator().manual_seed(1000 + case)
    total = sum(sizes)

    def ints(rows):
        return torch.randint(-8, 9, (rows, *ROW_SHAPE), generator=gen).float()

    return {
        "gather_in": [ints(rows) for rows in sizes],
        "gather_grad": [ints(total) for _ in sizes],
        "reduce_scatter_in": [ints(total) for _ in sizes],
        "reduce_scatter_grad": [ints(rows) for rows in sizes],
    }


def _gather_and_reduce_scatter(cases: list[list[int]], use_global_buffer: bool) -> list[dict]:
    """Worker: both collectives over Megatron's TP group (all ranks), forward and backward."""
    world_size = dist.get_world_size()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=world_size, create_gloo_process_groups=False
    )
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        rank, device = dist.get_rank(), worker_device()
        results = []
        for case, sizes in enumerate(cases):
            data = {k: v[rank].to(device) for k, v in _case_tensors(case, sizes).items()}
            result = {}

            gather_in = data["gather_in"].requires_grad_()
            gathered = gather_from_sequence_parallel_region(
                gather_in, group=group, output_split_sizes=sizes,
                use_global_buffer=use_global_buffer,
            )
            # A global buffer is reused by the next collective: copy what it holds.
            result["gathered"] = gathered.detach().cpu().clone()
            gathered.backward(data["gather_grad"])
            result["gather_in_grad"] = gather_in.grad.cpu().clone()

            reduce_scatter_in = data["reduce_scatter_in"].requires_grad_()
            scattered = reduce_scatter_to_sequence_parallel_region(
                reduce_scatter_in, group=group, input_split_sizes=sizes,
                use_global_buffer=use_global_buffer,
            )
            result["scattered"] = scattered.detach().cpu().clone()
            scattered.backward(data["reduce_scatter_grad"])
            result["reduce_scatter_in_grad"] = reduce_scatter_in.grad.cpu().clone()
            results.append(result)
        return results
    finally:
        parallel_state.destroy_model_parallel()


def _single_process(case: int, sizes: list[int]) -> list[dict]:
    """What each rank must get: the same collectives as plain tensor algebra, with autograd."""
    data = _case_tensors(case, sizes)
    gather_in = [t.clone().requires_grad_() for t in data["gather_in"]]
    gathered = torch.cat(gather_in)
    # Every rank's output is the concatenation; the gradients of all ranks' outputs add up.
    torch.autograd.backward([gathered] * len(sizes), data["gather_grad"])
    reduce_scatter_in = [t.clone().requires_grad_() for t in data["reduce_scatter_in"]]
    scattered = torch.stack(reduce_scatter_in).sum(0).split(sizes)
    torch.autograd.backward(list(scattered), data["reduce_scatter_grad"])
    return [
        {
            "gathered": gathered.detach(),
            "gather_in_grad": gather_in[rank].grad,
            "scattered": scattered[rank].detach(),
            "reduce_scatter_in_grad": reduce_scatter_in[rank].grad,
        }
        for rank in range(len(sizes))
    ]


def _assert_match_single_process(cases, per_rank):
    for case, sizes in enumerate(cases):
        expected = _single_process(case, sizes)
        for rank, results in enumerate(per_rank):
            for key, want in expected[rank].items():
                got = results[case][key]
                assert got.shape == want.shape and torch.equal(got, want), (
                    f"sizes {sizes}, rank {rank}: {key} differs from the single-process result"
                )


@pytest.mark.parametrize("use_global_buffer", [False, True], ids=["fresh", "global-buffer"])
def test_uneven_gather_and_reduce_scatter_on_gloo(use_global_buffer):
    """Gloo: uneven all-gathers go through padding, forward and in the reduce-scatter's backward."""
    per_rank = run_workers(
        _gather_and_reduce_scatter, 3, GLOO_CASES, use_global_buffer, backend="gloo"
    )
    _assert_match_single_process(GLOO_CASES, per_rank)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_uneven_gather_and_reduce_scatter_on_nccl():
    """NCCL keeps the uneven list all-gather; same results."""
    per_rank = run_workers(_gather_and_reduce_scatter, 2, NCCL_CASES, False, backend="nccl")
    _assert_match_single_process(NCCL_CASES, per_rank)
