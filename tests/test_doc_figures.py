"""The default-run figures README.md and docs/launcher.md quote are the means of the metrics file they cite."""

import json
import statistics
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
CPU_METRICS = ROOT / "docs" / "r3-default-metrics.jsonl"


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(row[key] for row in rows)


def sci(value: float) -> str:
    """3 significant digits as the docs write them: 4.74e-4."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def benchmarks_row(rows: list[dict]) -> str:
    """How docs/benchmarks.md ends a GPU run's row: k3 with and without replay, their ratio, the agreement."""
    replay, live = mean(rows, "mismatch/replay/k3_kl"), mean(rows, "mismatch/live/k3_kl")
    return f"| {sci(replay)} | {sci(live)} | **{live / replay:.0f}x** | {mean(rows, 'routing/agreement'):.3f} |"


def test_the_cpu_default_runs_figures_are_the_files():
    rows = [json.loads(line) for line in CPU_METRICS.read_text().splitlines()]
    replay, live = mean(rows, "mismatch/replay/k3_kl"), mean(rows, "mismatch/live/k3_kl")
    ratio = f"{live / replay:.0f}x"
    live_ln2 = f"{100 * mean(rows, 'mismatch/live/frac_abs_gt_ln2'):.2f}%"
    assert mean(rows, "mismatch/replay/frac_abs_gt_ln2") == 0
    readme = (ROOT / "README.md").read_text()
    assert f"{sci(replay)} with replay against {sci(live)} without ({ratio})" in readme
    assert f"({live_ln2} without)" in readme
    launcher = (ROOT / "docs" / "launcher.md").read_text()
    assert f"| k3 KL | {sci(replay)} | {sci(live)} | {ratio} |" in launcher
    assert f"| `|d| > ln 2` | 0 | {live_ln2} | |" in launcher
    abs_replay, abs_live = mean(rows, "mismatch/replay/logp_abs_diff"), mean(rows, "mismatch/live/logp_abs_diff")
    assert f"| mean `|d|` | {abs_replay:.4f} | {abs_live:.4f} | {abs_live / abs_replay:.1f}x |" in launcher
    assert f"routing agreement {mean(rows, 'routing/agreement'):.3f}" in launcher


def test_the_gpu_default_runs_figures_are_the_files():
    launcher = (ROOT / "docs" / "launcher.md").read_text()
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    for gpus, name in ((1, "r3-default-gpu-metrics.jsonl"), (2, "r3-default-gpu2-metrics.jsonl")):
        rows = [json.loads(line) for line in (ROOT / "docs" / name).read_text().splitlines()]
        assert len(rows) == 40
        replay, live = mean(rows, "mismatch/replay/k3_kl"), mean(rows, "mismatch/live/k3_kl")
        assert mean(rows, "mismatch/replay/frac_abs_gt_ln2") == 0
        live_ln2 = f"{100 * mean(rows, 'mismatch/live/frac_abs_gt_ln2'):.2f}%"
        row = (f"| {gpus} | {{wall}} | {sci(replay)} | {sci(live)} | {live / replay:.0f}x | "
               f"{mean(rows, 'routing/agreement'):.3f} | 0 / {live_ln2} |")
        prefix, _, suffix = row.partition("{wall}")
        assert any(line.startswith(prefix) and line.endswith(suffix) for line in launcher.splitlines()), row
        bench_row = benchmarks_row(rows)
        assert any(line.startswith(f"| {gpus} GPU") and line.endswith(bench_row) for line in bench), bench_row
        if gpus == 1:
            assert f"{sci(replay)} against {sci(live)} ({live / replay:.0f}x)" in readme


