"""Room for a checkpoint: its size from the model and the optimizer, checked before the first iteration.

A write probe passes on a full disk (an empty file needs no space), so a run would train for
hours and then die in its first save. :func:`checkpoint_bytes` gives what one save writes, from
the model chunks a checkpoint holds and the optimizer, without writing anything:

* every tensor of the models' sharded state this rank writes (its main replicas: a tensor
  replicated over data-parallel ranks is written once), at its dtype's size;
* Adam's two moments per trained element, fp32, and fp32 main weights where the optimizer
  keeps them apart from the model's (the distributed optimizer, bf16 parameters);
* per tensor :data:`BYTES_PER_TENSOR` for its serialised header and its metadata entry
  (``torch_dist`` wraps every tensor; measured about 3.3 KiB per tensor on the default model).

On a filesystem that all ranks share (the usual case), every rank checks the sum over all
ranks against the free space it sees.
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

from megatron_r3.rl.checkpoint.checkpointing import models_sharded_state_dict

BYTES_PER_TENSOR = 4096
"""Bytes a ``torch_dist`` checkpoint spends per tensor beyond its data (an upper bound)."""


def checkpoint_bytes(models: Mapping[str, Sequence[torch.nn.Module]], optimizer: Optional[MegatronOptimizer]) -> int:
    """Bytes one save of ``models`` and ``optimizer`` writes, over all ranks; call it on every rank."""
    data, tensors, trained = 0, 0, 0
    for name, state in models_sharded_state_dict(models).items():
        for tensor in nested_values(state):
            if isinstance(tensor, ShardedTensor) and is_main_replica(tensor.replica_id):
                size = tensor.data.numel() if tensor.data is not None else _numel(tensor.local_shape)
                data += size * tensor.dtype.itemsize
                tensors += 1
                if name.startswith("model"):  # "model", "model0", ...: the chunks the optimizer trains
                    trained += size
                    tensors += 0 if optimizer is None else _optimizer_tensors_per_parameter(optimizer)
    if optimizer is not None:
        data += trained * 4 * _optimizer_tensors_per_parameter(optimizer)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, data + tensors * BYTES_PER_TENSOR)  # host numbers, under any backend
    return sum(gathered)


def space_problem(directory: str, needed: int) -> Optional[str]:
    """Why ``directory`` (or the folder above it a save would create it in) cannot hold ``needed`` bytes."""
    target = os.path.abspath(directory)
    while not os.path.exists(target):
        target = os.path.dirname(target)
    free = shutil.disk_usage(target).free
    if free >= needed:
        return None
    return (f"one checkpoint needs about {_size(needed)} ({needed} bytes: the models' weights and the optimizer's "
            f"state), the filesystem of {target} has {_size(free)} ({free} bytes) free")


def _optimizer_tensors_per_parameter(optimizer: MegatronOptimizer) -> int:
    """Adam's fp32 tensors per trained tensor in a checkpoint: two moments, and main weights where kept apart."""
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    separate_main = any(isinstance(m, (DistributedOptimizer, Float16OptimizerWithFloat16Params)) for m in members)
    return 3 if separate_main else 2


def _numel(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1."""
    value, unit = float(n), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.1f} {unit}"
