"""Moving a microbatch's routes to the GPU without stalling the host or the compute stream.

Per microbatch, :class:`RouteUploader` writes the compact routes of its samples
(ids, then one validity byte per token) and every chunk's plan into one pinned
host buffer, copies that buffer to the device with one asynchronous copy on a
side stream, and runs the gather kernel there once per model chunk. The
result, a :class:`PackedRoutes` per chunk, is what the router consumes;
:meth:`PackedRoutes.wait` orders the consumer's stream after the side stream.
Nothing in this path reads device memory from the host: no ``.item()``,
``.tolist()``, ``nonzero()``, no synchronous copies and no stream
synchronisation (the GPU tests run it under
``torch.cuda.set_sync_debug_mode("error")``).

Pinned buffers are recycled once the copy that read them has finished (an
event query, which never blocks); while every buffer is still in flight a new
one is allocated, up to ``max_buffers``. Only beyond that does the host wait
for one of those copies: back-pressure when the host runs ``max_buffers``
microbatches ahead of the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_r3.dataplane.device.packing import gather_routes
from megatron_r3.dataplane.device.plan import RoutingPlan
from megatron_r3.dataplane.routes import RolloutRoutes

_ALIGN = 256  # byte alignment of each array inside a staging buffer (vector loads need >= 16)


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


class _Staging:
    """A pinned host buffer and the event of the last copy that read it."""

    def __init__(self, nbytes: int):
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.copied: Optional[torch.cuda.Event] = None

    def free(self) -> bool:
        return self.copied is None or self.copied.query()


class RouteUploader:
    """Uploads microbatch routes on a side stream and packs them per model chunk.

    Args:
        device: Target device. On CPU the gather runs inline (C++ kernel), which
            keeps the same API for CPU tests and CPU-only runs.
        max_buffers: Pinned buffers kept in flight before reuse has to wait.
    """

    def __init__(self, device: torch.device | str, max_buffers: int = 4):
        self.device = torch.device(device)
        self.max_buffers = max_buffers
        self._buffers: list[_Staging] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def upload(self, samples: Sequence[RolloutRoutes], plans: Sequence[RoutingPlan]) -> list[PackedRoutes]:
        """Packs ``samples`` (the microbatch, in plan order) for each chunk's plan.

        Args:
            samples: The microbatch's routes; they must share experts, top-k and layers.
            plans: One plan per model chunk of this rank, all built for this microbatch.

        Returns:
            One :class:`PackedRoutes` per plan, in order. Call :meth:`PackedRoutes.wait`
            on the stream that consumes it.
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
        arrays = [(s.ids, 0) for s in samples]  # (array, group): group 0 = ids, 1 = per-token valid
        arrays += [(s.valid, 1) for s in samples]
        for plan in plans:
            arrays += [(plan.token_index, 2), (plan.layer_index, 2)]
        layout, nbytes = _layout(arrays)
        valid = np.concatenate([s.valid for s in samples])
        complete = [bool((plan.token_index >= 0).all() and valid[plan.token_index].all()) for plan in plans]

        if self._stream is None:
            staging = torch.empty(nbytes, dtype=torch.uint8)
            _fill(staging.numpy(), arrays, layout)
            return self._pack(staging, head, num_tokens, plans, layout, len(samples), complete)

        slot = self._take(nbytes)
        _fill(slot.host.numpy(), arrays, layout)
        with torch.cuda.stream(self._stream):
            device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            device_bytes.copy_(slot.host[:nbytes], non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self._stream)
            packed = self._pack(device_bytes, head, num_tokens, plans, layout, len(samples), complete)
            done = torch.cuda.Event()
            done.record(self._stream)
        for p in packed:
            p.ready = done
        return packed

    def _take(self, nbytes: int) -> _Staging:
        for slot in self._buffers:
            if slot.free() and slot.host.numel() >= nbytes:
                return slot
        if len(self._buffers) >= self.max_buffers:
            # Bound pinned memory: drop the smallest idle buffer or, all busy, wait for the first one.
            idle = [s for s in self._buffers if s.free()]
            victim = min(idle, key=lambda s: s.host.numel()) if idle else self._buffers[0]
            if not idle:
                victim.copied.synchronize()  # only when max_buffers copies are all still in flight
            self._buffers.remove(victim)
        slot = _Staging(max(nbytes, 1 << 20))
        self._buffers.append(slot)
        return slot

    @staticmethod
    def _pack(buffer, head, num_tokens, plans, layout, num_samples, complete) -> list[PackedRoutes]:
        ids_dtype = torch.uint8 if head.ids.dtype == np.uint8 else torch.int16
        ids_start = layout[0][0]
        valid_start = layout[num_samples][0]
        ids = buffer[ids_start : ids_start + head.ids.itemsize * num_tokens * head.num_layers * head.topk]
        ids = ids.view(ids_dtype).view(num_tokens, head.num_layers, head.topk)
        valid = buffer[valid_start : valid_start + num_tokens].view(torch.bool)  # one byte per token
        out = []
        for i, plan in enumerate(plans):
            tok_at, _ = layout[2 * num_samples + 2 * i]
            lay_at, _ = layout[2 * num_samples + 2 * i + 1]
            tok = buffer[tok_at : tok_at + 4 * plan.num_local_tokens].view(torch.int32)
            lay = buffer[lay_at : lay_at + 4 * plan.num_local_layers].view(torch.int32)
            out.append(PackedRoutes(gather_routes(ids, valid, tok, lay), plan.layer_numbers, complete[i]))
        return out


def _layout(arrays) -> tuple[list[tuple[int, int]], int]:
    """Byte offsets of each array in the staging buffer: ids, then valid, of all samples
    contiguous (they form the [N, L, K] / [N] packing source), then each plan's maps.

    Each group and each map starts on an ``_ALIGN`` boundary (the kernel's vector loads);
    inside a group the samples are back to back, one valid byte per token."""
    layout, offset, group = [], 0, None
    for array, g in arrays:
        if g != group or g == 2:
            offset = -(-offset // _ALIGN) * _ALIGN
            group = g
        layout.append((offset, array.nbytes))
        offset += array.nbytes
    return layout, max(offset, 1)


def _fill(host: np.ndarray, arrays, layout) -> None:
    for (array, _), (offset, nbytes) in zip(arrays, layout):
        host[offset : offset + nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
