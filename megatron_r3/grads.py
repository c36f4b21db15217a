"""Gradient reduction across ranks for model chunks without Megatron's DDP wrapper."""

from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def reduce_grads(chunks: Iterable[torch.nn.Module], config) -> None:
    """Sum gradients across ranks the way Megatron's DDP and finalize_model_grads do.

    For model chunks that are not wrapped in Megatron's ``DistributedDataParallel``
    (the layout tests, ``launch/pretrain_gpt_r3.py``), with sums: when the loss is a
    sum over tokens, the full gradient is the sum of the ranks' gradients.

    * parameters marked ``sequence_parallel`` (norms, row-parallel biases, routers)
      under SP: all-reduce over the TP group, like ``finalize_model_grads``;
    * expert parameters (``allreduce == False``): all-reduce over the expert
      data-parallel group; all others over data-parallel x context-parallel,
      like ``DistributedDataParallel``.

    Parameters without a gradient (an expert no token reached) get zeros.

    Like Megatron 0.16.1, this relies on ``allreduce``, which marks expert
    parameters only when expert-parallel size > 1. With EP = 1 and expert-TP < TP
    the TP ranks hold replicas of the experts fed with different tokens, and
    neither Megatron's DDP nor this function sums them.
    """
    chunks = list(chunks)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    expert_dp_group = parallel_state.get_expert_data_parallel_group()
    for chunk in chunks:
        for param in chunk.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if config.sequence_parallel and getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=tp_group)
            dp_group = dp_cp_group if getattr(param, "allreduce", True) else expert_dp_group
            if dist.get_world_size(dp_group) > 1:
                dist.all_reduce(param.grad, group=dp_group)
