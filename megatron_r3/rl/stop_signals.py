"""SIGTERM and SIGINT stop a launcher run at its next safe point instead of wherever they land.

A scheduler's SIGTERM (or a user's Ctrl-C, or torchrun passing on the one it got) may arrive
in the middle of a step or of a checkpoint save; ending the process there leaves a half-written
``iter_N.saving`` folder and no word of what was kept. While :class:`StopSignals` is active the
signals are only noted (Python's :mod:`signal` handlers, run in the main thread between two
bytecodes: a save in progress goes on to its end; the helper process Megatron's checkpoint writer
reports through has both blocked, by the series (patches/fixes), so the signal torchrun sends a
worker's whole process group leaves it running). At each safe point, between two iterations, the
run asks :meth:`StopSignals.agreed` (one small all-reduce: a rank that got the signal stops
every rank), saves if it has a ``--save`` and has not just saved, says in one line what it saved
and raises :class:`StopRequested`, which the launcher turns into the conventional exit status
``128 + signum`` (143 for SIGTERM, 130 for SIGINT), the status a shell and torchrun report for a
process the signal ended. As Megatron-LM's ``--exit-signal-handler`` (``DistributedSignalHandler``),
with SIGINT too and without a flag: the launcher has no other use for either signal.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """The run stopped at a safe point because a rank received ``signum``; the message says what it saved.

    Attributes:
        signum: The signal (the larger number where ranks received different ones).
        status: The exit status that reports it, ``128 + signum``.
    """

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.status = 128 + signum


class StopSignals:
    """While active (a context manager), SIGTERM and SIGINT are noted instead of ending the process.

    Handlers are installed only in the main thread (where Python runs them); leaving restores the
    ones there were before.
    """

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum

    def agreed(self) -> Optional[int]:
        """The stop signal any rank has received, on every rank (a collective), or None."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        received = torch.tensor([self.received or 0], dtype=torch.int32, device=device)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)
        return int(received.item()) or None


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    return signal.Signals(signum).name
