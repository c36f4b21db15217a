"""megatron_r3.rl.profiling.profiler: Megatron-LM's --profile flags on the launcher's loop."""

import json

import pytest

from megatron_r3.rl.arguments import parse_args
from tests.support.launcher import run_workers
from tests.test_launch import DUMP_FLAGS, train_worker, write_dump


def test_the_pytorch_profiler_records_the_named_iterations_on_the_named_rank(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    traces = tmp_path / "tb"
    argv = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "3", "--moe-enable-routing-replay", "--profile",
                         "--profile-step-start", "2", "--profile-step-end", "3", "--profile-ranks", "1",
                         "--use-pytorch-profiler", "--tensorboard-dir", str(traces)]
    results = run_workers(train_worker, 2, argv, backend="gloo")
    assert not any("profile" in line for line in results[0]["lines"])
    (table,) = [line for line in results[1]["lines"] if line.startswith(" profile of iterations 2-2, rank 1, by host")]
    assert "aten::mm" in table and "Self CPU time total" in table
    (trace,) = traces.iterdir()
    assert trace.name == "trace_rank1_iter2-2.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name") == "aten::mm" for event in events)
    assert [h["iteration"] for h in results[1]["history"]] == [1, 2, 3]


def test_a_profile_range_that_is_empty_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--profile", "--profile-step-start", "3", "--profile-step-end", "3"])
    assert exit_.value.code == 2
    assert "--profile-step-start 3 must be >= 1 and below --profile-step-end 3" in capsys.readouterr().err
