"""bench.generation's profiles (--profile-host, --profile-device): where a rollout engine's time goes.

The benchmark times GPUs; its ``--small`` smoke run on a CPU goes through the same code with the built-in
engine only (Megatron's needs CUDA, which the report says), which is what runs here.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.run([sys.executable, "-m", "bench.generation", "--small", "--rounds", "1", "--warmup", "1",
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def profiled_report(tmp_path_factory):
    """The report of one CPU run with both profiles."""
    out = tmp_path_factory.mktemp("generation") / "generation.md"
    run = run_bench("--profile-host", "3", "--profile-device", "3", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    return out.read_text()


def test_a_cpu_run_reports_the_host_profile_of_one_more_generate_per_engine(profiled_report):
    report = profiled_report
    assert report.count("Host profile of one ") == 1  # the built-in engine's; Megatron's is not run on a CPU
    profile = report.split("Host profile of one `local` generate (cProfile, by own time):\n\n```\n")[1].split("```")[0]
    assert "due to restriction <3>" in profile
    rows = [line.split() for line in profile.splitlines() if line.strip()[:1].isdigit() and "function calls" not in line]
    assert len(rows) == 3
    own = [float(row[1]) for row in rows]
    assert own == sorted(own, reverse=True)
    assert "| megatron | - | not run: it needs CUDA" in report
    # who called those three: each of them, by name, followed by its callers
    callers = report.split("Who called its first 3:\n\n```\n")[1].split("```")[0]
    assert "was called by..." in callers
    names = [line.split(None, 5)[5] for line in profile.splitlines()
             if line.strip()[:1].isdigit() and "function calls" not in line]
    for name in names:  # pstats prints a function's name beside its callers as it does in the list
        assert any(line.startswith(name[:40]) for line in callers.splitlines()), name


def test_a_cpu_run_reports_one_more_generates_wall_time_against_its_operators_and_the_largest(profiled_report):
    report = profiled_report
    assert report.count("under torch's profiler") == 1  # the built-in engine's; Megatron's is not run on a CPU
    summary = report.split("One more `local` generate under torch's profiler: ")[1].split("\n")[0]
    wall, summed = (float(part.split(" ms")[0]) for part in (summary, summary.split("included), ")[1]))
    assert summary.endswith(" ms summed over its operators' CPU times.") and 0 < summed and 0 < wall
    head = "Where one `local` generate spends its time: the 3 largest of its "
    header, table = report.split(head)[1].split("\n\n")[:2]
    assert header.endswith(f"of {summed:.2f} ms summed over all of them.")
    rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in table.splitlines()[2:]]
    ms = [float(row[2]) for row in rows]
    assert len(rows) == 3 and ms == sorted(ms, reverse=True)
    # each share of the sum, to the rounding of the printed milliseconds and percentages
    assert all(abs(float(row[3].rstrip("%")) - 100 * value / summed) < 0.1 for row, value in zip(rows, ms))


def test_without_the_flags_there_is_no_profile_and_a_negative_count_is_refused(tmp_path):
    out = tmp_path / "generation.md"
    assert run_bench("--out", str(out)).returncode == 0
    text = out.read_text()
    assert "Host profile" not in text and "profiler" not in text and "| local | no |" in text
    for flag in ("--profile-host", "--profile-device"):
        refused = run_bench(flag, "-1")
        assert refused.returncode == 2 and f"{flag} -1: a count, 0 or more" in refused.stderr
