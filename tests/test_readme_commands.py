"""The launcher commands README.md and docs/launcher.md print run as printed, on CPUs.

Each command is read from the fenced code blocks of those files (so the docs and this test cannot
drift), run in a fresh shell after the README's set-up line (`source .venv/bin/activate`, this
test's own venv) in an empty folder, with `--train-iters 2` appended so it stays short. The
README's default command runs twice in one folder: a second run of it works too.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs" / "launcher.md")
LAUNCHER = "launch/pretrain_gpt_r3.py"


def code_blocks(path: Path) -> list[list[str]]:
    """The shell lines of each fenced code block (``` or ```bash; not ```text and the like), backslash
    continuations joined."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.S | re.M)
    return [[line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
            for language, block in blocks if language in ("", "bash", "sh")]


def launcher_commands(path: Path) -> list[str]:
    """The commands of ``path`` that start the launcher (through torchrun or python), comments cut; a line of
    printed output that names the launcher (torchrun's failure report) is not one."""
    return [line.partition("  #")[0].strip() for block in code_blocks(path) for line in block
            if LAUNCHER in line and line.split()[0] in ("torchrun", "python")]


def setup_lines() -> list[str]:
    """The README's lines before its default command in the same block (activating the venv)."""
    for block in code_blocks(ROOT / "README.md"):
        for i, line in enumerate(block):
            if LAUNCHER in line:
                return [line.partition("#")[0].strip() for line in block[:i]]
    raise AssertionError("README.md shows no launcher command")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_as_printed(command: str, folder: Path) -> subprocess.CompletedProcess:
    """``command`` in a fresh bash in ``folder`` (the repository's launch/ and this venv linked there)."""
    for name, target in (("launch", ROOT / "launch"), (".venv", Path(sys.prefix))):
        if not (folder / name).exists():
            (folder / name).symlink_to(target)
    script = " && ".join([*setup_lines(), f"{command} --train-iters 2"])
    # CPUs only, as CI runs it; torchrun's default port would clash with another test's (PET_: torchrun's own).
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "CUDA_VISIBLE_DEVICES": "", "PET_MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_sets_up_with_the_venv_and_shows_its_commands():
    assert setup_lines() == ["source .venv/bin/activate"]
    assert len(launcher_commands(ROOT / "README.md")) == 2
    assert launcher_commands(ROOT / "docs" / "launcher.md")


@pytest.mark.parametrize("command", sorted({c for path in DOCS for c in launcher_commands(path)}))
def test_a_documented_command_runs_as_printed(tmp_path, command):
    runs = 2 if "--metrics-file" in command else 1  # a second run of the default command works too
    for run in range(runs):
        proc = run_as_printed(command, tmp_path)
        assert proc.returncode == 0, f"run {run + 1}: {proc.stderr[-3000:]}"
        assert re.search(r"iteration +2/ +2", proc.stdout), proc.stdout[-2000:]
