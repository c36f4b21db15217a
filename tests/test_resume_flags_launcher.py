"""Resuming from a checkpoint: the flags that change what is trained must be the checkpoint's.

A checkpoint keeps its run's flags; a resumed run whose model, routing, rollout data or staleness
flags differ stops before anything is built, with one line per flag naming both values, and
nothing written. ``--use-checkpoint-args`` takes them from the checkpoint (Megatron-LM's flag);
``--no-load-optim`` and ``--no-load-rng`` resume without the optimizer state or the RNG states. A
dump run resumes only on the same dump (compared by content: a copy elsewhere resumes).
"""

import os
import re
import shutil

from megatron_r3.rl.arguments import parse_args
from megatron_r3.rl.checkpoint.resume_flags import COMPARED_FLAGS, RESUMABLE_FLAGS, flag_mismatches
from tests.test_bad_input_launcher import assert_refused, run_cases
from tests.test_launch import DUMP_FLAGS, EMBEDDED_FLAGS, REPO, write_dump
from tools.synthetic_rollout_dump import write_synthetic_dump

PREFIX = "pretrain_gpt_r3.py: error: "


def refused_lines(result):
    """The error lines of a run refused before it wrote anything."""
    assert result["code"] == 1, (result["code"], result["err"], result["out"][-2000:])
    assert "Traceback" not in result["err"], result["err"]
    assert result["after"] == result["before"], "a file was created, changed or lost"
    return [line[len(PREFIX):] for line in result["err"].splitlines() if line.startswith(PREFIX)]


def test_every_flag_is_either_compared_on_resume_or_may_change_and_the_docs_list_those_that_may():
    flags = set(vars(parse_args([])))
    assert set(COMPARED_FLAGS) | RESUMABLE_FLAGS == flags and not set(COMPARED_FLAGS) & RESUMABLE_FLAGS
    with open(os.path.join(REPO, "docs", "checkpoints.md")) as f:
        docs = f.read()
    section = docs[docs.index("## Resuming: the flags"):]
    section = section[:section.index("\n## ", 1)]
    listed = {name.replace("-", "_") for name in re.findall(r"`--([a-z0-9-]+)", section)}
    # A switch is listed by its --no- form where that is the flag (--no-rollout-cuda-graphs).
    listed |= {name[3:] for name in listed if name.startswith("no_") and name[3:] in flags}
    assert RESUMABLE_FLAGS <= listed, sorted(RESUMABLE_FLAGS - listed)
    assert all(name in listed for name in COMPARED_FLAGS), sorted(set(COMPARED_FLAGS) - listed)


def test_two_spellings_of_the_same_moe_layers_and_a_moved_dump_are_no_mismatch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    for path in ("a.r3dump", "elsewhere/a.r3dump"):
        (tmp_path / path).touch()  # the flags only ask that the file exists
    saved = vars(parse_args(DUMP_FLAGS + ["--rollout-dump", "a.r3dump"]))
    given = vars(parse_args(DUMP_FLAGS[:2] + ["--moe-layer-freq", "[0, 1, 0, 1]"] + DUMP_FLAGS[4:]
                            + ["--rollout-dump", "elsewhere/a.r3dump"]))
    assert flag_mismatches(saved, given, "DIR/iter_0000001") == []
    # The built-in task's flags do not count between two dump runs; a run without the dump reads them.
    assert flag_mismatches(saved, {**given, "task": "copy", "seed": 7}, "DIR/iter_0000001") == []
    other = vars(parse_args(DUMP_FLAGS[:2] + ["--moe-layer-freq", "2"] + DUMP_FLAGS[4:]))
    hint = "so it must match to resume (--use-checkpoint-args takes the checkpoint's)"
    assert flag_mismatches(saved, other, "DIR/iter_0000001") == [
        f"--load DIR/iter_0000001 was saved with --moe-layer-freq 0,1,0,1, this run gives --moe-layer-freq 2: it "
        f"changes the model, {hint}",
        f"--load DIR/iter_0000001 was saved with --rollout-dump a.r3dump, this run gives --rollout-dump unset: it "
        f"changes the rollout data, {hint}",
        f"--load DIR/iter_0000001 was saved with --max-new-tokens unset, this run gives --max-new-tokens 7: it "
        f"changes the rollout data, {hint}"]


