"""Files the launcher writes and reads back: checkpoints, the metrics file, a full disk.

Each case runs ``main`` in gloo workers (``tests.test_bad_input_launcher.run_cases``) and asserts
its exit status, its one error line (no traceback) naming the file, the part and the flag, and
the checksums of every file around it. A checkpoint never holds a NaN: a save of one is refused
before anything is written, and a checkpoint that holds one (written with the check switched off,
as a run of an older version or a changed file would leave it) is refused at load. A full disk is
a small tmpfs mounted by the test (skipped, with the reason, where mounting is not allowed).
"""

import json
import os
import re
import shutil
import subprocess
import uuid

import pytest
import torch

from tests.support.launcher import run_workers
from tests.test_bad_input_launcher import assert_refused, error_line, run_cases
from tests.test_launch import DUMP_FLAGS, EMBEDDED_FLAGS, write_dump


class PoisonAfterStep:
    """A hook: after each optimizer step a NaN is put in ``where(run)``, a tensor a checkpoint holds.

    ``unchecked``: the checkpoint's finite check is switched off, so the save writes the NaN (as
    a run of an older version, or a changed file, would leave it).
    """

    def __init__(self, where, unchecked=False):
        self.where, self.unchecked = where, unchecked

    def __call__(self, setup, seen):
        if self.unchecked:
            from megatron_r3.rl.checkpoint import checkpointing

            original = checkpointing.non_finite_tensors
            checkpointing.non_finite_tensors = lambda named: []
            seen["undo"] = [lambda: setattr(checkpointing, "non_finite_tensors", original)]

        def poisoned(settings, device, log=print):
            run = setup(settings, device, log)
            step = run.trainer.step

            def step_then_poison(*step_args, **kwargs):
                sums = step(*step_args, **kwargs)
                with torch.no_grad():
                    self.where(run).view(-1)[0] = float("nan")
                return sums

            run.trainer.step = step_then_poison
            return run
        return poisoned


def _adam_moment(run):
    from megatron_r3.rl.checkpoint.optimizer import _inner_optimizers

    (inner,) = _inner_optimizers(run.trainer.stack.optimizer)
    return next(iter(inner.state.values()))["exp_avg"]


def _policy_weight(run):
    return run.trainer.stack.chunks[0].decoder.final_layernorm.weight


def _engine_weight(run):
    return next(run.engine.weights.follower[0].parameters())


nan_in_adam_moment = PoisonAfterStep(_adam_moment)
nan_in_policy_weight = PoisonAfterStep(_policy_weight)
nan_in_engine_weight = PoisonAfterStep(_engine_weight)
unchecked_nan_in_adam_moment = PoisonAfterStep(_adam_moment, unchecked=True)
unchecked_nan_in_policy_weight = PoisonAfterStep(_policy_weight, unchecked=True)


def _rows(path):
    return [json.loads(line)["iteration"] for line in open(path) if line.strip()]


