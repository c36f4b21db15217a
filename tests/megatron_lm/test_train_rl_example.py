"""The train_rl.py example's CPU side: the checkout it runs, its offline assets, its launch script.

``make megatron-lm-checkout`` needs a Megatron-LM git repository (MEGATRON_GIT, default the
fetched mirror of tools/megatron_lm_series.py); the tests that read the checkout skip where none
is. What train_rl.py reads of the assets (the env config through ``WeightedMultiTask``, the
countdown set through ``CountdownAgent``, its rewards) runs in a subprocess with the checkout on
``sys.path``: its ``megatron`` package is Megatron-LM main's, not the installed core. Those
modules import on Python 3.11; ``megatron.rl.rl_utils`` and ``train_rl.py`` do not (Megatron-LM
main: ``typing.override``; docs/megatron_rl.md, "Dependencies").
"""

import json
import os
import socket
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.megatron_lm import ROOT, _series_tool

tool = _series_tool()
SCRIPT = ROOT / "launch" / "train_rl_r3.sh"
MEGATRON_GIT = Path(os.environ.get("MEGATRON_GIT", tool.DEFAULT_MEGATRON_GIT))
# What a checkout may weigh to travel to a GPU node with the repository (64 MiB a call there).
CHECKOUT_MIB = 40

sys.path.insert(0, str(ROOT / "launch"))
import megatron_rl_assets  # noqa: E402


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    if not (MEGATRON_GIT / "HEAD").is_file() and not (MEGATRON_GIT / ".git").exists():
        pytest.skip(f"no Megatron-LM git repository at {MEGATRON_GIT} (set MEGATRON_GIT)")
    out = tmp_path_factory.mktemp("checkout") / "megatron-lm"
    tool.make_checkout(MEGATRON_GIT, out)
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("assets") / "assets"
    assert megatron_rl_assets.main([str(out)]) == 0
    return out


