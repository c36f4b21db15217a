"""Benchmarks for megatron-r3 (`make bench`, or `python -m bench --help`)."""

import os
from typing import Optional


def publish_report(report: str, out: Optional[str]) -> None:
    """Prints a benchmark's markdown report and, where ``out`` names a file, writes it there too."""
    print(report)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(report)
