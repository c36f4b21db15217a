"""Benchmarks for megatron-r3 (`make bench`, or `python -m bench --help`)."""

import os
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
