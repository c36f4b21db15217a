"""bench.generation's host profile (--profile-host): where a host-bound rollout engine's time goes.

The benchmark times GPUs; its ``--small`` smoke run on a CPU goes through the same code with the built-in
engine only (Megatron's needs CUDA, which the report says), which is what runs here.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.run([sys.executable, "-m", "bench.generation", "--small", "--rounds", "1", "--warmup", "1",
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_cpu_run_reports_the_host_profile_of_one_more_generate_per_engine(tmp_path):
    out = tmp_path / "generation.md"
    run = run_bench("--profile-host", "3", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = out.read_text()
    assert report.count("Host profile of one ") == 1  # the built-in engine's; Megatron's is not run on a CPU
    profile = report.split("Host profile of one `local` generate (cProfile, by own time):\n\n```\n")[1].split("```")[0]
    assert "due to restriction <3>" in profile
    rows = [line.split() for line in profile.splitlines() if line.strip()[:1].isdigit() and "function calls" not in line]
    assert len(rows) == 3
    own = [float(row[1]) for row in rows]
    assert own == sorted(own, reverse=True)
    assert "| megatron | - | not run: it needs CUDA" in report


def test_without_the_flag_there_is_no_profile_and_a_negative_count_is_refused(tmp_path):
    out = tmp_path / "generation.md"
    assert run_bench("--out", str(out)).returncode == 0
    assert "Host profile" not in out.read_text() and "| local | no |" in out.read_text()
    refused = run_bench("--profile-host", "-1")
    assert refused.returncode == 2 and "--profile-host -1: a count of functions, 0 or more" in refused.stderr
