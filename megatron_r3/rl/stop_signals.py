"""SIGTERM and SIGINT stop a launcher run at its next safe point instead of wherever they land.

A scheduler's SIGTERM (or a user's Ctrl-C, or torchrun passing on the one it got) may arrive
in the middle of a step or of a checkpoint save; ending the process there leaves a half-written
``iter_N.saving`` folder and no word of what was kept. While :class:`StopSignals` is active the
signals are only noted (Python's :mod:`signal` handlers, run in the main thread between two
bytecodes: a save in progress goes on to its end), and the helper process Megatron's checkpoint
writer reports through is started with both blocked (:func:`start_checkpoint_writer_helper`), so
the signal torchrun sends a worker's whole process group leaves it running. At each safe point, between two iterations,
the run asks :meth:`StopSignals.agreed` (one small all-reduce: a rank that got the signal stops
every rank), saves if it has a ``--save`` and has not just saved, says in one line what it saved
and raises :class:`StopRequested`, which the launcher turns into the conventional exit status
``128 + signum`` (143 for SIGTERM, 130 for SIGINT), the status a shell and torchrun report for a
process the signal ended. As Megatron-LM's ``--exit-signal-handler`` (``DistributedSignalHandler``),
with SIGINT too and without a flag: the launcher has no other use for either signal.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
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


def start_checkpoint_writer_helper() -> None:
    """Starts the process Megatron's checkpoint writer hands its results through (``dist_checkpointing``'s
    write-results queue, a multiprocessing manager, started at the first save and kept) with SIGTERM and SIGINT
    blocked in it.

    torchrun and schedulers signal a worker's whole process group. Ended by the signal, the helper fails the
    save in progress on the ranks that had not yet read their results from it and on no other: those go on into
    the save's next collective and wait for ranks that never come, until torchrun kills them all. Started with
    the signals blocked (a child keeps its parent's signal mask across ``exec``), it ignores them; the ranks get
    them as before and stop at their next safe point (multiprocessing starts its resource tracker so). The
    main thread's mask is restored at once, and a signal that came meanwhile is delivered then.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

    # Starting it unblocks both signals in this thread: start it before (it ignores them itself).
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        get_write_results_queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    return signal.Signals(signum).name
