"""Counting the host's waits for the device, for diagnosis and benchmarks.

Two kinds are counted inside the context: the synchronising CUDA operations that
``torch.cuda.set_sync_debug_mode`` reports (a ``.item()``, a synchronous copy to the host,
``nonzero``), and the waits Python asks for explicitly (``Event.synchronize``,
``Stream.synchronize``, ``torch.cuda.synchronize``), which the debug mode does not see.
Without CUDA nothing is counted.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

SYNC_DEBUG_MESSAGE = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def counted_host_syncs(counts: dict):
    """Counts host syncs in the block into ``counts["sync_debug"]`` and ``counts["waits"]``."""
    counts.update(sync_debug=0, waits=0)
    if not torch.cuda.is_available():
        yield counts
        return
    patched = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]
    originals = [getattr(owner, name) for owner, name in patched]

    def counting(original):
        def wrapper(*args, **kwargs):
            counts["waits"] += 1
            return original(*args, **kwargs)
        return wrapper

    for (owner, name), original in zip(patched, originals):
        setattr(owner, name, counting(original))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for (owner, name), original in zip(patched, originals):
                setattr(owner, name, original)
    counts["sync_debug"] = sum(SYNC_DEBUG_MESSAGE in str(w.message) for w in caught)