def warm_start_figures(name: str) -> tuple[list[dict], float, float, str]:
    """Checks docs/benchmarks.md's k3 table of a train_rl.py run from the warm start against its records; returns
    the records, the two k3 means and the page."""
    rows = [json.loads(line) for line in (ROOT / "docs" / name).read_text().splitlines()]
    replay, live = mean(rows, "mismatch/replay/k3_kl"), mean(rows, "mismatch/live/k3_kl")
    calm = [row for row in rows if row["mismatch/live/frac_abs_gt_ln2"] == 0]
    calm_replay, calm_live = mean(calm, "mismatch/replay/k3_kl"), mean(calm, "mismatch/live/k3_kl")
    median = statistics.median(row["mismatch/replay/k3_kl"] / row["mismatch/live/k3_kl"] for row in rows)
    assert mean(rows, "mismatch/replay/frac_abs_gt_ln2") == 0
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert (f"| mean over {len(rows)} collections | {replay:.2e} | {live:.2e} | {replay / live:.3f} |"
            .replace("e-0", "e-") in bench)
    assert (f"| mean over the {len(calm)} collections with no token outside [1/2, 2] | {calm_replay:.2e} | "
            f"{calm_live:.2e} | {calm_replay / calm_live:.2f} |".replace("e-0", "e-") in bench)
    assert f"| median of the per-collection ratio | | | {median:.3f} |" in bench
    return rows, replay, live, bench


def lower_count_and_guide(rows: list[dict], replay: float, live: float, bench: str) -> None:
    """Checks the page's count of collections where replay was lower and docs/megatron_rl.md's line of the run."""
    lower = sum(row["mismatch/replay/k3_kl"] < row["mismatch/live/k3_kl"] for row in rows)
    assert f"Replay was lower in {lower} of {len(rows)}" in bench
    guide = (ROOT / "docs" / "megatron_rl.md").read_text().replace("\n  ", " ")
    assert f"mean with replay {replay / live:.3f} of routing live over {len(rows)} collections ({replay:.2e} against " \
           f"{live:.2e})".replace("e-0", "e-") in guide


def test_the_train_rl_warm_start_figures_are_the_file():
    rows, replay, live, bench = warm_start_figures("megatron-rl-warm-metrics.jsonl")
    assert f"picks the engine's top-4 set for {100 * mean(rows, 'routing/agreement'):.1f}%" in bench
    guide = (ROOT / "docs" / "megatron_rl.md").read_text()
    assert f"({replay:.2e} against {live:.2e}, ratio {replay / live:.3f}".replace("e-0", "e-") in guide


def test_the_train_rl_warm_start_figures_on_two_gpus_are_the_file():
    rows, replay, live, bench = warm_start_figures("megatron-rl-warm1024-np2-metrics.jsonl")
    assert len(rows) == 50
    bench = bench.replace("\n", " ")
    lower_count_and_guide(rows, replay, live, bench)
    worst = max(rows, key=lambda row: row["mismatch/live/k3_kl"])
    rest = [row for row in rows if row is not worst]
    rest_replay, rest_live = mean(rest, "mismatch/replay/k3_kl"), mean(rest, "mismatch/live/k3_kl")
    assert (f"without that collection the ratio is {rest_replay / rest_live:.3f} ({rest_replay:.2e} against "
            f"{rest_live:.2e})".replace("e-0", "e-") in bench)
    assert f"at iteration {worst['iteration']} one" in bench


def test_the_train_rl_warm_start_figures_at_seq_len_1024_are_the_file():
    rows, replay, live, bench = warm_start_figures("megatron-rl-warm1024-metrics.jsonl")
    bench = bench.replace("\n", " ")
    lower_count_and_guide(rows, replay, live, bench)
    assert f"as did one over {len(rows)} ({replay / live:.3f})" in bench
    assert "one over 45 at `SEQ_LEN=384` (0.036)" in bench


