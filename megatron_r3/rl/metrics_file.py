"""The launcher's ``--metrics-file``: one JSON object per logged iteration, each iteration exactly once.

A file is read before a run writes to it (:func:`metrics_file_problem`): every complete line
must be a JSON object with an integer ``iteration``, or the run stops naming the file and the
line. Two things a stopped run leaves behind are handled, never glued onto:

* a last line without its newline, cut by a run killed while writing it: a resumed run drops
  it (its iteration comes after the checkpoint, and is run again); appending to another run's
  file drops it only with ``--drop-cut-metrics-line``;
* lines of iterations after the checkpoint a run resumes from: a resumed run drops the trailing
  lines whose iteration is after its checkpoint (it writes them again); appending to them is
  refused, since it would write those iterations twice.

Lines are dropped by truncating the file where they start (one system call, no temporary copy:
it works on a full disk, and a run killed meanwhile leaves the file whole or truncated).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional, TextIO

from megatron_r3.dataplane.formats.jsonl import json_line
from megatron_r3.rl.checkpoint.dirs import save_directory_problem

METRICS_FILE_MODES = ("new", "append", "overwrite", "resume")


class MetricsFileError(ValueError):
    """A metrics file that cannot be continued as asked: the message names the file and the line."""


@dataclass(frozen=True)
class MetricsLines:
    """What a metrics file holds.

    Attributes:
        iterations: The ``iteration`` of each complete line, in file order.
        ends: The byte offset just after each complete line.
        cut_line: The line number of a last line without its newline, or None.
        cut_iteration: The iteration that cut line names, where its text still holds it whole.
    """

    iterations: list[int]
    ends: list[int]
    cut_line: Optional[int]
    cut_iteration: Optional[int] = None

    def complete_end(self) -> int:
        """Byte offset just after the last complete line (0 when there is none)."""
        return self.ends[-1] if self.ends else 0

    def trailing_after(self, iteration: int) -> int:
        """How many lines at the end of the file are of iterations after ``iteration``."""
        count = 0
        for value in reversed(self.iterations):
            if value <= iteration:
                break
            count += 1
        return count


def read_metrics_lines(path: str) -> MetricsLines:
    """Reads a metrics file; blank lines are skipped.

    Raises:
        MetricsFileError: a complete line that is not UTF-8, not JSON, not an object or
            without an integer ``iteration``, naming the file and the line.
    """
    iterations, ends, cut_line, cut_iteration = [], [], None, None
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            offset += len(raw)
            if not raw.endswith(b"\n"):
                cut_line = number  # only the last line can lack its newline
                # "iteration" comes first in a line (trainer.metrics); its digits are whole once a delimiter follows.
                found = re.search(rb'"iteration": *(\d+)[,}]', raw)
                cut_iteration = int(found.group(1)) if found else None
                break
            where = f"--metrics-file {path} line {number}"
            record = json_line(raw, where, MetricsFileError)
            if record is None:
                continue
            iteration = record.get("iteration") if isinstance(record, dict) else None
            if isinstance(iteration, bool) or not isinstance(iteration, int):
                raise MetricsFileError(f"{where}: a JSON object with an integer 'iteration' is expected, got "
                                       f"{raw.decode().strip()[:80]!r}")
            iterations.append(iteration)
            ends.append(offset)
    return MetricsLines(iterations, ends, cut_line, cut_iteration)


def metrics_file_problem(path: str, mode: str, resumed_iteration: Optional[int],
                         drop_cut_line: bool) -> Optional[str]:
    """Why a run cannot write ``path`` in ``mode`` (see the module docstring), or None; reads, changes nothing.

    Args:
        path: The ``--metrics-file``.
        mode: Its :class:`MetricsFile` mode.
        resumed_iteration: The checkpoint's iteration the run resumes from, or None.
        drop_cut_line: ``--drop-cut-metrics-line``.
    """
    if mode in ("new", "overwrite") or not os.path.isfile(path):
        return None
    try:
        lines = read_metrics_lines(path)
    except MetricsFileError as error:
        return str(error)
    if mode == "append" and lines.cut_line is not None and not drop_cut_line:
        return (f"--metrics-file {path} line {lines.cut_line} was cut (it has no newline: a run stopped while "
                f"writing it), and appending would glue the next line onto it: pass --drop-cut-metrics-line to drop "
                f"it first")
    if mode == "append" and resumed_iteration is not None:
        after = lines.trailing_after(resumed_iteration)
        if after:
            first = len(lines.iterations) - after
            return (f"--metrics-file {path} ends with {after} lines of iterations after the checkpoint's "
                    f"{resumed_iteration} (from iteration {lines.iterations[first]}), which this run writes again: "
                    f"leave out --append-metrics-file to drop them, or pass --overwrite-metrics-file")
    return None


def write_problem(path: str) -> Optional[str]:
    """Why this process could not write ``path``, or None: an existing file is opened for writing (and left
    as it is), a new one's folder gets a probe file (created and removed)."""
    if not os.path.exists(path):
        problem = save_directory_problem(os.path.dirname(os.path.abspath(path)))
        return None if problem is None else f"--metrics-file {path}: {problem}"
    try:
        with open(path, "r+b"):
            pass
    except OSError as error:
        return f"--metrics-file {path} cannot be written: {error.strerror or error}"
    return None


