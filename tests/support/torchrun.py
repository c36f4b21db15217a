"""Drive a real ``torchrun`` of the launcher: start it, wait until its metrics file has enough lines, act on it
(kill a worker, signal the agent), wait for it to end, and leave no process of it behind."""

import json
import os
import signal
import subprocess
import time
from typing import Callable


def metrics_rows(path) -> list[dict]:
    """The complete lines of a metrics file (none while it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs."""
    out = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def run_and_act(command: list[str], cwd: str, env: dict, log, metrics, rows: int,
                act: Callable[[subprocess.Popen], list[int]], timeout: float = 300) -> subprocess.Popen:
    """Runs ``command`` (torchrun), output to ``log``; once ``metrics`` has ``rows`` lines calls ``act(agent)``,
    which returns processes to end after the agent (those it started may outlive it: a checkpoint writer's
    multiprocessing manager and resource tracker), and waits for the agent. Returns it, ended."""
    with open(log, "w") as out:
        agent = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    orphans = []
    try:
        deadline = time.monotonic() + timeout
        while len(metrics_rows(metrics)) < rows:
            assert agent.poll() is None, open(log).read()[-3000:]
            assert time.monotonic() < deadline, f"the run did not reach iteration {rows}"
            time.sleep(0.05)
        orphans = act(agent)
        agent.wait(timeout=timeout)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return agent