def test_the_gpu_router_sweep_table_is_the_file():
    """Every run of docs/r3-gpu-router-sweep.jsonl is a row of docs/launcher.md's router table, by its GPUs, k3
    means, ratio and agreement, under a label that names its router and flags ("the same" repeats the row
    above's); docs/benchmarks.md's rerun table gives the same runs' walls and figures."""
    runs = [json.loads(line) for line in (ROOT / "docs" / "r3-gpu-router-sweep.jsonl").read_text().splitlines()]
    launcher = (ROOT / "docs" / "launcher.md").read_text().splitlines()
    table = launcher[launcher.index("| router and shape | GPUs | k3 replay | k3 live | live / replay | agreement |"):]
    table = table[2:table.index("")]
    labels, label = {}, ""
    for line in table:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        label = label if cells[0].startswith("the same") else cells[0]
        labels[" | ".join(cells[1:])] = label + cells[0].removeprefix("the same")
    assert len(labels) == len(runs)
    for run in runs:
        ratio = run["k3_live"] / run["k3_replay"]
        figures = (f"{run['gpus']} | {sci(run['k3_replay'])} | {sci(run['k3_live'])} | {ratio:.0f}x | "
                   f"{run['routing_agreement']:.3f}")
        label = labels.pop(figures)
        assert label.startswith(run["router"])
        for flag in run["flags"].replace("--moe-router-score-function sigmoid", "").split("--")[1:]:
            assert f"--{flag.strip()}" in label, (label, run["flags"])
    beyond = [run for run in runs if run["frac_abs_gt_ln2_replay"] > 0]
    assert [run["flags"] for run in beyond] == ["--init-method-std 0.2"]
    assert f"under replay: {100 * beyond[0]['frac_abs_gt_ln2_replay']:.2f}% of the tokens" in "\n".join(launcher)
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in ("sig/sig-np1", "sig/sig-np2", "sweep42/base", "sig/base-np2"):
        run = next(run for run in runs if run["run"] == name)
        ratio = f"{run['k3_live'] / run['k3_replay']:.0f}x"
        ratio = f"**{ratio}**" if run["router"] == "sigmoid" else ratio
        assert (f"| {run['wall_s']} s | {sci(run['k3_replay'])} | {sci(run['k3_live'])} | {ratio} | "
                f"{run['routing_agreement']:.3f} |") in bench, name


@pytest.mark.parametrize("name, collections, verdict", [
    ("megatron-rl-warm1024-np1-metrics.jsonl", 50, "An earlier 1-GPU run of 50 missed it ({})"),
    ("megatron-rl-warm1024-np1-timed-metrics.jsonl", 30, "within 1/10 over this run's 30 collections ({})"),
    ("megatron-rl-warm1024-np1-timed50-metrics.jsonl", 50,
     "on 1 GPU over 50 collections at `SEQ_LEN=1024` in the latest run ({};"),
])
def test_the_train_rl_warm_start_figures_on_one_gpu_are_the_file(name, collections, verdict):
    rows, replay, live, bench = warm_start_figures(name)
    assert len(rows) == collections
    bench = bench.replace("\n", " ")
    lower_count_and_guide(rows, replay, live, bench)
    tails = [row["iteration"] for row in rows if row["mismatch/live/frac_abs_gt_ln2"] > 0]
    named = ", ".join(map(str, tails[:-1])) + f" and {tails[-1]}"
    assert f"in {len(tails)} of the {collections} collections (iterations {named}," in bench
    assert verdict.format(f"{replay / live:.3f}") in bench



@pytest.mark.parametrize("gpus, name", [(1, "r3-default-gpu-a2349c7-metrics.jsonl"),
                                        (2, "r3-default-gpu2-ebc2ccd-metrics.jsonl"),
                                        (2, "r3-default-gpu2-25eb7c6-metrics.jsonl")])
def test_the_gpu_reruns_figures_are_the_files(gpus, name):
    rows = [json.loads(line) for line in (ROOT / "docs" / name).read_text().splitlines()]
    assert len(rows) == 40 and mean(rows, "mismatch/replay/frac_abs_gt_ln2") == 0
    row = benchmarks_row(rows)
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert any(line.startswith(f"| {gpus} GPU") and f"`docs/{name}`" in bench and line.endswith(row)
               for line in bench.splitlines()), row


def test_the_update_pass_table_is_the_runs_records():
    """docs/benchmarks.md's update-pass table of main c615257 is bench.step_table's table of the four runs' records
    kept beside it, row by row, and the EP=2 against one-GPU ratio it states is theirs."""
    from bench.step_table import table

    records = [json.loads(path.read_text()) for path in sorted((ROOT / "docs" / "step-c615257").glob("t-*.json"))]
    assert len(records) == 4
    rows = table(records).split("\n\n")[0].splitlines()
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    section = bench[bench.index("`docs/step-c615257/`"):]
    lines = section.splitlines()
    start = lines.index(rows[0])
    assert lines[start:start + len(rows)] == rows
    one, two = (next(r for r in records if r["ep"] == ep and r["seq_length"] == 8192) for ep in (1, 2))
    flat = section.replace("\n  ", " ")  # a bullet's lines joined
    for variant in ("replay+graph", "live+graph"):
        high, low = two["variants"][variant]["tokens_per_s"], one["variants"][variant]["tokens_per_s"]
        assert f"{high / low:.3f}x" in flat and f"{high:.0f} against {low:.0f}" in flat
