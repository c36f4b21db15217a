"""A process group backend for a world of one rank, where every collective is a copy or nothing.

In a world of one rank every group Megatron builds has that one rank, and every
collective's result is its input: an all-reduce changes nothing, an all-gather or a
reduce-scatter copies its input to its output. NCCL still creates a communicator for
each group that first communicates and destroys each at exit, about half a second
each on an H100 (docs/benchmarks.md): a one-GPU run pays for talking to itself.

The ``single_rank`` backend does the collectives' work in place, on the caller's
stream, and hands back a finished ``Work``. Object collectives run on the CPU, as
they do with gloo. Point-to-point operations raise: there is no peer.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "single_rank"

# Reductions over one rank's values that give those values back (not PREMUL_SUM: it scales).
_IDENTITY_REDUCTIONS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN,
                        dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)


def _done(result=None) -> dist.Work:
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _check_reduction(opts) -> None:
    if opts is not None and not any(opts.reduceOp == op for op in _IDENTITY_REDUCTIONS):
        raise ValueError(f"the {BACKEND} process group does not reduce with {opts.reduceOp}")


def _copy(outputs, inputs) -> None:
    for output, input_ in zip(outputs, inputs, strict=True):
        if output.data_ptr() != input_.data_ptr():
            output.copy_(input_)


class SingleRankGroup(dist.ProcessGroup):
    """Every collective over a group of one rank (``torch.distributed``'s backend interface)."""

    def __init__(self, rank: int, size: int):
        if size != 1:
            raise ValueError(f"the {BACKEND} process group has one rank, not {size}")
        super().__init__(rank, size)

    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors, opts=None):
        _check_reduction(opts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        _check_reduction(opts)
        return _done(tensors)

    def reduce(self, tensors, opts=None):
        _check_reduction(opts)
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def barrier(self, opts=None):
        return _done()

    def allgather(self, output_lists, inputs, opts=None):
        _copy([outputs[0] for outputs in output_lists], inputs)
        return _done(output_lists)

    def all_gather_single(self, output, input_, opts=None):
        _copy([output], [input_])
        return _done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        _copy(outputs, inputs)
        return _done(outputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        _copy([outputs[0] for outputs in output_lists], inputs)
        return _done(output_lists)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        _check_reduction(opts)
        _copy(outputs, [inputs[0] for inputs in input_lists])
        return _done(outputs)

    def reduce_scatter_single(self, output, input_, opts=None):
        _check_reduction(opts)
        _copy([output], [input_])
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        _check_reduction(opts)
        _copy(outputs, inputs)
        return _done(outputs)

    def gather(self, output_lists, inputs, opts=None):
        _copy([outputs[0] for outputs in output_lists], inputs)
        return _done(output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        _copy(outputs, [inputs[0] for inputs in input_lists])
        return _done(outputs)

    def alltoall(self, outputs, inputs, opts=None):
        _copy(outputs, inputs)
        return _done(outputs)

    def all_to_all_single(self, output, input_, output_split_sizes, input_split_sizes, opts=None):
        _copy([output], [input_])
        return _done([output])

    # The names torch releases before 2.12 call.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    def send(self, tensors, dst, tag=0):
        raise RuntimeError(f"the {BACKEND} process group has no rank {dst} to send to")

    def recv(self, tensors, src, tag=0):
        raise RuntimeError(f"the {BACKEND} process group has no rank {src} to receive from")

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError(f"the {BACKEND} process group has no other rank to receive from")


def _create(store, rank: int, size: int, timeout) -> SingleRankGroup:
    return SingleRankGroup(rank, size)


def register() -> None:
    """Makes ``single_rank`` a ``torch.distributed`` backend (once per process)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])