def test_a_resumed_run_refuses_other_model_routing_data_or_staleness_flags_naming_each(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    ckpt = work / "ckpt"
    base = EMBEDDED_FLAGS + ["--moe-enable-routing-replay", "--rollout-staleness", "1"]
    (saved,), = run_cases(tmp_path, 1, [(base + ["--save", str(ckpt)], str(work), None)])
    assert saved["code"] == 0, saved["err"]
    resume = base + ["--train-iters", "2", "--load", str(ckpt)]
    cases = [
        (resume + ["--moe-router-score-function", "sigmoid", "--moe-router-topk", "1", "--rollout-staleness", "0"],
         str(work), None),
        (resume + ["--rollout-staleness", "2"], str(work), None),
        (resume + ["--seed", "7", "--hidden-size", "64"], str(work), None),
        # What may change: the iterations, the logging, the RNG states (--no-load-rng).
        (resume + ["--log-interval", "2", "--no-load-rng"], str(work), None),
        (resume + ["--moe-router-topk", "1", "--rollout-staleness", "0", "--use-checkpoint-args"], str(work), None),
    ]
    for rank, (routing, staleness, model, allowed, taken) in enumerate(run_cases(tmp_path, 2, cases)):
        where = f"--load {ckpt / 'iter_0000001'} was saved with"
        hint = "so it must match to resume (--use-checkpoint-args takes the checkpoint's)"
        assert refused_lines(routing) == [  # said by rank 0, one line per flag
            f"{where} --moe-router-topk 2, this run gives --moe-router-topk 1: it changes the routing, {hint}",
            f"{where} --moe-router-score-function softmax, this run gives --moe-router-score-function sigmoid: it "
            f"changes the routing, {hint}",
            f"{where} --rollout-staleness 1, this run gives --rollout-staleness 0: it changes the rollouts' "
            f"staleness, {hint}"][:3 if rank == 0 else 0]
        # Before, a larger staleness stopped at the load: "the checkpoint has no tensor rollout_lag1...".
        assert_refused(staleness, f"{where} --rollout-staleness 1, this run gives --rollout-staleness 2: it changes "
                                  f"the rollouts' staleness")
        assert refused_lines(model) == [
            f"{where} --hidden-size 32, this run gives --hidden-size 64: it changes the model, {hint}",
            f"{where} --seed 1234, this run gives --seed 7: it changes the rollout data, {hint}"][:2 if rank == 0 else 0]
        assert allowed["code"] == 0, allowed["err"]
        assert taken["code"] == 0, taken["err"]
        said = (" --use-checkpoint-args: --moe-router-topk 2 from the checkpoint (the flags say --moe-router-topk 1)\n"
                " --use-checkpoint-args: --rollout-staleness 1 from the checkpoint (the flags say --rollout-staleness "
                "0)\n")
        assert (said in taken["out"]) == (rank == 0)  # said once
        if rank == 1:  # the logging rank
            assert f" resumed from {ckpt} at iteration 1 (4 samples consumed)" in taken["out"]
            assert f" resumed from {ckpt} at iteration 1 (4 samples consumed)" in allowed["out"]


def test_optimizer_state_of_another_kind_loads_only_without_it_and_a_dump_run_resumes_only_on_its_dump(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    dump = write_dump(work / "rollouts.r3dump")
    other = write_synthetic_dump(str(work / "other.r3dump"), num_samples=6, num_layers=4, moe_layer_freq=[0, 1, 0, 1],
                                 num_experts=4, topk=2, vocab_size=64, seed=1)
    moved = work / "moved"
    moved.mkdir()
    shutil.copy(dump, moved / "rollouts.r3dump")
    ckpt = work / "ckpt"
    base = DUMP_FLAGS + ["--train-iters", "1"]
    (saved,), = run_cases(tmp_path, 1, [(base + ["--rollout-dump", dump, "--save", str(ckpt)], str(work), None)])
    assert saved["code"] == 0, saved["err"]
    resume = DUMP_FLAGS + ["--train-iters", "2", "--load", str(ckpt)]
    cases = [
        (resume + ["--rollout-dump", other], str(work), None),
        (resume + ["--rollout-dump", str(moved / "rollouts.r3dump")], str(work), None),
        (resume + ["--rollout-dump", dump, "--use-distributed-optimizer"], str(work), None),
        (resume + ["--rollout-dump", dump, "--use-distributed-optimizer", "--no-load-optim"], str(work), None),
    ]
    (other_dump, moved_dump, distributed, without_optimizer), = run_cases(tmp_path, 1, cases)
    assert_refused(other_dump, f"--rollout-dump {other} holds 6 records of digest ", f", the dump --load "
                               f"{ckpt / 'iter_0000001'} trained on 6 of digest ", ": it changes the rollout data, so "
                               f"it must be the same dump to resume")
    assert moved_dump["code"] == 0, moved_dump["err"]
    assert_refused(distributed, "the checkpoint has no tensor optimizer.state.param.")
    assert without_optimizer["code"] == 0, without_optimizer["err"]
    assert f"resumed from {ckpt} at iteration 1" in without_optimizer["out"]
