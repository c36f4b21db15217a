"""tools/plot_metrics.py draws a PNG of the expected size and refuses what it cannot plot."""

import json
import struct
import subprocess
import sys
from pathlib import Path

from tools.plot_metrics import main

ROOT = Path(__file__).resolve().parent.parent
MISMATCH = ("logp_abs_diff", "logp_sq_diff", "k3_kl", "frac_abs_gt_ln2", "frac_abs_gt_ln5")


def write_metrics(path, modes, iterations=6, extra=True):
    """A --metrics-file: mismatch metrics of the given routing modes, plus reward and agreement."""
    with open(path, "w") as f:
        for it in range(1, iterations + 1):
            record = {"iteration": it, "consumed_samples": 8 * it, "tokens": 100, "loss": 2.0 / it}
            for mode, scale in modes:
                record.update({f"mismatch/{mode}/{m}": scale / it for m in MISMATCH})
            record[f"mismatch/{modes[0][0]}/frac_abs_gt_ln5"] = 0.0  # zeros are masked on a log axis
            if extra:
                record.update({"reward/mean": 0.1 * it, "routing/agreement": 0.9,
                               "routing/agreement/layer_2": 0.95, "routing/agreement/layer_4": 0.85})
            f.write(json.dumps(record) + "\n")
    return path


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_overlaid_runs_as_a_subprocess(tmp_path):
    compare = write_metrics(tmp_path / "compare.jsonl", [("replay", 1e-3), ("live", 1e-2)])
    baseline = write_metrics(tmp_path / "baseline.jsonl", [("live", 2e-2)], extra=False)
    out = tmp_path / "r3.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(compare), str(baseline), "--out", str(out),
         "--labels", "R3", "no R3", "--dpi", "40"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    # Three mismatch panels, reward and agreement: two rows of three 5 x 3.5 inch panels at 40 dpi.
    assert png_size(out) == (600, 280)
    assert "wrote" in proc.stdout and "600 x 280" in proc.stdout


def test_mismatch_only_run_has_one_row(tmp_path):
    replay_only = write_metrics(tmp_path / "replay.jsonl", [("replay", 1e-3)], extra=False)
    assert main([str(replay_only), "--out", str(tmp_path / "one.png"), "--dpi", "40"]) == 0
    assert png_size(tmp_path / "one.png") == (600, 140)


def test_nothing_to_plot_or_not_jsonl_is_refused(tmp_path, capsys):
    good = write_metrics(tmp_path / "good.jsonl", [("live", 1e-2)])
    empty = tmp_path / "loss_only.jsonl"
    empty.write_text('{"iteration": 1, "loss": 2.0}\n{"iteration": 2, "loss": 1.5}\n')
    out = tmp_path / "x.png"
    assert main([str(good), str(empty), "--out", str(out)]) == 1
    assert f"{empty}: no plottable metric" in capsys.readouterr().err
    assert not out.exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"iteration": 1, "mismatch/live/k3_kl": 0.1}\n{"loss": 1.0}\n')
    assert main([str(broken), "--out", str(out)]) == 1
    assert "broken.jsonl line 2: a JSON object with a numeric 'iteration' is expected" in capsys.readouterr().err


def test_missing_matplotlib_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    good = write_metrics(tmp_path / "good.jsonl", [("live", 1e-2)])
    assert main([str(good), "--out", str(tmp_path / "x.png")]) == 1
    assert "tools/plot_metrics.py needs matplotlib: run `make install`" in capsys.readouterr().err


def test_a_value_between_zeros_is_marked_where_a_log_axis_draws_no_line():
    from tools.plot_metrics import isolated_positive

    iterations = [0, 1, 2, 3, 4, 5, 6]
    fractions = [7e-4, 0.0, 0.0, 8e-4, 0.0, 3e-4, 5e-4]  # a rare tail, as --r3-compare's ln 2 fraction
    assert isolated_positive(iterations, fractions) == [(0, 7e-4), (3, 8e-4)]
    assert isolated_positive([1], [0.0]) == [] and isolated_positive([1], [2e-4]) == [(1, 2e-4)]