def run_in_checkout(checkout, code, tmp_path):
    """``code`` in a fresh interpreter in the checkout (its megatron package first), offline."""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(checkout))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_checkout_has_both_series_is_small_and_compiles(checkout):
    size = sum(f.stat().st_size for f in checkout.rglob("*") if f.is_file())
    assert size < CHECKOUT_MIB * 2**20, f"{size / 2**20:.0f} MiB"
    assert not (checkout / ".git").exists()
    core_files, _ = tool.core_main_form()
    for last in (core_files[-1], tool.series_files()[-1]):  # applied: each series' last patch reverses
        proc = subprocess.run(["git", "apply", "--check", "--reverse", str(last)], cwd=checkout,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{last.name} is not applied: {proc.stderr}"
    sources = [checkout / "train_rl.py", *sorted((checkout / "megatron" / "rl").rglob("*.py"))]
    assert len(sources) > 20
    for path in sources:
        compile(path.read_text(), str(path), "exec")


def test_the_pristine_checkout_is_the_same_files_without_either_series(checkout, tmp_path):
    pristine = tmp_path / "pristine"
    tool.make_checkout(MEGATRON_GIT, pristine, pristine=True)
    core_files, _ = tool.core_main_form()
    for first in (core_files[0], tool.series_files()[0]):  # neither series: each one's first patch applies
        proc = subprocess.run(["git", "apply", "--check", str(first)], cwd=pristine, capture_output=True, text=True)
        assert proc.returncode == 0, f"{first.name} does not apply to the pristine tree: {proc.stderr}"
    files = {p.relative_to(pristine) for p in pristine.rglob("*") if p.is_file()}
    patched = {p.relative_to(checkout) for p in checkout.rglob("*") if p.is_file()}
    assert files < patched and Path("megatron/rl/routing_replay.py") in patched - files


def test_the_checkout_refuses_an_existing_folder(tmp_path):
    (tmp_path / "megatron-lm").mkdir()
    with pytest.raises(tool.SeriesError, match="exists: remove it first"):
        tool.make_checkout(MEGATRON_GIT, tmp_path / "megatron-lm")


def test_countdown_solutions_reach_their_targets_with_each_number_once():
    rows, solutions = megatron_rl_assets.countdown_rows(500, seed=3)
    assert set(rows) == {"target", "nums"}  # CountdownAgent.make_prefix(**row) takes exactly these
    for target, nums, solution in zip(rows["target"], rows["nums"], solutions):
        assert 3 <= len(nums) <= 4 and all(1 <= n <= 99 for n in nums)
        assert 0 < target < 1000 and eval(solution) == target  # noqa: S307 (our own expressions)
        assert sorted(int(t) for t in solution.replace("(", " ").replace(")", " ").split() if t.isdigit()) \
            == sorted(nums)


def test_the_tokenizer_loads_offline_and_renders_the_chat(assets, tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    code = f"""
        import json
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(assets / "tokenizer")!r})
        text = "Using the numbers [3, 5], create 8.\\n<answer> (3 + 5) </answer>"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        chat = tok.apply_chat_template([{{"role": "user", "content": "3 5 -> 8"}}], tokenize=False,
                                       add_generation_prompt=True)
        print(json.dumps({{"len": len(tok), "ids": len(ids), "text": len(text), "back": tok.decode(ids),
                          "chat": chat, "eos": tok.eos_token, "pad": tok.pad_token, "pad_id": tok.pad_token_id}}))
    """
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["len"] == 102 and out["ids"] == out["text"]  # one token per character
    assert out["back"] == "Using the numbers [3, 5], create 8.\n<answer> (3 + 5) </answer>"
    assert out["chat"] == "<|user|>3 5 -> 8<|end|><|assistant|>"
    assert (out["eos"], out["pad"]) == ("<|end|>", "<|pad|>")
    # train_rl.py refuses a tokenizer whose pad id is falsy (`if not tokenizer.pad`, rl_utils.py
    # prepare_trajectories): on 1 x H200 the example stopped so after its first rollouts with the pad at 0.
    assert out["pad_id"] > 0


def test_the_env_config_loads_as_train_rl_reads_it_and_known_answers_get_their_rewards(checkout, assets,
                                                                                        tmp_path):
    rows, solutions = megatron_rl_assets.countdown_rows(megatron_rl_assets.COUNTDOWN_ROWS)
    sample = [0, 1, 2, 327679, 327680, megatron_rl_assets.COUNTDOWN_ROWS - 1]
    cases = [{"golden": {"target": rows["target"][i], "nums": rows["nums"][i]}, "solution": solutions[i]}
             for i in sample]
    # rl_utils.get_agent: yaml.safe_load of --langrl-env-config, then WeightedMultiTask.from_config.
    out = run_in_checkout(checkout, f"""
        import asyncio, json, random, yaml
        from megatron.rl.agent.weighted_multi_task import WeightedMultiTask
        with open({str(assets / "countdown.yaml")!r}) as f:
            tasks = WeightedMultiTask.from_config(yaml.safe_load(f))
        agent = tasks.agents[0]
        random.seed(0)
        prompt, golden = asyncio.run(agent.get_prompt())
        rows = [agent.dataset[i] for i in {sample!r}]
        rewards = []
        for case in {cases!r}:
            g, s = case["golden"], case["solution"]
            rewards.append([asyncio.run(agent.get_reward(r, g, "stop")) for r in (
                f"<answer> {{s}} </answer>", f"<answer> {{s}} + 0 </answer>", f"<answer> ({{s}}) * 1 </answer>",
                f"<answer> {{g['target']}} </answer>", s)])
        print(json.dumps({{"agent": type(agent).__name__, "rows": len(agent.dataset), "prompt": prompt,
                          "golden": golden, "sample": rows, "train": len(agent.get_dataset()),
                          "validation": len(agent.get_dataset(validation=True)), "rewards": rewards}}))
    """, tmp_path)
    assert out["agent"] == "CountdownAgent" and out["rows"] == megatron_rl_assets.COUNTDOWN_ROWS
    assert (out["train"], out["validation"]) == (327680, 1024)
    assert out["sample"] == [case["golden"] for case in cases]
    assert f"Using the numbers {out['golden']['nums']}, create an equation that equals {out['golden']['target']}" \
        in out["prompt"]
    # Right: 1; a number not given or used twice, or the bare target: the format score 0.1;
    # no <answer> tags: 0.
    assert out["rewards"] == [[1.0, 0.1, 0.1, 0.1, 0]] * len(cases)


def launch(env, tmp_path):
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_the_launch_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_the_launch_script_refuses_what_cannot_run_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON"}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "set MEGATRON to a Megatron-LM main checkout" in proc.stderr

    proc = launch({"MEGATRON": str(tmp_path / "nowhere")}, tmp_path)
    assert proc.returncode == 2 and "is not a folder" in proc.stderr

    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "rl").mkdir(parents=True)
    proc = launch({"MEGATRON": str(tree)}, tmp_path)
    assert proc.returncode == 2 and "has no train_rl.py" in proc.stderr

    (tree / "train_rl.py").write_text("")  # a pristine checkout: no megatron/rl/routing_replay.py
    proc = launch({"MEGATRON": str(tree)}, tmp_path)
    assert proc.returncode == 2 and "lacks the Megatron-LM series: make patch MEGATRON=" in proc.stderr

    (tree / "megatron" / "rl" / "routing_replay.py").write_text("")
    old_python = tmp_path / "python3.11"  # answers the version check as Python 3.11 does
    old_python.write_text("#!/bin/sh\nexit 1\n")
    old_python.chmod(0o755)
    proc = launch({"MEGATRON": str(tree), "PYTHON": str(old_python)}, tmp_path)
    assert proc.returncode == 2 and "is not Python >= 3.12 (Megatron-LM main imports typing.override)" in proc.stderr

    new_python = tmp_path / "python3.12"  # passes the version check
    new_python.write_text("#!/bin/sh\nexit 0\n")
    new_python.chmod(0o755)
    with socket.create_server(("127.0.0.1", 8294)):  # a run already serving rollouts on this node
        proc = launch({"MEGATRON": str(tree), "PYTHON": str(new_python)}, tmp_path)
        assert proc.returncode == 2 and "port 8294 is in use: another train_rl.py" in proc.stderr
        with socket.create_server(("127.0.0.1", 0)) as other:  # a second run on a port of its own
            port = str(other.getsockname()[1])
            own_port = {"MEGATRON": str(tree), "PYTHON": str(new_python), "MEGATRON_RL_INFERENCE_SERVER_PORT": port}
            proc = launch(own_port, tmp_path)
            assert proc.returncode == 2 and "lacks the Megatron-LM series' 0004" in proc.stderr  # it would serve on 8294
            (tree / "megatron" / "rl" / "rl_utils.py").write_text("MEGATRON_RL_INFERENCE_SERVER_PORT\n")
            proc = launch(own_port, tmp_path)  # that port is taken too
            assert proc.returncode == 2 and f"port {port} is in use: another train_rl.py" in proc.stderr
        proc = launch(dict(own_port, INIT=str(tmp_path)), tmp_path)  # past the port: on to the next check
        assert proc.returncode == 2 and f"INIT={tmp_path} holds no Megatron checkpoint" in proc.stderr
        proc = launch(dict(own_port, MEGATRON_RL_INFERENCE_SERVER_PORT="eighty"), tmp_path)
        assert proc.returncode == 2 and "MEGATRON_RL_INFERENCE_SERVER_PORT=eighty is not a port number" in proc.stderr
    proc = launch({"MEGATRON": str(tree), "PYTHON": str(new_python), "INIT": str(tmp_path)}, tmp_path)
    assert proc.returncode == 2 and f"INIT={tmp_path} holds no Megatron checkpoint" in proc.stderr
    for extra in ("--attention-backend flash", "--seed 3 --attention-backend=flash --bf16"):
        proc = launch({"MEGATRON": str(tree), "PYTHON": str(new_python), "EXTRA_ARGS": extra}, tmp_path)
        assert proc.returncode == 2 and "EXTRA_ARGS --attention-backend flash: TE 2.20.2" in proc.stderr
    proc = launch({"MEGATRON": str(tree), "PYTHON": str(new_python), "GRAPHS": "yes"}, tmp_path)
    assert proc.returncode == 2 and "GRAPHS=yes: give 1 (the engine decodes under CUDA graphs) or 0" in proc.stderr
    for short in ("256", "abc"):  # a countdown prompt alone takes up to ~300 tokens
        proc = launch({"MEGATRON": str(tree), "PYTHON": str(new_python), "SEQ_LEN": short}, tmp_path)
        assert proc.returncode == 2 and f"SEQ_LEN={short}: give 384..1024" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing made before the refusals


def series_tree_with_assets(tmp_path):
    """A Megatron-LM tree the script takes for one with the series, and an OUT (tmp_path/out) whose assets
    are made: the script goes on to launch PYTHON."""
    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "rl").mkdir(parents=True)
    (tree / "train_rl.py").write_text("")
    (tree / "megatron" / "rl" / "routing_replay.py").write_text("")
    (tmp_path / "out" / "assets").mkdir(parents=True)
    (tmp_path / "out" / "assets" / "countdown.yaml").write_text("")
    return tree


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_graphs_give_the_engine_megatron_lm_s_own_cuda_graph_flags(tmp_path, graphs):
    """GRAPHS=1: the flags Megatron-LM's MoE RL config (nemotron6_3b_moe.sh, common.sh) runs its engine's
    graphs with; no training graphs (routing replay refuses those)."""
    tree = series_tree_with_assets(tmp_path)
    python = tmp_path / "python3.12"  # passes the version check; as torchrun: prints its arguments
    python.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "ARGS $*"\n')
    python.chmod(0o755)
    proc = launch({"MEGATRON": str(tree), "PYTHON": str(python), "GRAPHS": graphs}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    args = next(line for line in proc.stdout.splitlines() if line.startswith("ARGS ")).split()
    flags = ["--cuda-graph-impl", "--decode-only-cuda-graphs", "--rl-persist-cuda-graphs",
             "--moe-pad-experts-for-cuda-graph-inference"]
    assert [flag in args for flag in flags] == [graphs == "1"] * len(flags)
    assert "--rl-training-cuda-graphs" not in args and "--moe-enable-routing-replay" in args
    if graphs == "1":
        assert args[args.index("--cuda-graph-impl") + 1] == "local"


def test_the_launch_script_returns_when_the_run_ends_though_a_child_outlives_it(tmp_path):
    """The run's output reaches the caller and its exit status is the run's, even where a process the
    run started still holds its output open (the script waited on such a pipe through `| tee`)."""
    tree = series_tree_with_assets(tmp_path)
    pidfile = tmp_path / "child.pid"
    python = tmp_path / "python3.12"  # passes the version check; as torchrun: leaves a child behind, exits 3
    python.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 0\nsleep 300 & echo $! > {pidfile}\n'
                      'echo "training done"\nexit 3\n')
    python.chmod(0o755)
    try:
        proc = launch({"MEGATRON": str(tree), "PYTHON": str(python), "ITERS": "1"}, tmp_path)
        assert proc.returncode == 3 and "training done" in proc.stdout
        assert "training done" in (tmp_path / "out" / "train_rl-replay1-np1.log").read_text()
    finally:
        if pidfile.exists():
            subprocess.run(["kill", pidfile.read_text().strip()])


