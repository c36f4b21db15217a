"""Moving a microbatch's routes to the GPU without stalling the host or the compute stream.

:func:`stage_routes` writes, on the host, the compact routes of a microbatch's samples
(ids, then one validity byte per token) and every chunk's plan into one byte buffer, pinned
when the routes go to a GPU (:class:`HostStaging`); the batch plan does it once per batch,
before the passes (:mod:`megatron_r3.dataplane.device.batch_plan`). Per pass,
:meth:`RouteUploader.upload_staged` copies that buffer to the device with one asynchronous
copy on a side stream and runs the gather kernel there once per model chunk. The result, a
:class:`PackedRoutes` per chunk, is what the router consumes; :meth:`PackedRoutes.wait`
orders the consumer's stream after the side stream. Nothing in this path reads device
memory from the host: no ``.item()``, ``.tolist()``, ``nonzero()``, no synchronous copies
and no stream synchronisation (the GPU tests run it under
``torch.cuda.set_sync_debug_mode("error")``).

Pinned buffers come from torch's caching host allocator, which reuses a buffer once the
copies that read it have finished (an event query, which never blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_r3.dataplane.device.packing import gather_routes
from megatron_r3.dataplane.device.plan import RoutingPlan
from megatron_r3.dataplane.routes import RolloutRoutes

_ALIGN = 256  # byte alignment of each array inside a staging buffer


@dataclass
class PackedRoutes:
    """One model chunk's replay input for one microbatch.

    Attributes:
        expert_ids: int64 ``[len(layer_numbers), num_local_tokens, topk]`` on the
            device, in router token order; a row of -1 means "no route".
        layer_numbers: The chunk's MoE layer numbers (1-based, increasing), one per dim-0 row.
        every_token_routed: No row is -1, as known on the host: the routers need no live top-k.
    """

    expert_ids: torch.Tensor
    layer_numbers: tuple[int, ...]
    every_token_routed: bool = False
    ready: Optional[torch.cuda.Event] = None

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> torch.Tensor:
        """Makes ``stream`` (default: current) wait for the upload; returns ``expert_ids``.

        A device-side wait only: the host does not block.
        """
        if self.ready is not None:
            stream = stream or torch.cuda.current_stream(self.expert_ids.device)
            stream.wait_event(self.ready)
            # The tensor was allocated on the side stream; tell the allocator it is used here too.
            self.expert_ids.record_stream(stream)
        return self.expert_ids


class HostStaging:
    """Host arrays laid out in one byte buffer, to reach a device in one copy.

    Args:
        fields: ``(name, numpy dtype, shape)`` of each array, in order; each starts on a
            256-byte boundary (the gather kernel's vector loads need 16).
        pinned: Page-locked memory, which an asynchronous copy to a GPU needs.

    Attributes:
        data: The uint8 buffer.
    """

    def __init__(self, fields: Sequence[tuple[str, np.dtype, tuple[int, ...]]], pinned: bool):
        self._fields: dict[str, tuple[int, np.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for name, dtype, shape in fields:
            offset = -(-offset // _ALIGN) * _ALIGN
            dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
            nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            self._fields[name] = (offset, dtype, shape, nbytes)
            offset += nbytes
        self.data = torch.empty(max(offset, 1), dtype=torch.uint8, pin_memory=pinned)
        self._bytes = self.data.numpy()

    def host(self, name: str) -> np.ndarray:
        """The writable host view of array ``name``."""
        offset, dtype, shape, nbytes = self._fields[name]
        return self._bytes[offset:offset + nbytes].view(dtype).reshape(shape)

    def views(self, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every array as a view of ``data``, a copy of :attr:`data` (on any device)."""
        out = {}
        for name, (offset, dtype, shape, nbytes) in self._fields.items():
            out[name] = data[offset:offset + nbytes].view(_torch_dtype(dtype)).view(shape)
        return out


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


@dataclass
class StagedRoutes:
    """A microbatch's routes and its chunks' plans, staged on the host (:func:`stage_routes`).

    Attributes:
        staging: ``ids [N, L, K]``, ``valid [N]`` (the packing source) and each plan's
            ``token_index``/``layer_index`` (``tokens{i}``, ``layers{i}``).
        plans: One plan per model chunk.
        complete: Per plan: every token it routes has a route (no live top-k needed).
    """

    staging: HostStaging
    plans: list[RoutingPlan]
    complete: list[bool]

    @property
    def ids(self) -> np.ndarray:
        """The packing source's ids ``[N, L, K]`` on the host."""
        return self.staging.host("ids")

    @property
    def valid(self) -> np.ndarray:
        """The packing source's per-token validity ``[N]`` on the host."""
        return self.staging.host("valid")

    def pack(self, data: torch.Tensor) -> list[PackedRoutes]:
        """Each chunk's ``expert_ids`` gathered from ``data``, a copy of the staging buffer (one kernel per chunk)."""
        views = self.staging.views(data)
        return [PackedRoutes(gather_routes(views["ids"], views["valid"], views[f"tokens{i}"], views[f"layers{i}"]),
                             plan.layer_numbers, complete)
                for i, (plan, complete) in enumerate(zip(self.plans, self.complete))]


def stage_routes(samples: Sequence[RolloutRoutes], plans: Sequence[RoutingPlan], pinned: bool) -> StagedRoutes:
    """Writes a microbatch's routes (its samples, in plan order) and each chunk's plan into one host buffer.

    Args:
        samples: The microbatch's routes; they must share experts, top-k and layers.
        plans: One plan per model chunk of this rank, all built for this microbatch.
        pinned: Page-locked memory (for a GPU).
    """
    if not samples:
        raise ValueError("a microbatch needs at least one sample")
    head = samples[0]
    num_tokens = sum(s.num_tokens for s in samples)
    for i, s in enumerate(samples):
        if (s.num_experts, s.topk, s.layer_numbers) != (head.num_experts, head.topk, head.layer_numbers):
            raise ValueError(f"sample {i}: routes do not share experts/top-k/layers with sample 0")
    for plan in plans:
        if plan.num_source_tokens != num_tokens or plan.num_source_layers != head.num_layers:
            raise ValueError(
                f"plan expects {plan.num_source_tokens} tokens x {plan.num_source_layers} layers, the "
                f"samples hold {num_tokens} x {head.num_layers}"
            )
    fields = [("ids", head.ids.dtype, (num_tokens, head.num_layers, head.topk)), ("valid", np.bool_, (num_tokens,))]
    for i, plan in enumerate(plans):
        fields += [(f"tokens{i}", np.int32, (plan.num_local_tokens,)), (f"layers{i}", np.int32, (plan.num_local_layers,))]
    staging = HostStaging(fields, pinned)
    np.concatenate([s.ids for s in samples], out=staging.host("ids"))
    valid = staging.host("valid")
    np.concatenate([s.valid for s in samples], out=valid)
    for i, plan in enumerate(plans):
        staging.host(f"tokens{i}")[:] = plan.token_index
        staging.host(f"layers{i}")[:] = plan.layer_index
    complete = [bool((plan.token_index >= 0).all() and valid[plan.token_index].all()) for plan in plans]
    return StagedRoutes(staging, list(plans), complete)


class RouteUploader:
    """Uploads staged microbatch routes on a side stream and packs them per model chunk.

    Args:
        device: Target device. On CPU the gather runs inline (C++ kernel), which
            keeps the same API for CPU tests and CPU-only runs.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def pinned(self) -> bool:
        """Whether staged routes for this device go in pinned memory (:func:`stage_routes`)."""
        return self._stream is not None

    def upload(self, samples: Sequence[RolloutRoutes], plans: Sequence[RoutingPlan]) -> list[PackedRoutes]:
        """Stages ``samples`` (the microbatch, in plan order) and packs them for each chunk's plan.

        Returns:
            One :class:`PackedRoutes` per plan, in order. Call :meth:`PackedRoutes.wait`
            on the stream that consumes it.
        """
        return self.upload_staged(stage_routes(samples, plans, self.pinned))

    def upload_staged(self, staged: StagedRoutes) -> list[PackedRoutes]:
        """One copy of the staged buffer to the device and one gather per chunk, on the side stream.

        The staged buffer is only read: a batch's routes are staged once and uploaded by every pass.
        """
        if self._stream is None:
            return staged.pack(staged.staging.data)
        with torch.cuda.stream(self._stream):
            packed = staged.pack(staged.staging.data.to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self._stream)
        for p in packed:
            p.ready = done
        return packed
