"""Bad input to launch/pretrain_gpt_r3.py: refused before the first iteration, in one line, with nothing lost.

Flag errors are checked in-process (``parse_args`` exits with status 2). Everything
that needs ranks runs ``main`` itself in gloo workers, several cases one after the
other in the same workers (a fresh process group per case), each reporting its
exit status, its stderr and the checksums of every file of its folder before and
after. A non-finite loss (a poisoned weight) stops the step before the optimizer;
one case runs under a real ``torchrun`` to show the process's exit status.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.formats.dump_writer import RolloutDumpWriter
from tests.support.launcher import run_workers
from tests.support.planted import snapshot, unchecked_writer
from tests.test_launch import DUMP_FLAGS, EMBEDDED_FLAGS, EXPERTS, REPO, TOPK, write_dump


def parse(argv, capsys):
    from megatron_r3.rl.arguments import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    return exit_info.value.code, capsys.readouterr().err


FLAG_CASES = [
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--rollouts-per-prompt", "0"], "--rollouts-per-prompt must be >= 1, got 0"),
    (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
    (["--train-iters", "-1"], "--train-iters must be >= 1, got -1"),
    (["--save", "ckpt", "--save-interval", "0"], "--save-interval must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--clip-ratio", "0"], "--clip-ratio must be a finite number > 0, got 0.0"),
    (["--rollout-temperature", "-1"], "--rollout-temperature must be a finite number > 0, got -1.0"),
    (["--seed", "-5"], "--seed must be >= 0, got -5"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--moe-router-topk", "9"], "--moe-router-topk 9 is larger than --num-experts 8"),
    (["--hidden-size", "130"], "--hidden-size 130 is not divisible by --num-attention-heads 4"),
    (["--num-query-groups", "3"], "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--tensor-model-parallel-size", "3"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size must be >= 1, got 0"),
    (["--expert-tensor-parallel-size", "3"],
     "--moe-ffn-hidden-size 128 is not divisible by the experts' tensor-parallel size 3"),
    (["--tensor-model-parallel-size", "2", "--add-bias-linear"],
     "--add-bias-linear needs the experts' tensor-parallel size 1 (Megatron has no MoE biases under expert-TP), "
     "it is 2: pass --expert-tensor-parallel-size 1"),
    (["--add-bias-linear", "--disable-bias-linear"],
     "argument --disable-bias-linear: not allowed with argument --add-bias-linear"),
    (["--moe-layer-freq", "0,1"], "--moe-layer-freq 0,1 with --num-layers 8: "),
    (["--num-layers", "7", "--pipeline-model-parallel-size", "2"],
     "--num-layers 7, --pipeline-model-parallel-size 2: num_layers=7 should be divisible by "
     "config.pipeline_model_parallel_size=2"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "10"],
     "--num-layers 8, --pipeline-model-parallel-size 2, --decoder-first-pipeline-num-layers 10: the pipeline chunks "
     "would build [10, -2] layers, not each of the 8 layers once"),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "3"],
     "--num-layers 8, --pipeline-model-parallel-size 3, --decoder-first-pipeline-num-layers 3: number of layers at "
     "middle stage: 5 must be divisible by"),
    (["--num-virtual-stages-per-pipeline-rank", "2"],
     "--num-virtual-stages-per-pipeline-rank and --decoder-first/last-pipeline-num-layers need "
     "--pipeline-model-parallel-size > 1"),
    (["--micro-batch-size", "8", "--seq-length", "16"],
     "--seq-length 16 cannot hold --micro-batch-size 8 samples of up to 15 tokens"),
    (["--rollout-dump", "x.r3dump", "--vocab-size", "64", "--seq-length", "30", "--context-parallel-size", "2"],
     "--seq-length 30 is not a multiple of 4 (2 x --context-parallel-size 2 when > 1"),
    (["--rollout-dump", "x.r3dump", "--vocab-size", "64", "--seq-length", "64", "--max-position-embeddings", "32"],
     "--max-position-embeddings 32 is smaller than --seq-length 64"),
    (["--task-min-symbols", "5", "--task-max-symbols", "4"],
     "--task-min-symbols 5 is larger than --task-max-symbols 4"),
    (["--rollout-dump", "missing.r3dump"], "--rollout-dump missing.r3dump: no such file"),
    (["--rollout-dump", "."], "--rollout-dump .: a folder, not a rollout dump"),
    (["--load-optional"], "--load-optional needs --load"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--no-load-optim", "--no-load-rng"], "--no-load-optim needs --load"),
    (["--overwrite-metrics-file"], "--overwrite-metrics-file needs --metrics-file"),
    (["--allow-truncated-rollout-dump"], "--allow-truncated-rollout-dump needs --rollout-dump"),
    (["--drop-cut-metrics-line"], "--drop-cut-metrics-line needs --metrics-file"),
    (["--metrics-file", "m.jsonl", "--append-metrics-file", "--overwrite-metrics-file"],
     "argument --overwrite-metrics-file: not allowed with argument --append-metrics-file"),
    (["--inference-cuda-graph-scope", "block", "--no-rollout-cuda-graphs"],
     "--inference-cuda-graph-scope block sets what Megatron's engine's CUDA graphs hold, and --no-rollout-cuda-graphs "
     "runs none"),
    (["--inference-cuda-graph-scope", "block", "--rollout-engine", "local"],
     "--inference-cuda-graph-scope block sets what Megatron's engine's CUDA graphs hold, and --rollout-engine local "
     "runs none"),
    (["--clip-grad", "-1"], "--clip-grad must be a finite number >= 0.0, got -1.0"),
    (["--adam-beta2", "1"], "--adam-beta2 must be a finite number >= 0.0 and < 1.0, got 1.0"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0, got 0.0"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1, got 0"),
    (["--min-lr", "1e-3"], "--min-lr 0.001 is larger than --lr 0.0001"),
    (["--lr-warmup-iters", "40"], "--lr-warmup-iters 40 must be smaller than --lr-decay-iters 40 (default: "
                                  "--train-iters)"),
    (["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"],
     "argument --use-checkpoint-opt-param-scheduler: not allowed with argument --override-opt-param-scheduler"),
    (["--hybrid-layer-pattern", "*E?E"], "--hybrid-layer-pattern '*E?E': '?' at position 3: not a layer symbol"),
    (["--hybrid-layer-pattern", "*E*E/*|E"],
     "--hybrid-layer-pattern '*E*E/*|E': '|' at position 7: MTP layers (after '/') take no pipeline split"),
    (["--hybrid-layer-pattern", "|/*E"], "--hybrid-layer-pattern '|/*E' has no decoder layer before its first '/'"),
    (["--hybrid-layer-pattern", "*E*E/*E/E*"],
     "--hybrid-layer-pattern '*E*E/*E/E*': MTP depth 2 is 'E*', depth 1 '*E'"),
    (["--hybrid-layer-pattern", "*E+E"], "mixes attention ('*') with MLA ('+') or DSA ('D') layers"),
    (["--hybrid-layer-pattern", "*E*E", "--num-layers", "8"],
     "--num-layers 8 does not match --hybrid-layer-pattern '*E*E', which has 4 layers"),
    (["--hybrid-layer-pattern", "*E*E", "--moe-layer-freq", "2"],
     "--moe-layer-freq 2 with --hybrid-layer-pattern '*E*E': the pattern's 'E' layers are the MoE layers"),
    (["--hybrid-layer-pattern", "*E*E/*E"], "--hybrid-layer-pattern '*E*E/*E' has MTP layers (after '/')"),
    (["--hybrid-layer-pattern", "*E|*E"],
     "--hybrid-layer-pattern '*E|*E' has 2 '|' segments: pipeline segments need --pipeline-model-parallel-size > 1"),
    (["--hybrid-layer-pattern", "*E|*E|*E", "--pipeline-model-parallel-size", "2"],
     "has 3 '|' segments, not a multiple of --pipeline-model-parallel-size 2"),
    (["--hybrid-layer-pattern", "*E|*E|*E|*E", "--pipeline-model-parallel-size", "2",
      "--num-virtual-stages-per-pipeline-rank", "2"],
     "--num-virtual-stages-per-pipeline-rank with --hybrid-layer-pattern '*E|*E|*E|*E': the pattern's '|' "
     "segments make the virtual stages"),
    (["--hybrid-layer-pattern", "*E|*E", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "1"],
     "--decoder-first/last-pipeline-num-layers with --hybrid-layer-pattern '*E|*E': its '|' segments are the "
     "pipeline stages"),
    (["--hybrid-layer-pattern", "*E*E*", "--pipeline-model-parallel-size", "2"],
     "--hybrid-layer-pattern '*E*E*', --pipeline-model-parallel-size 2: num_layers=5 should be divisible by "
     "config.pipeline_model_parallel_size=2"),
]


@pytest.mark.parametrize("flags, message", FLAG_CASES, ids=[" ".join(f) for f, _ in FLAG_CASES])
def test_flags_that_do_not_add_up_are_refused_in_one_line(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)  # relative paths in the flags land here
    (tmp_path / "x.r3dump").touch()  # a dump the flags name exists (its content is read later)
    before = snapshot(tmp_path)
    code, err = parse(flags, capsys)
    assert code == 2
    assert message in err, err
    if "not allowed with" not in message:  # argparse's own errors come with its usage block
        assert all(line.startswith("pretrain_gpt_r3.py: error: ") for line in err.splitlines()), err
    assert snapshot(tmp_path) == before


def test_every_flag_problem_gets_its_own_line(capsys):
    code, err = parse(["--num-experts", "6", "--expert-model-parallel-size", "4", "--moe-router-topk", "7"], capsys)
    assert code == 2 and err.splitlines() == [
        "pretrain_gpt_r3.py: error: --moe-router-topk 7 is larger than --num-experts 6",
        "pretrain_gpt_r3.py: error: --num-experts 6 is not divisible by --expert-model-parallel-size 4"]


def test_a_dump_that_is_not_there_is_said_before_the_flags_a_dump_needs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = parse(["--rollout-dump", "rollouts.r3dump"], capsys)  # no --vocab-size, no --seq-length
    assert code == 2 and err.splitlines() == ["pretrain_gpt_r3.py: error: --rollout-dump rollouts.r3dump: no such file"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_only_rank_0_prints_the_usage_and_flag_errors(capsys, monkeypatch, rank):
    """Every rank parses the same flags: a misspelt flag printed argparse's usage once per rank."""
    monkeypatch.setenv("RANK", rank)
    for flags in (["--sav", "x"], ["--micro-batch-size", "0"]):
        code, err = parse(flags, capsys)
        assert code == 2
        if rank == "0":
            assert err.count("usage: pretrain_gpt_r3.py") == (1 if flags[0] == "--sav" else 0)
            assert err.splitlines()[-1].startswith("pretrain_gpt_r3.py: error: "), err
        else:
            assert err == ""


