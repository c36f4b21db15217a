"""SIGTERM and SIGINT: the launcher stops between two iterations, saved, says so, and exits with 128 + signum.

Each signal is a real one, sent by a rank to itself (``os.kill``) at a chosen point of a run of
``main`` in gloo workers: during a checkpoint save (its ``iter_N.saving`` folder exists), or while an
iteration's rollouts are read. The run resumed from what it saved gives the metrics of an
uninterrupted run. One case runs under a real ``torchrun``, signalled through torchrun itself.
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.test_bad_input_launcher import run_cases
from tests.test_launch import EMBEDDED_FLAGS, REPO
from tests.support.torchrun import descendants, metrics_rows, run_and_act
from tests.test_launch_checkpoints import deterministic


class SignalAt:
    """A hook: rank ``rank`` sends itself ``signum`` at ``iteration``, in the middle of its checkpoint save
    (``during="save"``: after the staging folder exists, before the shards are written) or while the
    iteration's rollouts are drawn (``during="rollout"``). ``during="failing-save"``: the save then fails
    (its disk full)."""

    def __init__(self, signum, rank, iteration, during):
        self.signum, self.rank, self.iteration, self.during = signum, rank, iteration, during

    def _send(self, iteration, seen, folder=None):
        import torch.distributed as dist

        if dist.get_rank() == self.rank and iteration == self.iteration:
            if folder is not None:  # what the save in progress has written so far
                seen["saving"] = sorted(name for name in os.listdir(folder) if name.endswith(".saving"))
            os.kill(os.getpid(), self.signum)

    def __call__(self, setup, seen):
        from megatron.core import dist_checkpointing

        def signalled(settings, device, log=print):
            run = setup(settings, device, log)
            if self.during.endswith("save"):
                original = dist_checkpointing.save

                def save_then_signal(*args, **kwargs):
                    self._send(run.iteration, seen, settings.checkpoints.save)
                    if self.during == "failing-save" and run.iteration == self.iteration:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    return original(*args, **kwargs)

                dist_checkpointing.save = save_then_signal
                seen["undo"] = [lambda: setattr(dist_checkpointing, "save", original)]
            else:
                batch = run.source.batch

                def signal_then_batch(iteration):
                    self._send(iteration, seen)
                    return batch(iteration)

                run.source.batch = signal_then_batch
            return run
        return signalled


def _iterations(path):
    return [json.loads(line)["iteration"] for line in open(path)]


@pytest.mark.parametrize("ranks, signum, during", [
    (2, signal.SIGTERM, "save"), (1, signal.SIGINT, "rollout"), (1, signal.SIGTERM, "failing-save")],
    ids=["sigterm-during-a-save-2-ranks", "sigint-between-saves-1-rank", "sigterm-ending-the-save-1-rank"])
def test_a_stop_signal_stops_at_the_next_safe_point_saved_and_the_resumed_run_continues_exactly(
        tmp_path, ranks, signum, during):
    work = tmp_path / "work"
    work.mkdir()
    ckpt = work / "ckpt"
    flags = EMBEDDED_FLAGS + ["--moe-enable-routing-replay", "--rollout-staleness", "1", "--train-iters", "4"]
    # The signal reaches the last rank while the save of iteration 2 runs, or while iteration 2 draws its
    # rollouts, two iterations before the next scheduled save.
    interval = "3" if during == "rollout" else "1"
    cases = [
        (flags + ["--metrics-file", str(work / "whole.jsonl")], str(work), None),
        (flags + ["--save", str(ckpt), "--save-interval", interval, "--metrics-file", str(work / "m.jsonl")],
         str(work), SignalAt(signum, ranks - 1, 2, during)),
        (flags + ["--save", str(ckpt), "--load", str(ckpt), "--metrics-file", str(work / "m.jsonl")], str(work),
         None),
    ]
    results = run_cases(tmp_path, ranks, cases)
    status = 128 + signum
    for whole, stopped, resumed in results:
        assert whole["code"] == 0 and resumed["code"] == 0, (whole["err"], resumed["err"])
        assert stopped["code"] == status, (stopped["code"], stopped["err"][-2000:])
        assert "Traceback" not in stopped["err"] and "pretrain_gpt_r3.py: error" not in stopped["err"], stopped["err"]
    whole, stopped, resumed = results[-1]  # the logging rank, which the signal reached
    name = signal.Signals(signum).name
    stop_lines = [line for line in stopped["out"].splitlines() if " received: " in line]
    if during == "save":  # the save in progress finished
        assert stopped["seen"] == {"saving": ["iter_0000002.saving"]}  # the signal came while it was there
        assert stop_lines == [f" {name} received: stopped after iteration 2; its checkpoint at iteration 2 is in "
                              f"{ckpt}"]
        saved, resumed_at = ["iter_0000001", "iter_0000002"], 2
    elif during == "rollout":  # saved at the next safe point
        assert stop_lines == [f" {name} received: stopped after iteration 2; saved checkpoint at iteration 2 to {ckpt}"]
        saved, resumed_at = ["iter_0000002"], 2
    else:  # abandoned as a failed save is: its folder removed, the tracker on the last checkpoint
        (line,) = stop_lines
        assert re.fullmatch(
            rf" {name} received: stopped after iteration 2; its save was abandoned: --save: saving iteration 2 into "
            rf"{ckpt / 'iter_0000002.saving'} failed \(\d+ bytes were free on its filesystem\): OSError: "
            rf"\[Errno 28\] No space left on device; the partial folder was removed, "
            rf"{ckpt / 'latest_checkpointed_iteration.txt'} still names iteration 1", line), line
        saved, resumed_at = ["iter_0000001"], 1
    # Nothing partial: no .saving folder is left, and the tracker names a complete checkpoint.
    assert sorted(os.listdir(ckpt)) == saved + ["iter_0000004", "latest_checkpointed_iteration.txt"]
    assert f" resumed from {ckpt} at iteration {resumed_at} ({4 * resumed_at} samples consumed)" in resumed["out"]
    assert _iterations(work / "m.jsonl") == [1, 2, 3, 4]
    assert deterministic(metrics_rows(work / "m.jsonl")) == deterministic(metrics_rows(work / "whole.jsonl"))


def test_under_torchrun_sigterm_stops_every_worker_at_a_safe_point_with_nothing_partial(tmp_path):
    """torchrun passes the SIGTERM it gets to each worker's process group and waits for them (here up to 300 s,
    its --shutdown-timeout): they stop at their next safe point with the save of its iteration complete, one
    line says what was kept, and torchrun ends with its own SignalException (it was signalled itself) and
    status 1."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--shutdown-timeout", "300", "launch/pretrain_gpt_r3.py", *EMBEDDED_FLAGS, "--train-iters", "1000",
               "--save", str(ckpt), "--save-interval", "1", "--metrics-file", str(metrics)]
    log = tmp_path / "torchrun.log"

    def signal_the_agent(agent):
        orphans = descendants(agent.pid)
        agent.send_signal(signal.SIGTERM)
        return orphans

    agent = run_and_act(command, REPO, env, log, metrics, 2, signal_the_agent, timeout=500)
    output = log.read_text()
    assert agent.returncode == 1 and "SignalException" in output, output[-3000:]
    assert "pretrain_gpt_r3.py: error" not in output and "Unable to shutdown process" not in output, output[-3000:]
    (stop,) = [line for line in output.splitlines() if " SIGTERM received: stopped after iteration " in line]
    last = int(re.search(r"stopped after iteration (\d+);", stop).group(1))
    # The save of that iteration finished: the writer's helper process, in the same process group, outlived the signal.
    assert stop.endswith(f"its checkpoint at iteration {last} is in {ckpt}"), stop
    assert not [name for name in os.listdir(ckpt) if name.endswith(".saving")]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    assert [row["iteration"] for row in metrics_rows(metrics)] == list(range(1, last + 1))


HELPER_SCRIPT = """
import os, signal, time
from megatron.core.dist_checkpointing.strategies import filesystem_async
from tests.support.torchrun import children

queue = filesystem_async.get_write_results_queue()  # as the writer's first save starts it
queue.put("before")
helpers = children(os.getpid())  # the manager, and multiprocessing's resource tracker
for pid in helpers:
    for signum in (signal.SIGINT, signal.SIGTERM):
        os.kill(pid, signum)
time.sleep(1)
alive = [pid for pid in helpers if pid in children(os.getpid())
         and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]  # not ended, not a zombie
queue.put("after")
print(len(helpers), len(alive), [queue.get(timeout=5), queue.get(timeout=5)])
"""


def test_the_checkpoint_writers_helper_outlives_the_stop_signals():
    """The helper process Megatron's checkpoint writer hands its results through outlives SIGINT and SIGTERM
    sent to it and goes on serving (patches/fixes, "the write-results manager outlives SIGINT and SIGTERM";
    unpatched, SIGTERM ends it and the queue breaks)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", HELPER_SCRIPT], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "2 2 ['before', 'after']", (result.stdout, result.stderr[-3000:])
