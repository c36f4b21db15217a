"""make install stops early with a clear message when something is missing."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_install(**env):
    return subprocess.run(
        ["bash", str(ROOT / "tools" / "install.sh")],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )


def test_missing_interpreter_is_named():
    proc = run_install(PYTHON="/nonexistent/python3")
    assert proc.returncode == 1
    assert "'/nonexistent/python3' not found" in proc.stderr


def test_missing_wheelhouse_is_named(tmp_path):
    proc = run_install(WHEELHOUSE=str(tmp_path / "no-such-dir"))
    assert proc.returncode == 1
    assert "no-such-dir is not a folder" in proc.stderr
