"""Checkpoints never hold non-finite numbers: one fused check over the tensors of a save or a load.

One NaN in Adam's moments turns the weights into NaN at the next step, and a run that saves
every iteration would then mark a checkpoint of NaN weights latest. So every floating tensor a
save would write is checked before anything is written, and every tensor a load read before the
run uses it (weights, optimizer state, the rollout engine's lagging weights).

The check reduces each tensor to its largest magnitude on its device (``vector_norm`` with
``ord=inf``: NaN propagates, Inf stays Inf, finite values stay finite, no temporary of the
tensor's size), stacks those scalars and reads them to the host once: one device-to-host read
per save or load, which also names the bad tensors without a second pass. Its cost is measured
in docs/checkpoints.md.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


def non_finite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding a NaN or an Inf, in the order given.

    Integer, boolean and empty tensors are skipped (they cannot hold either). Tensors on
    several devices cost one host read per device.
    """
    by_device: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    for name, tensor in named:
        if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
            continue
        names, peaks = by_device.setdefault(tensor.device, ([], []))
        names.append(name)
        peaks.append(torch.linalg.vector_norm(tensor.detach(), ord=float("inf")).float())
    bad = set()
    for names, peaks in by_device.values():
        finite = torch.stack(peaks).isfinite().tolist()  # the one host read
        bad.update(name for name, ok in zip(names, finite) if not ok)
    return [name for names, _ in by_device.values() for name in names if name in bad]


def sharded_tensors(sharded: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, local tensor)`` of every tensor a save of ``sharded`` writes (this rank's slices)."""
    for value in nested_values(sharded):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.Tensor):
            yield value.key, value.data


def loaded_tensors(request, loaded) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of every tensor a load returned, named by the request that asked for it.

    ``dist_checkpointing.load`` returns ``request``'s structure with each ``ShardedTensor``
    replaced by the tensor read.
    """
    if isinstance(request, ShardedTensor) and isinstance(loaded, torch.Tensor):
        yield request.key, loaded
    elif isinstance(request, dict) and isinstance(loaded, dict):
        for key, value in request.items():
            if key in loaded:
                yield from loaded_tensors(value, loaded[key])
    elif isinstance(request, (list, tuple)) and isinstance(loaded, (list, tuple)):
        for value, got in zip(request, loaded):
            yield from loaded_tensors(value, got)


def describe(names: list[str]) -> str:
    """``tensor <first>`` and how many more, for a one-line message."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"tensor {names[0]}{more}"
