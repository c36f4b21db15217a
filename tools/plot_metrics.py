"""Plot the launcher's metrics over iterations: routing replay (R3 on) against live routing (R3 off).

    python tools/plot_metrics.py r3.jsonl baseline.jsonl --out r3.png --labels R3 baseline

Each input is a ``--metrics-file`` of ``launch/pretrain_gpt_r3.py``: one JSON
object per logged iteration with flat, slash-separated keys (any may be missing
in a given run): ``iteration``, ``loss``, ``reward/mean``,
``mismatch/{replay,live}/{logp_abs_diff,logp_sq_diff,k3_kl,frac_abs_gt_ln2,frac_abs_gt_ln5}``
(the trainer's log-probs with replayed / with live routing against the rollout
engine's), ``routing/agreement`` and ``routing/agreement/layer_<n>`` (the fraction
of (token, MoE layer) where the trainer's live top-k equals the rollout's route),
``routing/replayed_tokens``, ``routing/live_tokens``, ...

One panel each, log-scale y, for the k3 KL, the mean |logp_train - logp_rollout|
and the fraction of tokens with |logp diff| > ln 2 (importance ratio outside
[1/2, 2]): ``replay`` solid, ``live`` dashed. A ``--r3-compare`` run has both, a
run without replay only ``live``, a run with replay only ``replay``. Then a
reward panel and a routing-agreement panel (per MoE layer in thin lines) when a
file has those keys. Several files are overlaid, one colour each, labelled by
file stem or ``--labels``. Panels are 5 x 3.5 inches, three to a row, at
``--dpi``: three panels at the default 100 dpi make a 1500 x 350 PNG.

matplotlib (Agg backend) is needed by this tool only; ``make install`` installs it.
A file that is not JSONL, a line without an ``iteration``, or a file with none of
the plotted metrics is refused with a message naming it. The PNG is drawn under a
temporary name next to ``--out`` and renamed once complete; an ``--out`` that is
one of the inputs is refused, and an existing one unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_r3.dataplane.formats.output_files import OutputFileError, atomic_output

MISMATCH_METRICS = (
    ("k3_kl", "k3 KL estimate"),
    ("logp_abs_diff", "mean |logp_train - logp_rollout|"),
    ("frac_abs_gt_ln2", "fraction of tokens with |logp diff| > ln 2"),
)
ROUTING_MODES = (("replay", "R3 on (replay)", "-"), ("live", "R3 off (live)", "--"))
LAYER_AGREEMENT_PREFIX = "routing/agreement/layer_"
PANEL_INCHES = (5.0, 3.5)
PANELS_PER_ROW = 3


class MetricsFileError(ValueError):
    """A metrics file that cannot be plotted."""


@dataclass
class Run:
    """One metrics file: its label in the legends, its path, its records."""

    label: str
    path: str
    records: list[dict]


@dataclass
class Curve:
    """One line of a panel: a metric key of every run, drawn in a style."""

    key: str
    label: str
    style: str = "-"
    width: float = 1.6


@dataclass
class Panel:
    title: str
    curves: list[Curve]
    log_y: bool


def read_metrics(path: str) -> list[dict]:
    """The JSON objects of a metrics file, in file order; each must have a numeric ``iteration``."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise MetricsFileError(f"{path} line {number}: not JSON ({error})") from None
            if not isinstance(record, dict) or not _is_number(record.get("iteration")):
                raise MetricsFileError(f"{path} line {number}: a JSON object with a numeric 'iteration' is expected")
            records.append(record)
    return records


