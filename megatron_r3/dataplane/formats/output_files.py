"""Writing a tool's output without destroying a file the tool did not create.

``tools/dump_rollouts.py``, ``tools/synthetic_rollout_dump.py`` and
``tools/plot_metrics.py`` write their ``--out`` through :func:`atomic_output`:
an output that is one of the inputs is refused, an existing one is refused
unless ``--overwrite`` is given, and the file is written under a temporary
name in the same folder and renamed over ``--out`` only once complete, so a
failed or killed run leaves the old file (or none) in place, never half of one.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator, Sequence


class OutputFileError(ValueError):
    """An output that would destroy a file: one of the inputs, or an existing file."""


def check_output(path: str, inputs: Sequence[str] = (), overwrite: bool = False, flag: str = "--out") -> None:
    """Refuses an output that is one of ``inputs``, a folder, in a missing folder, or (without ``overwrite``) exists."""
    for source in inputs:
        if os.path.exists(path) and os.path.exists(source):
            same = os.path.samefile(path, source)  # links and other spellings of one file too
        else:
            same = os.path.realpath(path) == os.path.realpath(source)
        if same:
            raise OutputFileError(f"{flag} {path} is the input {source}: writing it would destroy the input")
    if os.path.isdir(path):
        raise OutputFileError(f"{flag} {path} is a folder")
    if os.path.lexists(path) and not overwrite:
        raise OutputFileError(f"{flag} {path} exists: pass --overwrite to replace it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputFileError(f"{flag} {path}: the folder {folder} does not exist")


@contextlib.contextmanager
def atomic_output(path: str, inputs: Sequence[str] = (), overwrite: bool = False, flag: str = "--out") -> Iterator[str]:
    """Yields a temporary path next to ``path``; renamed to ``path`` when the block ends normally, else removed.

    Checks ``path`` first (:func:`check_output`), and again before the rename: a file that
    appeared at ``path`` meanwhile is not replaced without ``overwrite``.
    """
    check_output(path, inputs, overwrite, flag)
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.partial")
    try:
        yield temporary
        if os.path.lexists(path) and not overwrite:
            raise OutputFileError(f"{flag} {path} appeared while it was being written: pass --overwrite to replace it")
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