def cut_line_warning(path: str, resumed_iteration: Optional[int]) -> Optional[str]:
    """For a run that continues ``path`` (mode ``"resume"``): the line saying which cut last line it drops
    (the file, the line, the iteration whose metrics it held), or None when there is none.

    Args:
        path: The ``--metrics-file``.
        resumed_iteration: The checkpoint's iteration the run resumes from, or None (from scratch).
    """
    if not os.path.isfile(path):
        return None
    lines = read_metrics_lines(path)
    if lines.cut_line is None:
        return None
    if lines.cut_iteration is not None:
        lost = f"iteration {lines.cut_iteration}"
    elif lines.iterations:
        lost = f"the iteration after {lines.iterations[-1]} (its number was cut too)"
    else:
        lost = "an iteration whose number was cut too"
    resumed = resumed_iteration or 0
    again = ""
    if lines.cut_iteration is None or lines.cut_iteration > resumed:
        again = f"; this run, {f'resumed at iteration {resumed}' if resumed else 'from scratch'}, runs it again"
    return (f"warning: --metrics-file {path} line {lines.cut_line} was cut (no newline: a run stopped while writing "
            f"it) and is dropped, with the metrics of {lost}{again}")


def overwrite_warning(path: str, resumed_iteration: Optional[int]) -> Optional[str]:
    """A warning for ``--overwrite-metrics-file`` on a resumed run whose file holds lines, or None."""
    if resumed_iteration is None or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    with open(path, "rb") as f:
        count = sum(1 for raw in f if raw.strip())
    return (f"warning: --overwrite-metrics-file with --load: the {count} lines of --metrics-file {path} are "
            f"dropped, those of iterations up to the checkpoint's {resumed_iteration} included")


class MetricsFile:
    """Writes one JSON object per logged iteration to a JSONL file (on the logging rank only).

    Args:
        path: The file, or None to write nothing.
        mode: ``"new"``: create the file, which must not exist; ``"append"``: add lines after
            the file's; ``"overwrite"``: start it afresh; ``"resume"``: keep the file's lines up
            to the last one of an iteration up to ``keep_through`` and drop the trailing ones after
            it (a run that died after its last checkpoint wrote them, and the resumed run writes
            them again), and a cut last line.
        keep_through: With ``"resume"``, the iteration the run resumes from.
        drop_cut_line: With ``"append"``, drop a cut last line first (``--drop-cut-metrics-line``).

    Raises:
        MetricsFileError: with ``"resume"`` or ``"append"``, a line that is not a metrics line.
        OSError: naming the flag and the file, when it cannot be opened; from :meth:`write`, naming the
            iteration too (e.g. a full disk).
    """

    def __init__(self, path: Optional[str], mode: str = "new", keep_through: Optional[int] = None,
                 drop_cut_line: bool = False):
        if mode not in METRICS_FILE_MODES:
            raise ValueError(f"metrics file mode must be one of {METRICS_FILE_MODES}, got {mode!r}")
        self._path = path
        self._file: Optional[TextIO] = None
        if not path:
            return
        try:
            if mode in ("resume", "append") and os.path.isfile(path):
                lines = read_metrics_lines(path)
                keep = None
                if mode == "resume":
                    kept = len(lines.iterations) - lines.trailing_after(keep_through or 0)
                    keep = lines.ends[kept - 1] if kept else 0
                elif drop_cut_line and lines.cut_line is not None:
                    keep = lines.complete_end()
                if keep is not None and keep != os.path.getsize(path):
                    os.truncate(path, keep)
            self._file = open(path, {"new": "x", "append": "a", "overwrite": "w", "resume": "a"}[mode])
        except OSError as error:
            raise type(error)(f"--metrics-file {path}: cannot open it to write: {error.strerror or error}") from None

    def write(self, metrics: dict) -> None:
        if self._file is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        try:
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()
        except OSError as error:
            raise OSError(f"--metrics-file {self._path}: cannot write the line of iteration "
                          f"{metrics.get('iteration')}: {error.strerror or error}") from None

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # a flush that failed already raised from write()
                pass
            self._file = None
