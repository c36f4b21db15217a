"""Benchmarks for megatron-r3 (`make bench`, or `python -m bench --help`)."""

import cProfile
import io
import os
import pstats
from typing import Optional

import torch

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


def cell(value, spec: str) -> str:
    """A table cell: ``value`` formatted by ``spec``, or ``-`` where it was not measured (None)."""
    return "-" if value is None else format(value, spec)


CALLERS = 5  # entries of a host profile whose callers it names: what issued a library's busiest calls


def host_profile(fn, top: int) -> tuple[str, str]:
    """The ``top`` functions by their own host time over one call of fn (cProfile), and who called the first
    :data:`CALLERS` of them (a torch dispatch or autograd entry says nothing until its caller is named), as text."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    own, callers = io.StringIO(), io.StringIO()
    pstats.Stats(profiler, stream=own).sort_stats("tottime").print_stats(top)
    pstats.Stats(profiler, stream=callers).sort_stats("tottime").print_callers(min(top, CALLERS))
    return own.getvalue(), callers.getvalue()


def kernel_times(fn, on_gpu: bool) -> list[tuple[str, int, float]]:
    """(name, calls, ms) of every kernel of one call of fn by its own device time, the most first
    (torch's profiler); on a CPU, of every operator by its own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        if on_gpu:
            torch.cuda.synchronize()
    own = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    rows = [(e.key, e.count, getattr(e, own) / 1e3) for e in prof.key_averages() if getattr(e, own) > 0]
    return sorted(rows, key=lambda row: -row[2])


def kernel_table(what_ran: str, kernels: list[tuple[str, int, float]], top: int, on_gpu: bool) -> list[str]:
    """Markdown lines: the ``top`` kernels of ``what_ran`` (e.g. "one `replay` pass"), each with its share of the
    sum of all kernels' own times (not of the wall time: an NCCL kernel also counts its wait for the peers, and
    kernels of overlapping streams both count)."""
    total = sum(ms for _, _, ms in kernels)
    what, whole = ("kernel", "device time (NCCL's included)") if on_gpu else ("operator", "CPU time")
    lines = [f"Where {what_ran} spends its time: the {min(top, len(kernels))} largest of its "
             f"{len(kernels)} {what}s by their own {whole}, of {total:.2f} ms summed over all of them.", "",
             f"| {what} | calls | ms | share |", "|---|---:|---:|---:|"]
    for name, calls, ms in kernels[:top]:
        short = name if len(name) <= 100 else name[:97] + "..."
        lines.append(f"| `{short.replace('`', chr(39)).replace('|', '/')}` | {calls} | {ms:.2f} | {ms / total:.1%} |")
    return lines + [""]