def test_checkpoints_with_a_nan_are_neither_saved_nor_loaded_and_damaged_ones_are_named(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    dump = write_dump(work / "rollouts.r3dump")
    base = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "2", "--save-interval", "1"]
    cases = [
        (base + ["--save", str(work / "good")], str(work), None),
        (base + ["--train-iters", "1", "--save", str(work / "nan-adam")], str(work), unchecked_nan_in_adam_moment),
        (base + ["--train-iters", "1", "--save", str(work / "nan-weight")], str(work), unchecked_nan_in_policy_weight),
    ]
    (good, planted_adam, planted_weight), = run_cases(tmp_path, 1, cases)
    for result in (good, planted_adam, planted_weight):
        assert result["code"] == 0, result["err"]
    # A shard deleted, a shard cut, the metadata deleted: copies of the good checkpoint.
    damaged = {}
    for name, damage in (("no-shard", lambda d: os.remove(d / "__0_0.distcp")),
                         ("cut-shard", lambda d: os.truncate(d / "__0_0.distcp", 1000)),
                         ("no-metadata", lambda d: os.remove(d / ".metadata"))):
        shutil.copytree(work / "good", work / name)
        damage(work / name / "iter_0000002")
        damaged[name] = work / name
    resume = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "3"]
    cases = [
        (resume + ["--load", str(work / "nan-adam")], str(work), None),
        (resume + ["--load", str(work / "nan-weight")], str(work), None),
        *[(resume + ["--load", str(path)], str(work), None) for path in damaged.values()],
        (base + ["--save", str(work / "refused")], str(work), nan_in_adam_moment),
        (base + ["--save", str(work / "good")], str(work), nan_in_policy_weight),
    ]
    (adam, weight, no_shard, cut_shard, no_metadata, save_adam, save_weight), = run_cases(
        tmp_path, 1, cases)
    planted = work / "nan-adam" / "iter_0000001"
    assert_refused(adam, f"--load: {planted}: tensor optimizer.state.exp_avg.", "holds a NaN or an Inf: the "
                                                                                 "checkpoint is not loaded")
    assert_refused(weight, f"--load: {work / 'nan-weight' / 'iter_0000001'}: tensor "
                           f"decoder.final_layernorm.weight holds a NaN or an Inf")
    for result, name, cause in ((no_shard, "no-shard", "No such file or directory"),
                                (cut_shard, "cut-shard", ""), (no_metadata, "no-metadata", "")):
        assert_refused(result, f"--load: {work / name / 'iter_0000002'}: cannot read the checkpoint", cause)
    # A NaN after the first step: that save is refused before anything is written, the run stops.
    assert_refused(save_adam, f"--save: not saving iteration 1 to {work / 'refused'}: tensor "
                              f"optimizer.state.exp_avg.", f"{work / 'refused' / 'latest_checkpointed_iteration.txt'} "
                                                           f"was not written")
    assert not (work / "refused").exists()
    assert_refused(save_weight, "--save: not saving iteration 1 to", "decoder.final_layernorm.weight",
                   "latest_checkpointed_iteration.txt still names iteration 2")