def test_the_bench_reads_the_series_metrics_line_and_megatrons_step_times(rr):
    from bench.megatron_rl import replay_metrics, step_times

    metrics = {"k3_replay": 2.5e-4, "k3_live": 3.1e-3, "agreement": 0.91, "routes_used_differ": 0.0,
               "agreement_moved_one_token": 0.12, "routed_fraction": 1.0, "rows_without_routes": 0.0}
    # Megatron's training_log line (megatron/training/training.py), as train_rl.py prints it.
    step = (" [2026-11-28 10:00:00.000000] iteration {:8d}/{:8d} | consumed samples: {:12d} | "
            "elapsed time per iteration (ms): {:.1f} | learning rate: 1.000000E-06 |")
    log = "\n".join([step.format(1, 50, 32, 9000.0), "[rank0]: " + rr.format_metrics(1, metrics),
                     step.format(2, 50, 64, 1200.5), rr.format_metrics(2, {**metrics, "k3_live": 1e-3}),
                     step.format(3, 50, 96, 1100.0)])
    rows = replay_metrics(log)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0] == {"iteration": 1, **metrics} and rows[1]["k3_live"] == 1e-3
    assert step_times(log, skip=1) == [1200.5, 1100.0]


def test_the_wheelhouse_takes_train_rl_s_pins_on_request_one_version_each():
    sys.path.insert(0, str(ROOT / "tools"))
    import wheelhouse

    rl = wheelhouse.pins(ROOT / "requirements-megatron-rl.txt")
    without, with_rl = wheelhouse.wheel_pins("13", False), wheelhouse.wheel_pins("13", True)
    names = [pin.split("==")[0].lower().replace("_", "-") for pin in with_rl]
    assert len(names) == len(set(names))  # pydantic & co., pinned for TE too, come once
    assert set(without) < set(with_rl) and {"datasets==5.0.1", "transformers==5.14.1"} <= set(with_rl)
    shared = {p.split("==")[0].lower().replace("_", "-") for p in rl} & {n for n in names[:len(without)]}
    assert shared  # the overlap exists, and every shared package has one version across the files
    assert len(with_rl) == len(without) + len(rl) - len(shared)


