"""Megatron-LM's ``--profile``: a profiler over a range of iterations on chosen ranks.

With ``--use-pytorch-profiler`` the PyTorch profiler records iterations
``[--profile-step-start, --profile-step-end)`` (CPU and CUDA activity) and the rank
prints its busiest operators, by host time and by device time; with
``--tensorboard-dir`` it also writes a Chrome trace there. Without it, the range is
marked for an outside profiler (``nsys profile --capture-range=cudaProfilerApi``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

TABLE_ROWS = 25


def add_profiling_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's profiling flags."""
    group = parser.add_argument_group("profiling")
    group.add_argument("--profile", action="store_true", help="profile iterations [--profile-step-start, "
                                                              "--profile-step-end) on --profile-ranks")
    group.add_argument("--profile-step-start", type=int, default=10, help="first iteration profiled")
    group.add_argument("--profile-step-end", type=int, default=12, help="first iteration after the profiled ones")
    group.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks that profile")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="the PyTorch profiler (operator tables on the log, a Chrome trace in --tensorboard-dir) "
                            "instead of cudaProfilerStart/Stop for nsys")
    group.add_argument("--tensorboard-dir", default=None, help="where the PyTorch profiler writes its trace")


@dataclass(frozen=True)
class ProfilingSettings:
    """What to profile (the flags of :func:`add_profiling_args`).

    Attributes:
        enabled: Profile at all (``--profile``).
        step_start: First iteration profiled.
        step_end: First iteration after the profiled ones.
        ranks: Global ranks that profile.
        use_pytorch_profiler: The PyTorch profiler instead of cudaProfilerStart/Stop for nsys.
        trace_dir: Where the PyTorch profiler writes its Chrome trace, or None.
    """

    enabled: bool = False
    step_start: int = 10
    step_end: int = 12
    ranks: tuple[int, ...] = (0,)
    use_pytorch_profiler: bool = False
    trace_dir: Optional[str] = None


def profiling_problems(settings: ProfilingSettings) -> list[str]:
    """The profiling settings that do not fit together, one line each, naming the flags."""
    if not settings.enabled:
        return []
    if not 1 <= settings.step_start < settings.step_end:
        return [f"--profile-step-start {settings.step_start} must be >= 1 and below --profile-step-end "
                f"{settings.step_end}"]
    return []


class IterationProfiler:
    """Starts and stops the profiler around the iterations ``settings`` name, on this rank.

    Args:
        settings: What to profile.
        rank: This process's global rank.
        log: Where the operator tables go.
    """

    def __init__(self, settings: ProfilingSettings, rank: int, log: Callable[[str], None] = print):
        self.active = settings.enabled and rank in settings.ranks
        self.start, self.end = settings.step_start, settings.step_end
        self.pytorch = settings.use_pytorch_profiler
        self.trace_dir = settings.trace_dir
        self.rank, self.log = rank, log
        self._profiler: Optional[torch.profiler.profile] = None

    def before(self, iteration: int) -> None:
        """Called before ``iteration`` runs."""
        if not self.active or iteration != self.start:
            return
        if not self.pytorch:
            torch.cuda.profiler.start()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()

    def after(self, iteration: int) -> None:
        """Called after ``iteration`` ran (its phases waited for the device)."""
        if not self.active or iteration != self.end - 1:
            return
        if not self.pytorch:
            torch.cuda.profiler.stop()
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        averages = profiler.key_averages()
        span = f"iterations {self.start}-{self.end - 1}, rank {self.rank}"
        self.log(f" profile of {span}, by host time:\n"
                 + averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS))
        if torch.cuda.is_available():
            self.log(f" profile of {span}, by device time:\n"
                     + averages.table(sort_by="self_cuda_time_total", row_limit=TABLE_ROWS))
        if self.trace_dir is not None:
            os.makedirs(self.trace_dir, exist_ok=True)
            path = os.path.join(self.trace_dir, f"trace_rank{self.rank}_iter{self.start}-{self.end - 1}.json")
            profiler.export_chrome_trace(path)
            self.log(f" profile trace written to {path}")
