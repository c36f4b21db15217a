"""Inputs made elsewhere: dumps holding what the writer refuses, and checksums proving nothing changed.

``unchecked_writer()`` lets :class:`RolloutDumpWriter` write samples its checks
would refuse (a NaN log-prob, a negative token id, a string reward), as a dump
written by another tool or corrupted on disk would hold them; the reader and the
launcher must then refuse it. ``snapshot(folder)`` is the checksum of every file
under a folder, to compare before and after a refused command.
"""

import contextlib
import hashlib
import os
from unittest import mock

import numpy as np

from megatron_r3.dataplane.formats import dump_writer


@contextlib.contextmanager
def unchecked_writer():
    """While active, RolloutDumpWriter stores token ids, log-probs and metadata as given."""
    with mock.patch.object(dump_writer, "check_sample_values", lambda sample, where: None), \
            mock.patch.object(dump_writer, "token_id_array", lambda values, *args: np.asarray(values)):
        yield


def snapshot(folder) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out
