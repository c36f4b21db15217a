"""Where an iteration's time goes: the rollout, each training pass, the optimizer step.

:class:`PhaseTimer` times named phases of an iteration in wall time, waiting for the
device at each phase's end so that a phase is charged with its own kernels (a few
syncs per iteration, none inside a pass). With ``count_host_syncs`` it also counts
the host syncs inside each phase (:mod:`megatron_r3.rl.profiling.host_syncs`), for diagnosis.
"""

from __future__ import annotations

import contextlib
import time

import torch

from megatron_r3.rl.profiling.host_syncs import counted_host_syncs


class PhaseTimer:
    """Seconds (and, on request, host syncs) per phase of the current iteration.

    Args:
        device: The device the phases run on (CUDA work is waited for at phase ends).
        count_host_syncs: Also count host syncs per phase.
    """

    def __init__(self, device: torch.device, count_host_syncs: bool = False):
        self.device = torch.device(device)
        self.count_host_syncs = count_host_syncs
        self.seconds: dict[str, float] = {}
        self.host_syncs: dict[str, int] = {}

    def reset(self) -> None:
        """Start a new iteration."""
        self.seconds.clear()
        self.host_syncs.clear()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Times the block as phase ``name`` (phases of one name add up)."""
        self._wait_for_device()
        start = time.perf_counter()
        counts: dict = {}
        with counted_host_syncs(counts) if self.count_host_syncs else contextlib.nullcontext():
            yield
        self._wait_for_device()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        if self.count_host_syncs:
            self.host_syncs[name] = self.host_syncs.get(name, 0) + counts["sync_debug"] + counts["waits"]

    def _wait_for_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