def test_a_nan_in_the_rollout_engines_weights_is_not_saved(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    argv = EMBEDDED_FLAGS + ["--rollout-staleness", "1", "--save", str(work / "ckpt")]
    (result,), = run_cases(tmp_path, 1, [(argv, str(work), nan_in_engine_weight)])
    assert_refused(result, f"--save: not saving iteration 1 to {work / 'ckpt'}: tensor rollout.")
    assert os.listdir(work) == []


# The metrics file: every iteration once.

def test_metrics_lines_stay_exactly_once_per_iteration(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    dump = write_dump(work / "rollouts.r3dump")
    ckpt = work / "ckpt"
    base = DUMP_FLAGS + ["--rollout-dump", dump]
    (made,), = run_cases(tmp_path, 1, [(base + ["--train-iters", "2", "--save-interval", "1", "--save", str(ckpt)],
                                        str(work), None)])
    assert made["code"] == 0, made["err"]
    line = {i: json.dumps({"iteration": i, "loss": 0.5}) + "\n" for i in range(1, 4)}
    files = {
        "cut.jsonl": line[1] + '{"iteration": 2, "lo',
        "cut-dropped.jsonl": line[1] + '{"iteration": 2, "lo',
        "not-json.jsonl": line[1] + "{oops\n" + line[2],
        "no-iteration.jsonl": line[1] + '{"loss": 1}\n',
        "after-checkpoint.jsonl": line[1] + line[2],
        "resumed.jsonl": line[1] + line[2] + '{"iteration": 3, "lo',
        "other-run-then-resumed.jsonl": line[3] + line[1] + line[2],
        "overwritten.jsonl": line[1] + line[2],
    }
    for name, text in files.items():
        (work / name).write_text(text)
    (work / "a-folder.jsonl").mkdir()
    metrics = {name: str(work / name) for name in [*files, "a-folder.jsonl"]}
    one = base + ["--train-iters", "1"]
    at_1 = base + ["--train-iters", "2", "--load", str(ckpt / "iter_0000001")]
    cases = [
        (one + ["--metrics-file", metrics["cut.jsonl"], "--append-metrics-file"], str(work), None),
        (one + ["--metrics-file", metrics["cut-dropped.jsonl"], "--append-metrics-file", "--drop-cut-metrics-line"],
         str(work), None),
        (at_1 + ["--metrics-file", metrics["not-json.jsonl"]], str(work), None),
        (one + ["--metrics-file", metrics["no-iteration.jsonl"], "--append-metrics-file"], str(work), None),
        (at_1 + ["--metrics-file", metrics["after-checkpoint.jsonl"], "--append-metrics-file"], str(work), None),
        (at_1 + ["--metrics-file", metrics["resumed.jsonl"]], str(work), None),
        (at_1 + ["--metrics-file", metrics["other-run-then-resumed.jsonl"]], str(work), None),
        (at_1 + ["--metrics-file", metrics["overwritten.jsonl"], "--overwrite-metrics-file"], str(work), None),
        (one + ["--metrics-file", metrics["a-folder.jsonl"]], str(work), None),
    ]
    (cut, dropped, not_json, no_iteration, after, resumed, other_run, overwritten, folder), = run_cases(
        tmp_path, 1, cases)
    assert_refused(cut, f"--metrics-file {metrics['cut.jsonl']} line 2 was cut (it has no newline",
                   "pass --drop-cut-metrics-line")
    assert dropped["code"] == 0, dropped["err"]
    assert _rows(metrics["cut-dropped.jsonl"]) == [1, 1]  # the other run's line, then this run's
    assert_refused(not_json, f"--metrics-file {metrics['not-json.jsonl']} line 2: not JSON (")
    assert_refused(no_iteration, f"--metrics-file {metrics['no-iteration.jsonl']} line 2: a JSON object with an "
                                 f"integer 'iteration' is expected")
    assert_refused(after, f"--metrics-file {metrics['after-checkpoint.jsonl']} ends with 1 lines of iterations after "
                          f"the checkpoint's 1 (from iteration 2)", "leave out --append-metrics-file")
    assert resumed["code"] == 0, resumed["err"]
    assert _rows(metrics["resumed.jsonl"]) == [1, 2]  # iteration 2 and the cut 3 dropped, 2 written again
    assert (f" warning: --metrics-file {metrics['resumed.jsonl']} line 3 was cut (no newline: a run stopped while "
            f"writing it) and is dropped, with the metrics of iteration 3; this run, resumed at iteration 1, runs it "
            f"again\n") in resumed["out"]
    assert "was cut" not in other_run["out"]
    assert other_run["code"] == 0 and _rows(metrics["other-run-then-resumed.jsonl"]) == [3, 1, 2]
    assert overwritten["code"] == 0 and _rows(metrics["overwritten.jsonl"]) == [2]
    assert (f"warning: --overwrite-metrics-file with --load: the 2 lines of --metrics-file "
            f"{metrics['overwritten.jsonl']} are dropped") in overwritten["out"]
    assert_refused(folder, f"--metrics-file {metrics['a-folder.jsonl']} is a folder")
    assert "--append-metrics-file" not in error_line(folder)


def test_metrics_file_lines_are_read_with_their_numbers(tmp_path):
    from megatron_r3.rl.metrics_file import MetricsFileError, read_metrics_lines

    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"iteration": 1}\n\n{"iteration": 2}\n{"iteration": 3')
    lines = read_metrics_lines(str(path))
    assert lines.iterations == [1, 2] and lines.cut_line == 4 and lines.complete_end() == 35
    assert lines.trailing_after(1) == 1 and lines.trailing_after(0) == 2 and lines.trailing_after(5) == 0
    for raw, message in ((b'{"iteration": 1}\n\xff\n', r"line 2: not UTF-8 text \(byte 0xff at column 1\)"),
                         (b'[1, 2]\n', r"line 1: a JSON object with an integer 'iteration' is expected"),
                         (b'{"iteration": true}\n', r"line 1: a JSON object with an integer 'iteration'")):
        path.write_bytes(raw)
        with pytest.raises(MetricsFileError, match=f"--metrics-file {path} {message}"):
            read_metrics_lines(str(path))


@pytest.mark.parametrize("text, resumed, lost", [
    (b'{"iteration": 4, "lo', 3, "iteration 4; this run, resumed at iteration 3, runs it again"),
    (b'{"iteration": 1', 3, "the iteration after 3 (its number was cut too); this run, resumed at iteration 3, runs "
                            "it again"),
    (b'{"iter', None, "the iteration after 3 (its number was cut too); this run, from scratch, runs it again"),
    (b'{"iteration": 2}', 3, "iteration 2"),
])
def test_a_dropped_cut_line_is_named_with_the_iteration_it_held(tmp_path, text, resumed, lost):
    from megatron_r3.rl.metrics_file import cut_line_warning

    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"iteration": 2}\n{"iteration": 3}\n' + text)
    assert cut_line_warning(str(path), resumed) == (
        f"warning: --metrics-file {path} line 3 was cut (no newline: a run stopped while writing it) and is dropped, "
        f"with the metrics of {lost}")
    path.write_bytes(b'{"iteration": 2}\n')
    assert cut_line_warning(str(path), resumed) is None


# A full disk: a tmpfs of a few pages more or less than one checkpoint.

@pytest.fixture
def small_disk(tmp_path):
    """``mount(size)``: a tmpfs of ``size`` bytes under ``tmp_path``, unmounted after the test."""
    mounted = []

    def mount(size):
        point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={-(-size // 4096) * 4096}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def _fill(folder):
    """Writes one file into ``folder`` until its filesystem is full."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def _size(folder):
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def test_a_full_disk_stops_before_training_or_at_the_save_with_nothing_partial_left(tmp_path, small_disk):
    work = tmp_path / "work"
    work.mkdir()
    dump = write_dump(work / "rollouts.r3dump")
    base = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "2", "--save-interval", "1"]
    (sized,), = run_cases(tmp_path, 1, [(base + ["--train-iters", "1", "--save", str(work / "sized")],
                                         str(work), None)])
    one = _size(work / "sized" / "iter_0000001")
    too_small, one_and_a_half, full = small_disk(one // 2), small_disk(one * 3 // 2), small_disk(64 * 1024)
    _fill(full)
    cases = [
        (base + ["--save", str(too_small / "ckpt")], str(too_small), None),
        (base + ["--save", str(one_and_a_half / "ckpt")], str(one_and_a_half), None),
        (DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "1", "--metrics-file", str(full / "metrics.jsonl")],
         str(work), None),
    ]
    (refused, midway, metrics), = run_cases(tmp_path, 1, cases)
    assert_refused(refused, f"--save {too_small / 'ckpt'}: one checkpoint needs about ", " bytes: the models' weights and "
                            f"the optimizer's state), the filesystem of {too_small} has ")
    assert os.listdir(too_small) == []
    assert midway["code"] == 1 and midway["before"] == {}
    match = re.match(rf"pretrain_gpt_r3.py: error: --save: saving iteration 2 into "
                    rf"{one_and_a_half / 'ckpt' / 'iter_0000002.saving'} failed \((\d+) bytes were free on its "
                     rf"filesystem\): ", error_line(midway))
    assert match and int(match.group(1)) < 64 * 1024, error_line(midway)  # the disk filled up
    assert error_line(midway).endswith(
        f"the partial folder was removed, {one_and_a_half / 'ckpt' / 'latest_checkpointed_iteration.txt'} still "
        f"names iteration 1")
    assert sorted(os.listdir(one_and_a_half / "ckpt")) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert metrics["code"] == 1 and error_line(metrics) == (
        f"pretrain_gpt_r3.py: error: --metrics-file {full / 'metrics.jsonl'}: cannot write the line of iteration 1: "
        f"No space left on device")


def test_a_metrics_file_that_cannot_be_written_is_refused_before_training_naming_the_flag(tmp_path, small_disk):
    """A read-only filesystem: the existing file (a resumed run appends to it) and a new one in its folder.
    Before, the run stopped at its first line with a bare "[Errno 30] Read-only file system"."""
    work = tmp_path / "work"
    work.mkdir()
    dump = write_dump(work / "rollouts.r3dump")
    disk = small_disk(64 * 1024)
    (disk / "metrics.jsonl").write_text('{"iteration": 1, "loss": 0.5}\n')
    done = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"remounting the tmpfs read-only is not permitted here: {done.stderr.strip()}")
    base = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "1"]
    cases = [
        (base + ["--metrics-file", str(disk / "metrics.jsonl"), "--append-metrics-file"], str(disk), None),
        (base + ["--metrics-file", str(disk / "new.jsonl")], str(disk), None),
    ]
    (existing, new), = run_cases(tmp_path, 1, cases)
    assert_refused(existing, f"--metrics-file {disk / 'metrics.jsonl'} cannot be written: Read-only file system")
    assert_refused(new, f"--metrics-file {disk / 'new.jsonl'}: cannot create a file in {disk} (OSError: Read-only "
                        f"file system)")


def _estimate(argv):
    from megatron.core import parallel_state

    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.checkpoint.space import checkpoint_bytes
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.run import checkpoint_models, setup

    settings = run_settings(parse_args(argv))
    run = setup(settings, initialize(settings), lambda line: None)
    try:
        return checkpoint_bytes(checkpoint_models(run), run.trainer.stack.optimizer)
    finally:
        run.source.close()
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ranks, flags", [(1, []), (1, ["--use-distributed-optimizer", "--bf16"]),
                                          (2, ["--expert-model-parallel-size", "2", "--global-batch-size", "4"])],
                         ids=["fp32", "bf16-distributed-optimizer", "ep2-dp2"])
def test_the_size_of_a_checkpoint_is_known_before_it_is_written(tmp_path, ranks, flags):
    """The estimate is at least what a save writes, and not much more."""
    argv = DUMP_FLAGS + ["--rollout-dump", write_dump(tmp_path / "rollouts.r3dump"), "--train-iters", "1", *flags]
    estimate = run_workers(_estimate, ranks, argv, backend="gloo")[0]
    (saved,) = run_cases(tmp_path, ranks, [(argv + ["--save", str(tmp_path / "ckpt")], str(tmp_path), None)])[:1]
    assert saved[0]["code"] == 0, saved[0]["err"]
    written = _size(tmp_path / "ckpt" / "iter_0000001")
    assert written <= estimate <= 1.5 * written, (written, estimate)


# The same sample twice, and groups of one sample: warned of, and trained.

def test_repeated_samples_and_groups_of_one_are_warned_of(tmp_path):
    from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
    from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
    from tests.test_launch import EXPERTS, TOPK

    work = tmp_path / "work"
    work.mkdir()
    good = write_dump(work / "good.r3dump")
    repeated = str(work / "repeated.r3dump")
    with RolloutDumpReader(good) as reader, RolloutDumpWriter(repeated, num_experts=EXPERTS, topk=TOPK,
                                                               layer_numbers=(2, 4)) as writer:
        samples = list(reader)
        for sample in samples[:4] + [samples[1], samples[2]]:
            writer.write(sample)
    one = DUMP_FLAGS + ["--train-iters", "1"]
    cases = [
        (one + ["--rollout-dump", repeated], str(work), None),
        (one + ["--rollout-dump", good, "--rollouts-per-prompt", "1"], str(work), None),
        (EMBEDDED_FLAGS + ["--rollouts-per-prompt", "1"], str(work), None),
        (one + ["--rollout-dump", good], str(work), None),
    ]
    (twice, dump_groups, embedded_groups, clean), = run_cases(tmp_path, 1, cases)
    assert all(result["code"] == 0 for result in (twice, dump_groups, embedded_groups, clean))
    assert (f"warning: rollout dump {repeated}: 2 records repeat an earlier one (the same tokens, log-probs, routes "
            f"and metadata): record 4 = record 1, record 5 = record 2; each trains as often as it appears"
            in twice["out"])
    for result in (dump_groups, embedded_groups):
        assert ("warning: --rollouts-per-prompt 1: each group holds one sample, so every group-normalised advantage "
                "is 0") in result["out"]
    assert "warning" not in clean["out"] and "warning: --rollouts" not in twice["out"]