def plan_panels(runs: list[Run]) -> list[Panel]:
    """The panels to draw: every one with a curve that some run has data for.

    Raises:
        MetricsFileError: a run with none of the plotted metrics.
    """
    layers = sorted({int(key[len(LAYER_AGREEMENT_PREFIX):]) for run in runs for r in run.records for key in r
                     if key.startswith(LAYER_AGREEMENT_PREFIX) and key[len(LAYER_AGREEMENT_PREFIX):].isdigit()})
    candidates = [
        Panel(title, [Curve(f"mismatch/{mode}/{metric}", label, style) for mode, label, style in ROUTING_MODES], True)
        for metric, title in MISMATCH_METRICS
    ]
    candidates.append(Panel("reward (mean)", [Curve("reward/mean", "reward")], False))
    candidates.append(Panel(
        "routing agreement, live top-k vs rollout route",
        [Curve("routing/agreement", "all MoE layers")]
        + [Curve(f"{LAYER_AGREEMENT_PREFIX}{n}", f"layer {n}", ":", 0.7) for n in layers],
        False,
    ))
    plotted = {curve.key for panel in candidates for curve in panel.curves}
    for run in runs:
        if not any(_is_number(r.get(key)) for r in run.records for key in plotted):
            raise MetricsFileError(
                f"{run.path}: no plottable metric (none of mismatch/{{replay,live}}/"
                f"{{{','.join(m for m, _ in MISMATCH_METRICS)}}}, reward/mean, routing/agreement)"
            )
    return [p for p in candidates if any(_series(run.records, c.key)[0] for run in runs for c in p.curves)]


def plot(runs: list[Run], out: str, dpi: int = 100) -> tuple[int, int]:
    """Draws ``runs`` into the PNG ``out``; returns its (width, height) in pixels."""
    plt = _pyplot()
    panels = plan_panels(runs)
    cols = min(PANELS_PER_ROW, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * PANEL_INCHES[0], rows * PANEL_INCHES[1]), dpi=dpi,
                             squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        positive = False
        for color, run in enumerate(runs):
            for curve in panel.curves:
                x, y = _series(run.records, curve.key)
                if not x:
                    continue
                positive |= any(v > 0 for v in y)
                label = run.label if len(panel.curves) == 1 else f"{run.label}: {curve.label}"
                ax.plot(x, y, curve.style, color=f"C{color % 10}", linewidth=curve.width, label=label)
                if panel.log_y:
                    # A value between zeros draws no line on a log axis (its neighbours are masked): mark it.
                    dots = isolated_positive(x, y)
                    ax.plot([p[0] for p in dots], [p[1] for p in dots], "o", color=f"C{color % 10}", markersize=3)
        if panel.log_y and positive:
            ax.set_yscale("log", nonpositive="mask")  # a zero mismatch has no place on a log axis
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    # No bbox_inches="tight": the size stays panels x PANEL_INCHES x dpi. The format is given: ``out``
    # may be a temporary name.
    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return int(cols * PANEL_INCHES[0] * dpi), int(rows * PANEL_INCHES[1] * dpi)


def isolated_positive(x: list, y: list) -> list[tuple]:
    """The (x, y) points with y > 0 whose neighbours in the series are both absent or not positive."""
    return [(x[i], y[i]) for i in range(len(y))
            if y[i] > 0 and (i == 0 or y[i - 1] <= 0) and (i == len(y) - 1 or y[i + 1] <= 0)]


def _series(records: list[dict], key: str) -> tuple[list, list]:
    """(iterations, values) of the records that have a finite number under ``key``."""
    points = [(r["iteration"], r[key]) for r in records if _is_number(r.get(key)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or a clear error when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise MetricsFileError(
            "tools/plot_metrics.py needs matplotlib: run `make install` (requirements.txt pins it) "
            "or `pip install matplotlib`"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics JSONL files (--metrics-file of the launcher)")
    parser.add_argument("--out", required=True, help="PNG to write (not an input; see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--labels", nargs="+", help="one label per file (default: the file stems)")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    labels = args.labels or [Path(p).stem for p in args.metrics]
    if len(labels) != len(args.metrics):
        parser.error(f"--labels gives {len(labels)} labels for {len(args.metrics)} files")
    try:
        runs = [Run(label, path, read_metrics(path)) for label, path in zip(labels, args.metrics)]
        with atomic_output(args.out, args.metrics, args.overwrite) as partial:
            width, height = plot(runs, partial, dpi=args.dpi)
    except (MetricsFileError, OutputFileError, OSError) as error:
        print(f"plot_metrics: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({width} x {height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
