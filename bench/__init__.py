"""Benchmarks for megatron-r3 (`make bench`, or `python -m bench --help`)."""

import cProfile
import io
import os
import pstats
from typing import Optional

from megatron_r3.dataplane.formats.output_files import atomic_output


def publish_report(report: str, out: Optional[str]) -> None:
    """Prints a benchmark's markdown report and, where ``out`` names a file, writes it there too.

    A report is regenerated output (``make bench`` writes ``build/bench/``): an earlier one at
    ``out`` is replaced, through a temporary file and a rename.
    """
    print(report)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with atomic_output(out, overwrite=True) as temporary, open(temporary, "w") as f:
            f.write(report)


def host_profile(fn, top: int) -> str:
    """The ``top`` functions by their own host time over one call of fn (cProfile), as text."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()
