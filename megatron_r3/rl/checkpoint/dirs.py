"""Where checkpoints lie on disk, as in Megatron-LM, and how a save becomes one atomically.

Layout::

    DIR/latest_checkpointed_iteration.txt    the last complete checkpoint's iteration
    DIR/iter_0000010/                        a torch_dist checkpoint (one per saved iteration)

Every rank writes its shards into ``DIR/iter_0000010.saving/`` (:func:`staging_dir`);
after all ranks are done, rank 0 renames it to ``iter_0000010`` and then replaces the
tracker file (a temporary file renamed over it; :func:`publish`). A run killed during a
save leaves the tracker on the previous complete checkpoint, which a load then finds.
"""

from __future__ import annotations

import os
import shutil
import socket
from typing import Optional

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_STAGING_SUFFIX = ".saving"


def iteration_dir(directory: str, iteration: int) -> str:
    """The checkpoint directory of ``iteration`` under ``directory`` (``iter_0000010``)."""
    return os.path.join(directory, f"iter_{iteration:07d}")


def staging_dir(directory: str, iteration: int) -> str:
    """Where the ranks write the checkpoint of ``iteration`` until :func:`publish` names it."""
    return iteration_dir(directory, iteration) + _STAGING_SUFFIX


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration of the last complete checkpoint in ``directory``, or ``None`` if there is none.

    Raises:
        ValueError: the tracker file does not hold an iteration number.
    """
    path = os.path.join(directory, TRACKER_FILENAME)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} should hold an iteration number, not {text!r}") from None


def save_directory_problem(directory: str) -> Optional[str]:
    """Why this process could not write checkpoints into ``directory``, or None when it could.

    Creates and removes a probe file in ``directory``, or, while it does not exist, in the
    nearest folder above it that does (where a save would create it): the check a run
    makes on every rank before it trains, so that an unwritable ``--save`` fails at once
    rather than at the first save. Nothing is left behind.
    """
    target = os.path.abspath(directory)
    while not os.path.exists(target):
        target = os.path.dirname(target)
    if not os.path.isdir(target):
        return f"{target} is a file, not a folder"
    probe = os.path.join(target, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "x"):
            pass
        os.remove(probe)
    except OSError as error:
        return f"cannot create a file in {target} ({type(error).__name__}: {error.strerror or error})"
    return None


def find_checkpoint(path: str) -> tuple[str, int]:
    """The checkpoint ``path`` names, as ``(run directory, iteration)``.

    ``path`` is a run's checkpoint directory (its latest complete checkpoint, by the tracker
    file) or one iteration folder in it (``DIR/iter_0000010``: that iteration of ``DIR``).

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint yet: it does not exist, or has no
            tracker file (a run that has not saved).
        ValueError: ``path`` is a file; an iteration folder that is not a complete checkpoint
            (naming its run directory and the complete iterations there); a tracker that
            names an iteration whose checkpoint is not complete.
    """
    normal = os.path.normpath(path)
    parent, name = os.path.split(normal)
    if name.startswith("iter_"):
        complete = complete_iterations(parent)
        iteration = int(name[5:]) if name[5:].isdigit() else None
        if iteration in complete and normal == os.path.normpath(iteration_dir(parent, iteration)):
            return parent, iteration
        raise ValueError(f"{path} is not a complete checkpoint; its run's checkpoint directory is {parent or '.'} "
                         f"(complete iterations there: {complete})")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint in {path}: the directory does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a checkpoint directory")
    iteration = latest_iteration(path)
    if iteration is None:
        complete = complete_iterations(path)
        raise FileNotFoundError(f"no checkpoint in {path}: it has no {TRACKER_FILENAME}"
                                + (f" (complete iterations {complete} are there: name one, e.g. "
                                   f"{iteration_dir(path, complete[-1])})" if complete else ""))
    if not is_complete(iteration_dir(path, iteration)):
        raise ValueError(f"{os.path.join(path, TRACKER_FILENAME)} names iteration {iteration}, whose checkpoint is "
                         f"not complete (complete iterations: {complete_iterations(path)})")
    return path, iteration


def start_staging(directory: str, iteration: int) -> None:
    """Rank 0, before the ranks write: an empty staging folder for ``iteration``.

    A leftover of an interrupted save of this iteration is incomplete: it is removed.
    """
    staging = staging_dir(directory, iteration)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)


def publish(directory: str, iteration: int) -> None:
    """Rank 0, once every rank has written: the checkpoint takes its name, then the tracker points to it.

    The tracker's new text is written (to a temporary file) first: on a full disk that write
    fails before anything is renamed, and the staging folder is all there is to remove.
    """
    tracker = os.path.join(directory, TRACKER_FILENAME)
    temporary = tracker + ".tmp"
    try:
        with open(temporary, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    final = iteration_dir(directory, iteration)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(staging_dir(directory, iteration), final)
    os.replace(temporary, tracker)


def is_complete(path: str) -> bool:
    """Whether the checkpoint folder ``path`` holds every rank's shards."""
    # dist_checkpointing writes metadata.json last, after every rank's shards.
    return os.path.isfile(os.path.join(path, "metadata.json"))


def complete_iterations(directory: str) -> list[int]:
    """The iterations of the complete checkpoint folders in ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        if name.startswith("iter_") and name[5:].isdigit() and is_complete(os.path.join(directory, name)):
            found.append(int(name[5:]))
    return sorted(found)