def test_without_torchrun_the_launcher_says_how_to_start_it(monkeypatch):
    from megatron_r3.rl.initialize import TORCHRUN_VARIABLES, init_process_group
    from megatron_r3.rl.run_checks import RunCheckError

    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RunCheckError) as refused:
        init_process_group(torch.device("cpu"))
    assert str(refused.value) == (
        "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set: torchrun sets them for each process it "
        "starts; start the launcher with it: torchrun --nproc-per-node N launch/pretrain_gpt_r3.py [flags] (N "
        "processes; 1 for one)")


def test_under_torchrun_an_error_is_one_line_from_rank_0_then_torchruns_own_report(tmp_path):
    """What a user sees (docs/launcher.md, "What torchrun shows"): the launcher's line once, then torchrun's
    log line and its ChildFailedError report, which follows every non-zero exit of a worker."""
    (tmp_path / "a-file").write_text("not a folder")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "launch/pretrain_gpt_r3.py", *EMBEDDED_FLAGS, "--save", str(tmp_path / "a-file" / "ckpt")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "pretrain_gpt_r3.py: error:" in line]
    assert errors == [f"pretrain_gpt_r3.py: error: --save {tmp_path / 'a-file' / 'ckpt'} is not writable on rank 0: "
                      f"{tmp_path / 'a-file'} is a file, not a folder (and on ranks [1])"], done.stderr[-3000:]
    assert "usage:" not in done.stderr
    # torchrun's own report: its traceback ends in ChildFailedError, naming each worker's exit status.
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in done.stderr
    assert re.search(r"exitcode\s*: 1 ", done.stderr), done.stderr[-3000:]