def test_the_wheelhouse_refuses_two_versions_of_one_package(monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import wheelhouse

    real = wheelhouse.pins
    monkeypatch.setattr(wheelhouse, "pins", lambda path: real(path) + (
        ["Pydantic==1.0"] if path.name == "requirements-megatron-rl.txt" else []))
    with pytest.raises(SystemExit, match="pydantic==.* and Pydantic==1.0 are pinned in two requirements files"):
        wheelhouse.wheel_pins("13", True)


def test_the_wheelhouse_parts_hold_every_file_within_the_limit_and_join_on_the_node(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import wheelhouse

    files = {"a.whl": 50, "b.whl": 30, "c.whl": 25, "d.tar.gz": 20, "e.whl": 5, "big.whl": 130}
    for index, (name, size) in enumerate(files.items()):
        (tmp_path / name).write_bytes(bytes((index + i) % 251 for i in range(size)))
    (tmp_path / "part-9").mkdir()  # a layout of an earlier run is replaced
    parts = wheelhouse.split_parts(tmp_path, 60)
    assert not (tmp_path / "part-9").exists()
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 60
    node = tmp_path / "node"
    node.mkdir()
    for part in parts:
        for piece in part.iterdir():
            shutil.copy(piece, node / piece.name)
    subprocess.run(["bash", "-c", wheelhouse.JOIN_CHUNKS], cwd=node, check=True)
    assert {f.name: f.read_bytes() for f in node.iterdir()} == {n: (tmp_path / n).read_bytes() for n in files}


def test_the_bench_reports_k3_from_the_log_of_a_run_cut_short_and_writes_the_plot_s_records(rr, tmp_path):
    from bench.megatron_rl import main as bench_main
    from tools.plot_metrics import Run, plan_panels

    base = {"agreement": 0.99, "agreement_moved_one_token": 0.02, "routed_fraction": 1.0, "rows_without_routes": 0.0,
            "routes_used_differ": 0.0, "abs_log_ratio_replay": 1e-3, "abs_log_ratio_live": 2e-3,
            "outside_2x_replay": 0.0, "outside_5x_replay": 0.0, "outside_5x_live": 0.0}
    live = [1e-5, 2e-5, 9e-3]  # one tail collection: the mean is its, the median ratio is not
    replay = [8e-6, 1e-5, 1e-5]
    lines = [rr.format_metrics(i, {**base, "k3_live": l, "k3_replay": r, "outside_2x_live": 7e-4 if l > 1e-3 else 0.0})
             for i, (l, r) in enumerate(zip(live, replay))]
    log = tmp_path / "train_rl-replay1-np1.log"
    log.write_text("\n".join(["INFO:megatron.rl.rl_utils:" + line for line in lines] + ["Collecting rollouts, Iteration 3..."]))
    out = tmp_path / "k3.md"
    assert bench_main(["--from-log", str(log), "--out", str(out)]) is None
    report = out.read_text()
    assert f"| mean k3 over 3 collections (same rollouts) | {sum(replay) / 3:.3e} | {sum(live) / 3:.3e} |" in report
    assert "median 0.500, lower in 3 of 3" in report and "in 0 and 1 collections" in report
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert records[2]["mismatch/live/k3_kl"] == 9e-3 and records[2]["mismatch/live/frac_abs_gt_ln2"] == 7e-4
    assert records[0]["routing/agreement"] == 0.99 and "agreement_moved_one_token" not in records[0]
    titles = [panel.title for panel in plan_panels([Run("r", str(out), records)])]
    assert titles[0] == "k3 KL estimate" and len(titles) == 4
    with pytest.raises(SystemExit):
        bench_main(["--from-log", str(log), "--rounds", "1", "--out", str(out)])


def test_the_bench_reports_step_and_phase_times_from_a_replay_and_a_live_log(tmp_path):
    from bench.megatron_rl import main as bench_main

    step = (" [2026-11-29 10:00:00.000000] iteration {:8d}/{:8d} | consumed samples: {:12d} | "
            "elapsed time per iteration (ms): {:.1f} | learning rate: 1.000000E-06 |")

    def timers(forward_backward, rollouts):
        # megatron/core/timers.py's report at --timing-log-level 1, one rank.
        return ["INFO:megatron.core.timers:(min, max) time across ranks (ms):",
                f"    {'forward-backward '.ljust(48, '.')}: ({forward_backward:.2f}, {forward_backward:.2f})",
                f"    {'rl/rollout-collection '.ljust(48, '.')}: ({rollouts:.2f}, {rollouts:.2f})"]

    def log(steps, forward_backward):
        lines = []
        for it, ms in enumerate(steps, start=1):
            lines += [step.format(it, len(steps), 32 * it, ms), *timers(forward_backward[it - 1], 5000.0)]
        # the final save's report follows the last iteration: timed once, not a phase of every iteration
        return "\n".join(lines + ["INFO:megatron.core.timers:(min, max) time across ranks (ms):",
                                  f"    {'save-checkpoint '.ljust(48, '.')}: (20116.30, 20116.30)"])

    replay_log, live_log = tmp_path / "replay.log", tmp_path / "live.log"
    replay_log.write_text(log([60000.0, 13000.0, 12000.0], [9000.0, 4200.0, 3800.0]))
    live_log.write_text(log([58000.0, 12500.0, 11500.0, 12000.0], [9000.0, 4000.0, 3600.0, 3800.0]))
    out = tmp_path / "step.md"
    assert bench_main(["--from-step-logs", str(replay_log), str(live_log), "--skip", "1", "--out", str(out)]) is None
    report = out.read_text()
    # the ratio's 95% interval: 1.042 x (1 -/+ 1.96 sqrt(500000 / 2 / 12500^2 + 250000 / 3 / 12000^2))
    assert ("| mean step time, ms (2 and 3 iterations; ratio's 95% interval) | 12500.0 | 12000.0 | "
            "1.042 (0.946-1.137) | <= 1.03 |") in report
    assert "| of which `forward-backward`, ms | 4000.0 | 3800.0 | 1.053 | |" in report
    assert "| of which `rl/rollout-collection`, ms | 5000.0 | 5000.0 | 1.000 | |" in report
    # each iteration's step less its own collection: 8000 and 7000 against 7500, 6500 and 7000
    assert "| step time less `rl/rollout-collection`, ms | 7500.0 | 7000.0 | 1.071 (0.907-1.236) | |" in report
    assert "save-checkpoint" not in report
    assert report.index("rl/rollout-collection") < report.index("forward-backward")  # slowest first
    with pytest.raises(SystemExit, match=f"--out {out} exists: pass --overwrite to replace it"):
        bench_main(["--from-step-logs", str(replay_log), str(live_log), "--skip", "1", "--out", str(out)])
    assert out.read_text() == report  # refused before anything was written
    with pytest.raises(SystemExit, match=f"--out {replay_log} is the input {replay_log}"):
        bench_main(["--from-step-logs", str(replay_log), str(live_log), "--out", str(replay_log), "--overwrite"])
    with pytest.raises(SystemExit, match="no iteration after --skip 5 in the replay runs' logs"):
        bench_main(["--from-step-logs", str(replay_log), str(live_log), "--skip", "5", "--out", str(out),
                    "--overwrite"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.log", "replay.log", "step.md"]  # no partial left
    with pytest.raises(SystemExit):
        bench_main(["--from-step-logs", str(replay_log), str(live_log), "--rounds", "1", "--out", str(out)])


def test_the_bench_refuses_a_pair_of_step_logs_given_live_first(tmp_path):
    from bench.megatron_rl import main as bench_main

    def log(replay):
        # train_rl.py's argument dump, then one iteration
        return "\n".join([f"  moe_enable_routing_replay {'.' * 23} {replay}",
                          " [2026-11-29 10:00:00.000000] iteration        1/       2 | elapsed time per iteration (ms): 900.0 |",
                          " [2026-11-29 10:00:01.000000] iteration        2/       2 | elapsed time per iteration (ms): 1000.0 |"])

    replay_log, live_log = tmp_path / "train_rl-replay1-np1.log", tmp_path / "train_rl-replay0-np1.log"
    replay_log.write_text(log(True))
    live_log.write_text(log(False))
    out = tmp_path / "step.md"
    # `ls` sorts a round's live log before its replay log: the swapped pair is refused, naming the file
    with pytest.raises(SystemExit, match=f"--from-step-logs {live_log} is a live run's log .* in a replay place"):
        bench_main(["--from-step-logs", str(live_log), str(replay_log), "--skip", "1", "--out", str(out)])
    assert not out.exists()
    with pytest.raises(SystemExit, match=f"{live_log} is a live run's log"):  # the second round swapped
        bench_main(["--from-step-logs", str(replay_log), str(live_log), str(live_log), str(replay_log), "--skip", "1",
                    "--out", str(out)])
    bench_main(["--from-step-logs", str(replay_log), str(live_log), "--skip", "1", "--out", str(out)])
    assert "| median step time, ms | 1000.0 | 1000.0 | 1.000 | |" in out.read_text()


def engine_line(rank, step, ms, decode, active):
    """dynamic_engine.py's console line at --inference-logging-step-interval (decode-only steps in color)."""
    kind = "decode" if decode else "non-decode (prev: decode)"
    line = (f"* rank {rank} | step {step} | 10:00:00 ... time: {ms:.3f} ms [{kind} + real config [{active}]: "
            f"0 P + {active} D + cuda graph OFF] ... reqs: a {active}/32, p 0, w 0, f 3, e 0 ... blocks: "
            "occupied 40/900, allocatable 860, active-used 40, paused-used 0/0 ... mem: tensors 900, alloc 4.6 gb, res 4.8 gb.")
    return f"\033[94m{line}\033[0m" if decode else line


def test_the_bench_reports_the_engine_steps_per_collection_and_a_decode_step_at_equal_active_requests(tmp_path):
    from bench.megatron_rl import engine_steps, main as bench_main

    step = " [2026-11-29 10:00:00.000000] iteration {:8d}/{:8d} | elapsed time per iteration (ms): {:.1f} |"

    def log(collections, rank=0):
        # collections: per iteration, its engine steps as (ms, decode-only, active requests); each before its line
        lines, count = [], 0
        for it, collection in enumerate(collections, start=1):
            for ms, decode, active in collection:
                count += 1
                lines += [engine_line(rank, count, ms, decode, active), engine_line(rank + 1, count, 99.0, True, 1)]
            lines.append(step.format(it, len(collections), 1000.0 * len(collection)))
        return "\n".join(lines)

    # replay: decode steps cost 10% more at each active count; its collections are longer (two at 1 request)
    replay = [[(50.0, False, 32)] * 9, [(50.0, False, 32), (22.0, True, 32), (11.0, True, 1), (11.0, True, 1)],
              [(22.0, True, 32), (11.0, True, 1), (11.0, True, 1)]]
    live = [[(50.0, False, 32)], [(50.0, False, 32), (20.0, True, 32)], [(20.0, True, 32), (10.0, True, 1)],
            [(20.0, True, 32), (30.0, True, 5)]]
    # the first collection (skipped) and rank 1's steps count for nothing; a collection cut short neither
    replay_text = log(replay) + "\n" + engine_line(0, 99, 5000.0, True, 32)
    assert engine_steps(replay_text, 1) == [(2, 50.0, False, 32), (2, 22.0, True, 32), (2, 11.0, True, 1),
                                            (2, 11.0, True, 1), (3, 22.0, True, 32), (3, 11.0, True, 1),
                                            (3, 11.0, True, 1)]
    (tmp_path / "replay.log").write_text(replay_text)
    (tmp_path / "live.log").write_text(log(live))
    out = tmp_path / "step.md"
    bench_main(["--from-step-logs", str(tmp_path / "replay.log"), str(tmp_path / "live.log"), "--skip", "1",
                "--out", str(out)])
    report = out.read_text()
    assert "| engine steps per rollout collection (the rank that ran the most) | 3.5 | 2.0 | 1.750 | |" in report
    # live's mix over the active counts both sides ran at (5 is live's only): 3 steps at 32, 1 at 1
    assert ("| engine decode step, ms (6 and 4 steps at 1-32 active requests, live's mix) | "
            f"{(3 * 22.0 + 11.0) / 4:.2f} | {(3 * 20.0 + 10.0) / 4:.2f} | 1.100 | |") in report
    # runs that logged no engine step: no engine rows
    (tmp_path / "plain.log").write_text("\n".join(step.format(it, 3, 1000.0) for it in (1, 2, 3)))
    bench_main(["--from-step-logs", str(tmp_path / "plain.log"), str(tmp_path / "live.log"), "--skip", "1",
                "--out", str(out), "--overwrite"])
    assert "engine" not in out.read_text()
    assert "| median step time, ms | 1000.0 | 2000.0 | 0.500 | |" in out.read_text()


def test_the_bench_passes_extra_args_to_the_example_and_names_them(tmp_path, monkeypatch):
    from bench.megatron_rl import FROZEN_POLICY_ARGS, run

    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "rl").mkdir(parents=True)
    (tree / "train_rl.py").write_text("")
    (tree / "megatron" / "rl" / "routing_replay.py").write_text("")
    python = tmp_path / "python3.12"  # passes the version check; as torchrun: prints its arguments
    python.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "$@"\n')
    python.chmod(0o755)
    (tmp_path / "runs" / "time-live-0" / "assets").mkdir(parents=True)
    (tmp_path / "runs" / "time-live-0" / "assets" / "countdown.yaml").write_text("")
    monkeypatch.setenv("MEGATRON", str(tree))
    monkeypatch.setenv("PYTHON", str(python))
    monkeypatch.setenv("EXTRA_ARGS", "--timing-log-level 1")
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # keep the assets made above
    command, log, _ = run(tmp_path / "runs", 1, 3, 384, replay=False, metrics=False, tag="time-live-0")
    assert command.startswith('NPROC=1 ITERS=3 SEQ_LEN=384 REPLAY=0 METRICS=0 EXTRA_ARGS="--timing-log-level 1" ')
    assert "train_rl.py" in log and log.rstrip().endswith("--timing-log-level 1")
    assert "--moe-enable-routing-replay" not in log
    # --frozen-policy's learning rate 0 comes after the caller's EXTRA_ARGS and after the example's own --lr,
    # which argparse lets the last one win
    command, log, _ = run(tmp_path / "runs", 1, 3, 384, replay=True, metrics=False, tag="time-live-0",
                          extra_args=FROZEN_POLICY_ARGS)
    assert 'EXTRA_ARGS="--timing-log-level 1 --lr 0.0 --min-lr 0.0" ' in command
    words = log.split()
    assert words[len(words) - 1 - words[::-1].index("--lr") + 1] == "0.0" and "--moe-enable-routing-replay" in words
    assert log.rstrip().endswith("--timing-log-level 1 --lr 0.0 --min-lr 0.0")
    # --graphs: GRAPHS=1 of the example, named in the command; the engine gets Megatron-LM's graph flags
    assert "--cuda-graph-impl" not in log.split() and "GRAPHS" not in command
    command, log, _ = run(tmp_path / "runs", 1, 3, 384, replay=True, metrics=False, tag="time-live-0", graphs=True)
    assert command.startswith("NPROC=1 ITERS=3 SEQ_LEN=384 REPLAY=1 METRICS=0 GRAPHS=1 ")
    words = log.split()
    assert words[words.index("--cuda-graph-impl") + 1] == "local" and "--decode-only-cuda-graphs" in words


def test_the_bench_counts_the_iterations_whose_rollouts_ran_the_same_engine_steps_on_both_sides(tmp_path):
    from bench.megatron_rl import main as bench_main

    step = " [2026-11-30 10:00:00.000000] iteration {:8d}/{:8d} | elapsed time per iteration (ms): {:.1f} |"

    def log(collections):
        lines, count = [], 0
        for it, collection in enumerate(collections, start=1):
            for decode, active in collection:
                count += 1
                lines.append(engine_line(0, count, 10.0 if decode else 50.0, decode, active))
            lines.append(step.format(it, len(collections), 1000.0))
        return "\n".join(lines)

    prefill, decode = (False, 32), (True, 32)
    same = [[prefill, decode], [prefill, decode, (True, 2)], [prefill, decode, decode]]
    (tmp_path / "replay.log").write_text(log(same))
    (tmp_path / "live.log").write_text(log(same))
    out = tmp_path / "step.md"
    bench_main(["--from-step-logs", str(tmp_path / "replay.log"), str(tmp_path / "live.log"), "--skip", "1",
                "--out", str(out)])
    assert "the same engine steps (active requests at each) in 2 of 2: the two sides generated the same lengths." \
        in out.read_text()
    # one request more still active at one step of iteration 3: not the same rollouts
    (tmp_path / "live.log").write_text(log(same[:2] + [[prefill, decode, (True, 33)]]))
    bench_main(["--from-step-logs", str(tmp_path / "replay.log"), str(tmp_path / "live.log"), "--skip", "1",
                "--out", str(out), "--overwrite"])
    assert "in 1 of 2; where they differ, sampling set part of the step-time difference." in out.read_text()
    with pytest.raises(SystemExit):
        bench_main(["--from-step-logs", str(tmp_path / "replay.log"), str(tmp_path / "live.log"), "--frozen-policy",
                    "--out", str(out), "--overwrite"])
    with pytest.raises(SystemExit):  # refused before it looks for MEGATRON or a GPU
        bench_main(["--frozen-policy", "--rounds", "0", "--out", str(out), "--overwrite"])


def timed_log(start_hour, steps, rollouts):
    """A train_rl.py log whose iterations start at ``start_hour``: each iteration's line, then its timers."""
    lines = []
    for it, (ms, rollout_ms) in enumerate(zip(steps, rollouts), start=1):
        lines += [f" [2026-11-30 {start_hour:02d}:00:{it:02d}.000000] iteration {it:8d}/{len(steps):8d} | "
                  f"elapsed time per iteration (ms): {ms:.1f} |",
                  "INFO:megatron.core.timers:(min, max) time across ranks (ms):",
                  f"    {'rl/rollout-collection '.ljust(48, '.')}: ({rollout_ms:.2f}, {rollout_ms:.2f})"]
    return "\n".join(lines)


def test_the_bench_alternates_which_side_runs_first_and_reports_each_round(tmp_path, monkeypatch):
    import torch

    import bench.megatron_rl as bench

    # per run, in the order the bench runs them: (replay?, its step times, its rollout collections)
    runs = iter([(True, [9000.0, 5000.0, 6000.0], [4000.0, 2000.0, 2000.0]),   # round 1: replay first
                 (False, [9000.0, 6000.0, 8000.0], [4000.0, 2000.0, 4000.0]),
                 (False, [9000.0, 5000.0, 5000.0], [4000.0, 1000.0, 1000.0]),  # round 2: live first
                 (True, [9000.0, 6000.0, 6000.0], [4000.0, 2000.0, 2000.0])])
    order = []

    def fake_run(out, nproc, iters, seq_len, replay, metrics, tag, init=None, extra_args="", graphs=False):
        expected_replay, steps, rollouts = next(runs)
        assert replay == expected_replay and not metrics
        order.append(tag)
        return f"REPLAY={int(replay)} {tag}", timed_log(10 + len(order), steps, rollouts), 1.0

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setenv("MEGATRON", str(tmp_path))
    out = tmp_path / "time.md"
    bench.main(["--no-k3", "--rounds", "2", "--skip", "1", "--runs", str(tmp_path / "runs"), "--out", str(out)])
    assert order == ["time-replay-0", "time-live-0", "time-live-1", "time-replay-1"]
    report = out.read_text()
    # pooled over both rounds: replay (5000+6000+6000+6000)/4 = 5750 against live (6000+8000+5000+5000)/4 = 6000
    assert "| mean step time, ms (4 and 4 iterations; ratio's 95% interval) | 5750.0 | 6000.0 | 0.958 (" in report
    # each round on its own, less its rollout collection: 3500 against 4000, then 4000 against 4000
    assert "| round 1, replay ran first: step time less `rl/rollout-collection`, ms | 3500.0 | 4000.0 | 0.875 | |" \
        in report
    assert "| round 2, live ran first: step time less `rl/rollout-collection`, ms | 4000.0 | 4000.0 | 1.000 | |" \
        in report
    # the same report from the four logs, a replay log and a live log per round
    logs = []
    for tag, hour, steps, rollouts in (("r0", 11, [9000.0, 5000.0, 6000.0], [4000.0, 2000.0, 2000.0]),
                                       ("l0", 12, [9000.0, 6000.0, 8000.0], [4000.0, 2000.0, 4000.0]),
                                       ("r1", 14, [9000.0, 6000.0, 6000.0], [4000.0, 2000.0, 2000.0]),
                                       ("l1", 13, [9000.0, 5000.0, 5000.0], [4000.0, 1000.0, 1000.0])):
        logs.append(tmp_path / f"{tag}.log")
        logs[-1].write_text(timed_log(hour, steps, rollouts))
    from_logs = tmp_path / "from-logs.md"
    bench.main(["--from-step-logs", *map(str, logs), "--skip", "1", "--out", str(from_logs)])
    for row in ("| mean step time, ms (4 and 4 iterations;", "| round 1, replay ran first:", "| round 2, live ran first:"):
        assert row in from_logs.read_text()
    with pytest.raises(SystemExit):  # a replay log without its live log
        bench.main(["--from-step-logs", *map(str, logs[:3]), "--out", str(tmp_path / "odd.md")])
    assert not (tmp_path / "odd.md").exists()
    # --live-first: a round to pool with another call's replay-first one
    runs = iter([(False, [9000.0, 5000.0], [4000.0, 1000.0]), (True, [9000.0, 6000.0], [4000.0, 2000.0])])
    order.clear()
    bench.main(["--no-k3", "--rounds", "1", "--live-first", "--skip", "1", "--runs", str(tmp_path / "runs"),
                "--out", str(tmp_path / "live-first.md")])
    assert order == ["time-live-0", "time-replay-0"]
    assert "--rounds 1 --live-first" in (tmp_path / "live-first.md").read_text()
    with pytest.raises(SystemExit):  # it says how runs go: nothing runs from logs
        bench.main(["--from-step-logs", *map(str, logs[:2]), "--live-first", "--out", str(tmp_path / "x.md")])


def test_the_bench_writes_the_report_of_each_round_as_it_ends(tmp_path, monkeypatch):
    """A call stopped during round 2 (its device time spent, say) leaves round 1's report."""
    import torch

    import bench.megatron_rl as bench

    runs = iter([[9000.0, 5000.0, 6000.0], [9000.0, 6000.0, 8000.0]])

    def fake_run(out, nproc, iters, seq_len, replay, metrics, tag, init=None, extra_args="", graphs=False):
        steps = next(runs, None)
        if steps is None:
            raise KeyboardInterrupt
        return f"REPLAY={int(replay)} {tag}", timed_log(11, steps, [4000.0, 2000.0, 2000.0]), 1.0

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setenv("MEGATRON", str(tmp_path))
    out = tmp_path / "time.md"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--no-k3", "--rounds", "2", "--skip", "1", "--runs", str(tmp_path / "runs"), "--out", str(out)])
    report = out.read_text()
    assert "| step time less `rl/rollout-collection`, ms | 3500.0 | 5000.0 | 0.700 (" in report
    assert "REPLAY=0 time-live-0" in report and "time-live-1" not in report


def test_the_bench_pairs_the_metrics_run_s_replayed_and_live_forward_passes_by_iteration(rr, tmp_path):
    from bench.megatron_rl import main as bench_main

    step = " [2026-11-29 10:00:00.000000] iteration {:8d}/{:8d} | elapsed time per iteration (ms): {:.1f} |"
    base = {"agreement": 0.99, "agreement_moved_one_token": 0.02, "routed_fraction": 1.0, "rows_without_routes": 0.0,
            "routes_used_differ": 0.0, "abs_log_ratio_replay": 1e-3, "abs_log_ratio_live": 2e-3, "k3_replay": 1e-5,
            "k3_live": 2e-5, "outside_2x_replay": 0.0, "outside_2x_live": 0.0, "outside_5x_replay": 0.0,
            "outside_5x_live": 0.0}
    # (replay pass ms, live pass ms) per iteration; iteration 3 logged no live pass: it pairs with nothing
    passes = {1: (900.0, 500.0), 2: (210.0, 200.0), 3: (230.0, None), 4: (190.0, 200.0), 5: (330.0, 300.0)}
    lines = []
    for it, (replay_ms, live_ms) in passes.items():
        # rl_utils.py's timers: rl/compute-logprobs holds the old (replayed), the live and the reference passes
        outer = replay_ms + (live_ms or 0.0) + 400.0
        lines += ["INFO:megatron.rl.rl_utils:" + rr.format_metrics(it, base), step.format(it, 5, 12000.0),
                  "INFO:megatron.core.timers:(min, max) time across ranks (ms):",
                  f"    {'rl/compute-logprobs '.ljust(48, '.')}: ({outer - 5:.2f}, {outer:.2f})",
                  f"    {'rl/compute-old-logprobs '.ljust(48, '.')}: ({replay_ms - 5:.2f}, {replay_ms:.2f})",
                  f"    {'rl/compute-ref-logprobs '.ljust(48, '.')}: (395.00, 400.00)"]
        if live_ms is not None:
            lines.append(f"    {'rl/compute-live-logprobs '.ljust(48, '.')}: ({live_ms - 5:.2f}, {live_ms:.2f})")
    log = tmp_path / "metrics.log"
    log.write_text("\n".join(lines))
    out = tmp_path / "k3.md"
    bench_main(["--from-log", str(log), "--skip", "1", "--out", str(out)])
    report = out.read_text()
    # iterations 2, 4 and 5 (1 skipped, 3 unpaired), each rank's slowest: ratios 1.05, 0.95, 1.10
    assert ("| forward-only pass over the same bins, ms (`rl/compute-old-logprobs` with replay and "
            "`rl/compute-live-logprobs` routing live, 3 iterations) | 243.3 | 233.3 | 1.043 | |") in report
    assert "median 1.050, 0.950-1.100, replay slower in 2 of 3." in report
    # a metrics run without the timers: no such row
    log.write_text("\n".join(line for line in lines if "rl/compute" not in line))
    bench_main(["--from-log", str(log), "--skip", "1", "--out", str(out), "--overwrite"])
    assert "forward-only pass" not in out.read_text()


def test_concurrent_rounds_run_both_sides_at_once_on_their_own_gpus_or_shared_ones_and_port(tmp_path, monkeypatch):
    import torch

    import bench.megatron_rl as bench

    rounds = []

    def fake_run_together(starts):
        rounds.append([(args[4], kwargs["tag"], kwargs["env_extra"]) for args, kwargs in starts])
        hour = 10 + len(rounds)
        return [(f"REPLAY={int(args[4])}", timed_log(hour, [9000.0, 5000.0 + 1000 * args[4]], [4000.0, 1000.0]), 1.0)
                for args, _ in starts]  # both sides' iterations in the same hour: they overlap

    monkeypatch.setattr(bench, "run_together", fake_run_together)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("a side ran alone"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setenv("MEGATRON", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    out = tmp_path / "together.md"
    bench.main(["--no-k3", "--rounds", "2", "--concurrent", "--skip", "1", "--runs", str(tmp_path / "runs"),
                "--out", str(out)])
    (replay0, live0), (live1, replay1) = rounds
    assert [replay0[:2], live0[:2], live1[:2], replay1[:2]] == [(True, "time-replay-0"), (False, "time-live-0"),
                                                                (False, "time-live-1"), (True, "time-replay-1")]
    # each side has each GPU in turn; the two runs of a round serve on two ports
    assert [replay0[2]["CUDA_VISIBLE_DEVICES"], replay1[2]["CUDA_VISIBLE_DEVICES"]] == ["3", "5"]
    assert [live0[2]["CUDA_VISIBLE_DEVICES"], live1[2]["CUDA_VISIBLE_DEVICES"]] == ["5", "3"]
    for first, second in rounds:
        assert first[2]["MEGATRON_RL_INFERENCE_SERVER_PORT"] != second[2]["MEGATRON_RL_INFERENCE_SERVER_PORT"]
    report = out.read_text()
    assert "--rounds 2 --concurrent" in report
    assert "| round 1, ran together: step time less `rl/rollout-collection`, ms | 5000.0 | 4000.0 | 1.250 | |" in report
    with pytest.raises(SystemExit):  # refused before any run
        bench.main(["--no-k3", "--concurrent", "--rounds", "0", "--out", str(tmp_path / "refused.md")])
    # --live-first starts the live side first: a round to pool with another call's replay-first one
    rounds.clear()
    bench.main(["--no-k3", "--rounds", "1", "--concurrent", "--live-first", "--skip", "1",
                "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "live-first.md")])
    (first, second), = rounds
    assert [first[:2], second[:2]] == [(False, "time-live-0"), (True, "time-replay-0")]
    assert "--rounds 1 --live-first --concurrent" in (tmp_path / "live-first.md").read_text()
    with pytest.raises(SystemExit, match=r"--concurrent --nproc 2 needs 4 GPUs; 2 visible \(--share-gpus runs"):
        bench.main(["--no-k3", "--concurrent", "--nproc", "2", "--out", str(tmp_path / "refused.md")])
    with pytest.raises(SystemExit):
        bench.main(["--no-k3", "--share-gpus", "--out", str(tmp_path / "refused.md")])
    # a 2-GPU layout on a 2-GPU node: both sides on both GPUs at once, each on a port of its own
    rounds.clear()
    bench.main(["--no-k3", "--rounds", "1", "--concurrent", "--share-gpus", "--nproc", "2", "--skip", "1",
                "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "shared.md")])
    (replay, live), = rounds
    assert replay[2]["CUDA_VISIBLE_DEVICES"] == live[2]["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert replay[2]["MEGATRON_RL_INFERENCE_SERVER_PORT"] != live[2]["MEGATRON_RL_INFERENCE_SERVER_PORT"]
    assert "--nproc 2 --iters" in (tmp_path / "shared.md").read_text()
    assert "--concurrent --share-gpus" in (tmp_path / "shared.md").read_text()
    # --graphs reaches every run of the rounds and the report's command
    rounds.clear()
    graphed = []
    monkeypatch.setattr(bench, "run_together",
                        lambda starts: graphed.extend(kwargs["graphs"] for _, kwargs in starts) or fake_run_together(starts))
    bench.main(["--no-k3", "--rounds", "1", "--concurrent", "--share-gpus", "--nproc", "2", "--skip", "1", "--graphs",
                "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "graphed.md")])
    assert graphed == [True, True] and "--rounds 1 --graphs" in (tmp_path / "graphed.md").read_text()
    with pytest.raises(SystemExit):  # it sets how runs go: with logs of earlier runs, refused
        bench.main(["--from-step-logs", str(tmp_path / "a.log"), str(tmp_path / "b.log"), "--graphs",
                    "--out", str(tmp_path / "refused.md")])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="--concurrent needs 2 GPUs; 1 visible"):
        bench.main(["--no-k3", "--concurrent", "--out", str(tmp_path / "refused.md")])


def fake_example(bench, monkeypatch, tmp_path, body: str, ready: str) -> None:
    """The bench's example replaced by a bash script (its run folder ``$1``): ``body``, then, as a run under way,
    touching the file ``ready`` and running on until SIGTERM, which it notes in ``$1.stopped``."""
    script = tmp_path / "example.sh"
    script.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body) + textwrap.dedent(f"""\
        trap 'echo stopped > "$1.stopped"; kill %1; exit 143' TERM
        sleep 60 &
        touch {ready}
        wait
        """))
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "SCRIPT", script)


def test_runs_together_each_get_their_environment_and_a_failure_stops_the_other(tmp_path, monkeypatch):
    import bench.megatron_rl as bench

    # as the example: with FAIL=1 the replay side fails once the live side is under way, which runs on until stopped
    fake_example(bench, monkeypatch, tmp_path, '''\
        echo "gpu $CUDA_VISIBLE_DEVICES port $MEGATRON_RL_INFERENCE_SERVER_PORT"
        [ -z "$FAIL" ] && exit 0
        if [ "$REPLAY" = 1 ]; then
          while [ ! -e "$1.ready" ]; do sleep 0.01; done
          exit 3
        fi
        ''', ready='"${1%-0}-1.ready"')
    runs = tmp_path / "runs"

    def starts():
        return [((runs, 1, 3, 384, replay, False), dict(tag=f"t-{int(replay)}", env_extra={
            "CUDA_VISIBLE_DEVICES": str(int(replay)), "MEGATRON_RL_INFERENCE_SERVER_PORT": str(9000 + replay)}))
            for replay in (True, False)]

    (replay_cmd, replay_log, _), (live_cmd, live_log, _) = bench.run_together(starts())
    assert replay_log.strip() == "gpu 1 port 9001" and live_log.strip() == "gpu 0 port 9000"
    assert "CUDA_VISIBLE_DEVICES=1 MEGATRON_RL_INFERENCE_SERVER_PORT=9001" in replay_cmd
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(SystemExit, match="failed \\(exit 3\\)"):
        bench.run_together(starts())
    assert (runs / "t-0.stopped").read_text() == "stopped\n"  # the live side was stopped and waited for


def test_an_interrupt_stops_the_runs_and_reports_the_iterations_they_logged(tmp_path, monkeypatch):
    import time

    import torch

    import bench.megatron_rl as bench

    # as the example cut by `timeout -s INT`: it has logged its iterations and runs on until stopped
    for replay, steps in ((1, [9000.0, 5200.0, 5400.0]), (0, [9000.0, 5000.0, 5000.0])):
        (tmp_path / f"log-{replay}").write_text(timed_log(10, steps, [4000.0, 1000.0, 1000.0]))
    fake_example(bench, monkeypatch, tmp_path, f'cat "{tmp_path}/log-$REPLAY"\n', ready='"$1.ready"')
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setenv("MEGATRON", str(tmp_path))
    runs = tmp_path / "runs"

    def interrupted(started):  # Ctrl-C once both runs are under way, their iterations logged
        while len(list(runs.glob("*.ready"))) < 2:
            time.sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "finish_run", interrupted)
    out = tmp_path / "stopped.md"
    argv = ["--no-k3", "--rounds", "2", "--concurrent", "--share-gpus", "--runs", str(runs)]
    with pytest.raises(SystemExit, match="stopped by an interrupt in round 1; the report .* holds the iterations logged by then"):
        bench.main([*argv, "--skip", "1", "--out", str(out)])
    assert (runs / "time-replay-0.stopped").exists() and (runs / "time-live-0.stopped").exists()  # ended, waited for
    assert not (runs / "time-replay-1").exists()  # no round after the interrupt
    report = out.read_text()
    assert report.count("# 0 s, together, stopped by an interrupt") == 2
    assert "| mean step time, ms (2 and 2 iterations; ratio's 95% interval) | 5300.0 | 5000.0 | 1.060" in report
    assert "Round 1 was stopped by an interrupt: its iterations logged by then count." in report
    # stopped before a side logged an iteration to count: nothing to report, and nothing written
    for stale in runs.glob("*.ready"):
        stale.unlink()
    with pytest.raises(SystemExit, match="stopped by an interrupt in round 1; no round to report"):
        bench.main([*argv, "--skip", "3", "--out", str(tmp_path / "none.md")])
    assert not (tmp_path / "none.md").exists()


def test_an_interrupt_in_the_metrics_run_or_between_runs_in_turn_keeps_what_was_logged(rr, tmp_path, monkeypatch):
    import torch

    import bench.megatron_rl as bench

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setenv("MEGATRON", str(tmp_path))
    base = {"agreement": 0.99, "agreement_moved_one_token": 0.02, "routed_fraction": 1.0, "rows_without_routes": 0.0,
            "routes_used_differ": 0.0, "abs_log_ratio_replay": 1e-3, "abs_log_ratio_live": 2e-3, "k3_live": 2e-5,
            "outside_2x_replay": 0.0, "outside_2x_live": 0.0, "outside_5x_replay": 0.0, "outside_5x_live": 0.0}
    metrics_log = "\n".join("INFO:megatron.rl.rl_utils:" + rr.format_metrics(it, {**base, "k3_replay": 1e-6 * it})
                            for it in (1, 2))

    def stopped_metrics_run(*args, **kwargs):
        raise bench.RunsStopped([("REPLAY=1 METRICS=1", metrics_log, 5.0)])

    monkeypatch.setattr(bench, "run", stopped_metrics_run)
    out = tmp_path / "k3.md"
    with pytest.raises(SystemExit, match="stopped by an interrupt in the metrics run; the report .* holds"):
        bench.main(["--rounds", "1", "--out", str(out)])
    report = out.read_text()
    assert "REPLAY=1 METRICS=1    # 5 s, stopped by an interrupt" in report
    assert "| mean k3 over 2 collections (same rollouts) | 1.500e-06 | 2.000e-05 |" in report
    # the metrics run done, the first round stopped before it logged an iteration: the metrics run's part is written
    def metrics_done_then_round_stopped(*args, **kwargs):
        if kwargs["tag"] == "metrics":
            return "REPLAY=1 METRICS=1", metrics_log, 50.0
        raise bench.RunsStopped([("REPLAY=1", "starting", 1.0)])

    monkeypatch.setattr(bench, "run", metrics_done_then_round_stopped)
    with pytest.raises(SystemExit, match="in round 1; the report .* holds the metrics run logged by then"):
        bench.main(["--rounds", "1", "--out", str(out), "--overwrite"])
    report = out.read_text()
    assert "| mean k3 over 2 collections (same rollouts) | 1.500e-06 | 2.000e-05 |" in report
    assert "Round 1 was stopped by an interrupt: it is left out (a side logged no iteration after --skip 5)." in report
    # in turn: the second run stopped; the first, done, comes back with it
    calls = []

    def replay_done_then_live_stopped(*args, **kwargs):
        calls.append(kwargs["tag"])
        if len(calls) == 1:
            return "REPLAY=1", "replay log", 9.0
        raise bench.RunsStopped([("REPLAY=0", "live log so far", 2.0)])

    monkeypatch.setattr(bench, "run", replay_done_then_live_stopped)
    with pytest.raises(bench.RunsStopped) as stopped:
        bench.run_in_turn([((), dict(tag="replay")), ((), dict(tag="live"))])
    assert stopped.value.results == [("REPLAY=1", "replay log", 9.0), ("REPLAY=0", "live log so far", 2.0)]


def test_the_bench_compares_the_step_times_at_equal_generation_work(tmp_path):
    """Replay drew more long collections (sampling): the raw means differ by far more than replay's own 20 ms,
    the fit on each collection's engine steps gives back the 20 ms; the rounds' own levels are blocks. On two
    ranks the step waits for the rank that generated longest, whichever rank that is."""
    from bench.megatron_rl import main as bench_main

    step = " [2026-11-30 10:00:00.000000] iteration {:8d}/{:8d} | elapsed time per iteration (ms): {:.1f} |"

    def log(engine_counts, extra, level, short_rank=None):
        # short_rank: a second rank whose collections all ran 2 steps, logged before the long one's
        lines = []
        for it, count in enumerate(engine_counts, start=1):
            if short_rank is not None:
                lines += [engine_line(short_rank, n, 10.0, True, 4) for n in range(2)]
            lines += [engine_line(1 if short_rank == 0 else 0, n, 10.0, True, 4) for n in range(count)]
            jitter = 4.0 if it % 2 else -4.0
            lines.append(step.format(it, len(engine_counts), level + 1000.0 + 50.0 * count + extra + jitter))
        return "\n".join(lines)

    live, replay = [3, 2, 2, 2, 9, 2, 2, 3], [3, 9, 9, 2, 2, 9, 2, 3]
    paths = []
    for index, level in enumerate((0.0, 300.0)):  # round 2 ran 300 ms slower on both sides
        for side, counts, extra in (("replay", replay, 20.0), ("live", live, 0.0)):
            paths.append(tmp_path / f"{side}-{index}.log")
            paths[-1].write_text(log(counts, extra, level))
    out = tmp_path / "step.md"
    bench_main(["--from-step-logs", *map(str, paths), "--skip", "1", "--out", str(out)])
    report = out.read_text()
    raw = next(line for line in report.splitlines() if line.startswith("| mean step time, ms"))
    assert float(raw.split("|")[4].split()[0]) > 1.08
    row = next(line for line in report.splitlines() if "at equal generation work" in line)
    replay_ms, live_ms, ratio = (cell.strip() for cell in row.split("|")[2:5])
    assert "(4.1 engine steps a collection;" in row and "rounds as blocks" in row
    assert float(replay_ms) - float(live_ms) == pytest.approx(20.0, abs=2.0)
    mean_engine = sum(live[1:] + replay[1:]) / 14
    assert float(live_ms) == pytest.approx(150.0 + 1000.0 + 50.0 * mean_engine, abs=2.0)
    low, high = (float(x) for x in ratio.split("(")[1].rstrip(")").split("-"))
    assert low < 1 + 20.0 / float(live_ms) < high and high - low < 0.02
    # the same collections with rank 1 the long one and rank 0 running 2 steps each time: the same fit
    for index, level in enumerate((0.0, 300.0)):
        for (side, counts, extra), path in zip((("replay", replay, 20.0), ("live", live, 0.0)), paths[2 * index:]):
            path.write_text(log(counts, extra, level, short_rank=0))
    bench_main(["--from-step-logs", *map(str, paths), "--skip", "1", "--out", str(out), "--overwrite"])
    assert next(line for line in out.read_text().splitlines() if "at equal generation work" in line) == row
    # a counted iteration whose collection's engine steps were not logged: no such row
    paths[0].write_text(log([3, 0, *replay[2:]], 20.0, 0.0))
    bench_main(["--from-step-logs", *map(str, paths), "--skip", "1", "--out", str(out), "--overwrite"])
    assert "equal generation work" not in out.read_text()