# Cases run through main() in workers.

def _main_cases(cases, store_dir):
    """Runs ``launch.pretrain_gpt_r3.main`` once per case ``(argv, folder, hook)`` in this worker.

    ``hook`` (a name in HOOKS, a module-level function of the same form, or None) changes the run
    before it trains; it may leave callables under ``seen["undo"]`` that undo what else it changed.
    Returns per case the exit status, stderr, stdout, checksums of ``folder`` before and after, and
    what the hook saw.
    """
    from launch import pretrain_gpt_r3 as launcher
    from megatron_r3.rl import run as rl_run

    original_setup = rl_run.setup
    results = []
    for number, (argv, folder, hook) in enumerate(cases):
        if not dist.is_initialized():  # main() ends the process group; the next case joins a fresh one
            dist.init_process_group("gloo", init_method=f"file://{store_dir}/case-{number}",
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        seen = {}
        make = HOOKS.get(hook) if isinstance(hook, str) else hook
        rl_run.setup = original_setup if make is None else make(original_setup, seen)
        dist.barrier()
        before = snapshot(folder)
        dist.barrier()
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                launcher.main(argv)
                code = 0
            except SystemExit as exit_info:
                code = exit_info.code
        if dist.is_initialized():
            dist.barrier()
        for undo in seen.pop("undo", []):
            undo()
        results.append({"rank": int(os.environ["RANK"]), "code": code, "err": err.getvalue(), "out": out.getvalue(),
                        "before": before, "after": snapshot(folder), "seen": _finish_hook(seen)})
    rl_run.setup = original_setup
    return results


def _poison_final_norm(setup, seen):
    """After setup: a NaN in the policy's final layer norm, so the loss is NaN; keeps the weights to compare."""
    def poisoned(settings, device, log=print):
        run = setup(settings, device, log)
        with torch.no_grad():
            run.trainer.stack.chunks[-1].decoder.final_layernorm.weight[0] = float("nan")
        seen["run"] = run
        seen["weights"] = [p.detach().clone() for c in run.trainer.stack.chunks for p in c.parameters()]
        return run
    return poisoned


def _finish_hook(seen):
    if "run" not in seen:
        return dict(seen)  # what else the hook noted
    run = seen["run"]
    after = [p.detach() for c in run.trainer.stack.chunks for p in c.parameters()]
    return {"optimizer_state": len(run.trainer.stack.optimizer.state),
            "weights_unchanged": all(torch.equal(a.nan_to_num(), b.nan_to_num())
                                     for a, b in zip(seen["weights"], after))}


HOOKS = {"poison": _poison_final_norm}


def run_cases(tmp_path, ranks, cases):
    store_dir = tempfile.mkdtemp(prefix="stores-", dir=tmp_path)  # one per call: a test may run several
    return run_workers(_main_cases, ranks, cases, str(store_dir), backend="gloo", timeout=300)


def error_line(result):
    """The launcher's one error line (stderr may also hold Megatron's warnings, never a traceback)."""
    assert "Traceback" not in result["err"], result["err"]
    (line,) = [line for line in result["err"].splitlines() if line.startswith("pretrain_gpt_r3.py: error: ")]
    return line


def assert_refused(result, *messages):
    """The run stopped (every rank, exit status 1) with nothing written; rank 0 said why in one line naming
    ``messages``, and the other ranks, which stopped for the same reason, said nothing."""
    assert result["code"] == 1, (result["code"], result["err"], result["out"][-2000:])
    if result["rank"] == 0:
        line = error_line(result)
        for message in messages:
            assert message in line, line
    else:
        assert "Traceback" not in result["err"] and "pretrain_gpt_r3.py: error: " not in result["err"], result["err"]
    assert result["after"] == result["before"], "a file was created, changed or lost"


def test_world_size_arithmetic_is_refused_before_the_parallel_state(tmp_path):
    (tmp_path / "work").mkdir()
    work = str(tmp_path / "work")
    cases = [
        (EMBEDDED_FLAGS + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"], work, None),
        (EMBEDDED_FLAGS + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"], work, None),
        (EMBEDDED_FLAGS + ["--global-batch-size", "6"], work, None),
        (EMBEDDED_FLAGS + ["--rollouts-per-prompt", "4", "--global-batch-size", "4"], work, None),
        (EMBEDDED_FLAGS + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"], work, None),
    ]
    for rank in run_cases(tmp_path, 2, cases):
        tp_cp, tp_ep, batch, groups, etp_ep = rank
        assert_refused(tp_cp, "2 ranks do not divide into --tensor-model-parallel-size 2 x "
                              "--pipeline-model-parallel-size 1 x --context-parallel-size 2 = 4")
        assert_refused(tp_ep, "2 ranks do not divide into --tensor-model-parallel-size 2 x "
                              "--expert-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 4")
        assert_refused(etp_ep, "2 ranks do not divide into --expert-tensor-parallel-size 2 x "
                               "--expert-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 4")
        assert_refused(batch, "--global-batch-size 6 is not a multiple of --micro-batch-size 2 x data-parallel size "
                              "2 = 4")
        assert_refused(groups, "each data-parallel rank's 2 samples (--global-batch-size 4 / data-parallel size 2) "
                               "are not whole groups of --rollouts-per-prompt 4")


def _dump_with(path, change):
    """A copy of the test dump (6 samples with rewards), ``change(index, sample)`` applied, written unchecked."""
    source = write_dump(str(path) + ".source")
    with unchecked_writer(), RolloutDumpReader(source) as reader, RolloutDumpWriter(
            str(path), num_experts=EXPERTS, topk=TOPK, layer_numbers=(2, 4)) as writer:
        for index, sample in enumerate(reader):
            change(index, sample)
            writer.write(sample)
    os.remove(source)
    return str(path)


def _advantages_from(first):
    """Records from ``first`` on carry an advantage instead of a reward."""
    def change(index, sample):
        if index >= first:
            sample.meta = {"advantage": 1.0}
    return change


def _plant(record, field, value):
    def change(index, sample):
        if index != record:
            return
        if field == "logprobs":
            sample.logprobs[7] = value
        else:
            sample.meta[field] = value
    return change


def test_files_and_dumps_that_cannot_be_used_are_refused_before_training_on_every_rank(tmp_path):
    """--save, --load, --metrics-file and the dump, with --save and --metrics-file set so that any
    iteration run would leave a checkpoint or a metrics line behind; two ranks."""
    work = tmp_path / "work"
    work.mkdir()
    good = write_dump(work / "good.r3dump")
    (work / "a-file").write_text("not a folder")
    (work / "empty").mkdir()
    (work / "metrics-of-another-run.jsonl").write_text('{"iteration": 1, "loss": 0.5}\n')
    cut_data = open(good, "rb").read()
    index = RolloutDumpReader(good).index
    (work / "cut-at-record.r3dump").write_bytes(cut_data[:int(index.offsets[4])])
    (work / "appended.r3dump").write_bytes(cut_data + b"\0" * 7)
    corrupt = bytearray(cut_data)
    corrupt[int(index.offsets[5]) + 40] ^= 0xFF  # record 5: rank 1's share
    (work / "corrupt.r3dump").write_bytes(bytes(corrupt))
    planted = {
        "nan-logprob": _dump_with(work / "nan-logprob.r3dump", _plant(4, "logprobs", np.nan)),
        "positive-logprob": _dump_with(work / "positive-logprob.r3dump", _plant(1, "logprobs", 5.0)),
        "nan-reward": _dump_with(work / "nan-reward.r3dump", _plant(3, "reward", float("nan"))),
        "inf-advantage": _dump_with(work / "inf-advantage.r3dump",
                                    lambda i, s: s.meta.update(advantage=float("inf") if i == 2 else 0.5)),
        "string-reward": _dump_with(work / "string-reward.r3dump", _plant(0, "reward", "high")),
        "mixed": _dump_with(work / "mixed.r3dump", _advantages_from(3)),
    }
    base = DUMP_FLAGS + ["--rollout-dump", good, "--train-iters", "2", "--global-batch-size", "4",
                         "--save", str(work / "ckpt"), "--metrics-file", str(work / "metrics.jsonl")]

    def dump(path):
        return [*base[:base.index("--rollout-dump")], *base[base.index("--rollout-dump") + 2:], "--rollout-dump",
                str(path)]

    cases = [
        (base[:-4] + ["--save", str(work / "a-file" / "ckpt")], str(work), None),
        (base + ["--load", str(work / "empty")], str(work), None),
        (base + ["--load", str(work / "missing")], str(work), None),
        (base + ["--load", str(work / "empty" / "iter_0000002")], str(work), None),
        (base[:-2] + ["--metrics-file", str(work / "metrics-of-another-run.jsonl")], str(work), None),
        (base[:-2] + ["--metrics-file", str(work / "no-such-folder" / "m.jsonl")], str(work), None),
        (dump(work / "cut-at-record.r3dump"), str(work), None),
        (dump(work / "appended.r3dump"), str(work), None),
        (dump(work / "corrupt.r3dump"), str(work), None),
        (dump(work / "a-file"), str(work), None),
        *[(dump(path), str(work), None) for path in planted.values()],
    ]
    for results in run_cases(tmp_path, 2, cases):
        (save, empty, missing, iteration, metrics, metrics_folder, cut, appended, crc, not_a_dump,
         nan_logprob, positive_logprob, nan_reward, inf_advantage, string_reward, mixed) = results
        assert_refused(save, f"--save {work / 'a-file' / 'ckpt'} is not writable on rank 0: {work / 'a-file'} is a "
                             f"file, not a folder (and on ranks [1])")
        assert_refused(empty, f"--load: no checkpoint in {work / 'empty'}: it has no "
                              f"latest_checkpointed_iteration.txt; pass --load-optional to start from scratch when "
                              f"there is none")
        assert_refused(missing, f"--load: no checkpoint in {work / 'missing'}: the directory does not exist; pass "
                                f"--load-optional")
        assert_refused(iteration, f"--load: {work / 'empty' / 'iter_0000002'} is not a complete checkpoint; its run's "
                                  f"checkpoint directory is {work / 'empty'} (complete iterations there: [])")
        assert_refused(metrics, f"--metrics-file {work / 'metrics-of-another-run.jsonl'} exists and this run starts "
                                f"from scratch, so it belongs to another run: pass --append-metrics-file or "
                                f"--overwrite-metrics-file")
        assert_refused(metrics_folder, f"--metrics-file {work / 'no-such-folder' / 'm.jsonl'}: the folder "
                                       f"{work / 'no-such-folder'} does not exist")
        assert_refused(cut, f"--rollout-dump {work / 'cut-at-record.r3dump'} has no footer (its writer did not finish, "
                            f"or the file was cut), so samples may be missing at its end (4 whole samples are "
                            f"there): pass --allow-truncated-rollout-dump")
        assert_refused(appended, "7 bytes follow its footer")
        assert_refused(crc, f"--rollout-dump {work / 'corrupt.r3dump'}: record 5: CRC mismatch (corrupt file)")
        assert_refused(not_a_dump, f"--rollout-dump: {work / 'a-file'} is not a megatron-r3 rollout dump (magic ")
        assert_refused(nan_logprob, "nan-logprob.r3dump: record 4: token 7: logprobs[7] = nan: a rollout log-prob must "
                                    "be finite and <= 0")
        assert_refused(positive_logprob, "record 1: token 7: logprobs[7] = 5.0")
        assert_refused(nan_reward, "nan-reward.r3dump: record 3: meta['reward'] = nan is not finite")
        assert_refused(inf_advantage, "record 2: meta['advantage'] = inf is not finite")
        assert_refused(string_reward, "record 0: meta['reward'] = 'high' is not a number")
        assert_refused(mixed, "mixed.r3dump: record 3 has no 'reward' and record 0 no 'advantage'")
        # Refused before anything was built: no checkpoint folder, no metrics file.
        assert not (work / "ckpt").exists() and not (work / "metrics.jsonl").exists()


def test_a_nan_inside_the_model_stops_the_step_before_the_optimizer_and_any_checkpoint(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    dump = write_dump(work / "rollouts.r3dump")
    argv = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "2", "--save", str(work / "ckpt"),
                         "--save-interval", "1", "--metrics-file", str(work / "metrics.jsonl")]
    embedded = EMBEDDED_FLAGS + ["--save", str(work / "ckpt"), "--metrics-file", str(work / "embedded.jsonl")]
    (trainer, engine), = run_cases(tmp_path, 1, [(argv, str(work), "poison"), (embedded, str(work), "poison")])
    assert trainer["code"] == 1
    assert error_line(trainer) == (
        "pretrain_gpt_r3.py: error: iteration 1: the loss is nan: not finite, so the optimizer did not step and "
        "nothing was saved (a weight or an activation overflowed?)")
    assert trainer["seen"] == {"optimizer_state": 0, "weights_unchanged": True}
    assert engine["code"] == 1 and error_line(engine).startswith(
        "pretrain_gpt_r3.py: error: rollout engine, iteration 1, step 0: the logits of sample 0 are not finite")
    assert engine["seen"]["optimizer_state"] == 0
    # No checkpoint; the metrics files this run created hold no line.
    assert sorted(os.listdir(work)) == ["embedded.jsonl", "metrics.jsonl", "rollouts.r3dump"]
    assert (work / "metrics.jsonl").read_text() == "" and (work / "embedded.jsonl").read_text() == ""


def test_what_the_flags_allow_runs(tmp_path):
    """--append-metrics-file keeps the other run's lines; --load of an iteration folder is that iteration;
    --load-optional starts from scratch; --allow-truncated-rollout-dump trains on the whole samples, warning."""
    work = tmp_path / "work"
    work.mkdir()
    dump = write_dump(work / "rollouts.r3dump")
    data = open(dump, "rb").read()
    cut_at = int(RolloutDumpReader(dump).index.offsets[5]) + 30
    (work / "cut.r3dump").write_bytes(data[:cut_at])
    metrics = work / "metrics.jsonl"
    metrics.write_text('{"iteration": 7, "loss": 0.5}\n')
    ckpt = work / "ckpt"
    base = DUMP_FLAGS + ["--rollout-dump", dump, "--train-iters", "1"]
    cases = [
        (base + ["--save", str(ckpt), "--metrics-file", str(metrics), "--append-metrics-file"], str(work), None),
        (base + ["--load", str(ckpt / "iter_0000001")], str(work), None),
        (DUMP_FLAGS + ["--rollout-dump", str(work / "cut.r3dump"), "--allow-truncated-rollout-dump", "--train-iters",
                       "1", "--global-batch-size", "4", "--load", str(work / "fresh"), "--load-optional"],
         str(work), None),
    ]
    (appended, loaded, truncated), = run_cases(tmp_path, 1, cases)
    assert appended["code"] == 0, appended["err"]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [7, 1] and (ckpt / "iter_0000001").is_dir()
    assert loaded["code"] == 0, loaded["err"]
    assert f"resumed from {ckpt} at iteration 1 (2 samples consumed)" in loaded["out"]
    assert truncated["code"] == 0, truncated["err"]
    assert f"no checkpoint in {work / 'fresh'}: the directory does not exist: starting from scratch" in truncated["out"]
    assert (f"warning: --rollout-dump {work / 'cut.r3dump'} has no footer (its writer did not finish, or the file was "
            f"cut): training on the 5 whole samples recovered, 30 bytes of a cut record dropped") in truncated["out"]
    assert " iteration        1/       1" in truncated["out"]


def test_torchrun_exit_status_for_a_nan_reward_in_the_dump(tmp_path):
    """The process as a user runs it: a non-zero exit, the error in one line, no checkpoint, no metrics file."""
    work = tmp_path / "work"
    work.mkdir()
    dump = _dump_with(work / "rollouts.r3dump", _plant(2, "reward", float("nan")))
    before = snapshot(work)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "launch/pretrain_gpt_r3.py", *DUMP_FLAGS, "--rollout-dump", dump, "--save", str(work / "ckpt"),
         "--metrics-file", str(work / "metrics.jsonl")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("pretrain_gpt_r3.py: error:")]
    assert errors == [f"pretrain_gpt_r3.py: error: --rollout-dump {dump}: record 2: meta['reward'] = nan is not "
                      f"finite"], done.stderr[-3000:]
    assert snapshot(work) == before


def _trainer_guards(argv):
    """PolicyTrainer.step's own checks: samples that enter it, and gradients that are not finite."""
    from megatron_r3.dataplane.sample_checks import SampleValueError
    from megatron_r3.rl.arguments import parse_args, run_settings
    from megatron_r3.rl.initialize import initialize
    from megatron_r3.rl.run import setup
    from megatron_r3.rl.trainer.policy_trainer import NonFiniteStepError

    settings = run_settings(parse_args(argv))
    device = initialize(settings)
    run = setup(settings, device, lambda line: None)
    messages = []
    try:
        batch = run.source.batch(1)
        bad = batch.samples[0]
        bad.logprobs = bad.logprobs.copy()
        bad.logprobs[3] = np.nan
        for samples, advantages in ((batch.samples, batch.advantages), (batch.samples[1:] * 2, [0.0, np.inf])):
            try:
                run.trainer.step(samples, advantages)
            except SampleValueError as error:
                messages.append(str(error))
        # A finite loss with a gradient that is not: an Inf in one reduced gradient, after finalize_model_grads.
        config, finalize = run.trainer.config, run.trainer.config.finalize_model_grads_func

        def finalize_then_overflow(*finalize_args, **kwargs):
            finalize(*finalize_args, **kwargs)
            next(run.trainer.stack.chunks[0].parameters()).main_grad[0] = np.inf

        config.finalize_model_grads_func = finalize_then_overflow
        weights = [p.detach().clone() for c in run.trainer.stack.chunks for p in c.parameters()]
        try:
            run.trainer.step(batch.samples[1:] * 2, [0.5, -0.5])
        except NonFiniteStepError as error:
            messages.append(str(error))
        return {"messages": messages, "optimizer_state": len(run.trainer.stack.optimizer.state),
                "weights_unchanged": all(torch.equal(a, p) for a, p in
                                         zip(weights, (p for c in run.trainer.stack.chunks for p in c.parameters())))}
    finally:
        run.source.close()
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def test_the_trainer_refuses_bad_samples_and_non_finite_gradients(tmp_path):
    dump = write_dump(tmp_path / "rollouts.r3dump")
    (result,) = run_workers(_trainer_guards, 1, DUMP_FLAGS + ["--rollout-dump", dump], backend="gloo")
    logprob, advantage, gradient = result["messages"]
    assert re.fullmatch(r"sample 0: token 3: logprobs\[3\] = nan: a rollout log-prob must be finite and <= 0 "
                        r"\(1 of \d+ entries are not\)", logprob), logprob
    assert advantage == "sample 1: advantage inf is not finite"
    assert re.fullmatch(r"the loss is -?\d\.\d+(e-?\d+)? and the gradient norm over all ranks is inf: not finite, so "
                        r"the optimizer did not step and nothing was saved \(a weight or an activation overflowed\?\)",
                        gradient), gradient
    assert result["optimizer_state"] == 0 and result["weights_unchanged"]


# The checks themselves, without ranks.

def test_find_checkpoint_takes_a_run_directory_or_one_iteration_folder(tmp_path):
    from megatron_r3.rl.checkpoint.dirs import find_checkpoint

    run = tmp_path / "ckpt"
    for iteration in (2, 4):
        (run / f"iter_{iteration:07d}").mkdir(parents=True)
        (run / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    (run / "iter_0000006.saving").mkdir()
    with pytest.raises(FileNotFoundError, match=f"no checkpoint in {run}: it has no latest_checkpointed_iteration.txt "
                                                rf"\(complete iterations \[2, 4\] are there: name one, e\.g\. "
                                                f"{run / 'iter_0000004'}\\)"):
        find_checkpoint(str(run))
    (run / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert find_checkpoint(str(run)) == (str(run), 4)
    assert find_checkpoint(str(run / "iter_0000002") + "/") == (str(run), 2)
    for name in ("iter_0000006.saving", "iter_0000003", "iter_2"):
        with pytest.raises(ValueError, match=rf"{run / name} is not a complete checkpoint; its run's checkpoint "
                                             rf"directory is {run} \(complete iterations there: \[2, 4\]\)"):
            find_checkpoint(str(run / name))
    (run / "latest_checkpointed_iteration.txt").write_text("6\n")
    with pytest.raises(ValueError, match=r"names iteration 6, whose checkpoint is not complete"):
        find_checkpoint(str(run))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a checkpoint directory"):
        find_checkpoint(str(tmp_path / "file"))


def test_save_directory_probe_leaves_nothing_behind(tmp_path):
    from megatron_r3.rl.checkpoint.dirs import save_directory_problem

    assert save_directory_problem(str(tmp_path / "new" / "ckpt")) is None
    assert save_directory_problem(str(tmp_path)) is None
    assert os.listdir(tmp_path) == []  # the probe is gone, and the missing folders were not made
    (tmp_path / "file").write_text("x")
    assert save_directory_problem(str(tmp_path / "file" / "ckpt")) == f"{tmp_path / 'file'} is a file, not a folder"


@pytest.mark.parametrize("exists, resumed, append, overwrite, earlier_attempt, mode, refused", [
    (False, False, False, False, False, "new", False),
    (True, False, False, False, False, "new", True),  # another run's file
    (True, False, True, False, False, "append", False),
    (True, False, False, True, False, "overwrite", False),
    (True, True, False, False, False, "resume", False),  # the resumed run's own
    (True, False, False, False, True, "resume", False),  # a torchrun restart before the first checkpoint
])
def test_metrics_file_mode(exists, resumed, append, overwrite, earlier_attempt, mode, refused):
    from megatron_r3.rl.run_checks import metrics_file_mode

    got, problem = metrics_file_mode(exists, resumed, append, overwrite, earlier_attempt)
    assert (problem is not None) == refused
    if not refused:
        assert got == mode


def test_metrics_file_modes_keep_what_they_must(tmp_path):
    from megatron_r3.rl.metrics_file import MetricsFile

    path = tmp_path / "m.jsonl"
    lines = "".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 3))
    path.write_text(lines)
    with pytest.raises(FileExistsError):
        MetricsFile(str(path))
    for mode, keep_through, expected in (("append", None, [1, 2, 3, 9]), ("resume", 2, [1, 2, 9]),
                                         ("overwrite", None, [9])):
        path.write_text(lines)
        out = MetricsFile(str(path), mode, keep_through=keep_through)
        out.write({"iteration": 9})
        out.close()
        assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == expected
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]


def test_microbatch_problem_names_the_first_microbatch_that_does_not_fit():
    from megatron_r3.rl.run_checks import microbatch_problem

    lens = [10, 30, 12, 8, 40]  # read cyclically: positions 5, 6, ... are records 0, 1, ...
    fits = dict(consumed_samples=0, iterations=10, global_batch=4, micro_batch_size=2, alignment=4,
                first_iteration=1)
    assert microbatch_problem(lens, seq_length=52, **fits) is None  # the longest pair, 40 + 12, fits
    assert microbatch_problem(lens, seq_length=51, **fits) == (
        "--seq-length 51 is too short: iteration 2 packs records [4, 0] of the dump ([40, 10] tokens) into one "
        "microbatch, which needs 52 positions once each sample is padded to a multiple of 4; raise --seq-length or "
        "lower --micro-batch-size")
    assert microbatch_problem(lens, seq_length=51, **{**fits, "iterations": 1}) is None  # never reached
