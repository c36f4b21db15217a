"""Several bench.step runs in one table: each variant's host issue, device time, MFU and ratios by shape and EP.

    python -m bench.step_table build/bench/step-*.json --out build/bench/step-table.md

``bench.step --out X.md`` writes ``X.json`` beside its report with the figures of each variant; this reads
any number of them (the 2 x 8192 and 4 x 16384 shapes on 1 and 2 GPUs, say) and writes one Markdown
table, rows ordered by shape then expert-parallel size, with the command of each run under it, and the
targets of docs/benchmarks.md's update-pass section read from it: host issue <= 0.5 x device, MFU >= 30%,
replay <= 1.00 x live and <= 0.95 x upstream.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import cell, publish_report

HEAD = ("| rows per rank | EP | variant | pass ms | host issue ms | device ms | host issue / device | of bf16 peak | "
        "peak memory GiB | tokens/s (all ranks) | vs upstream | vs live |")
RULE = "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"


def table(records: list[dict]) -> str:
    """The runs' variants in one table, then each run's command and device."""
    records = sorted(records, key=lambda r: (r["seq_length"] * r["microbatches"], r["ep"]))
    lines = [HEAD, RULE]
    for record in records:
        shape = f"{record['microbatches']} x {record['seq_length']}"
        for variant, f in record["variants"].items():
            lines.append(f"| {shape} | {record['ep']} | {variant} | {f['pass_ms']:.2f} | {f['host_issue_ms']:.2f} | "
                         f"{cell(f['device_ms'], '.2f')} | {cell(f['issue_over_device'], '.2f')} | "
                         f"{cell(f['of_peak'], '.1%')} | {cell(f['peak_memory_gib'], '.1f')} | "
                         f"{f['tokens_per_s']:.0f} | {f['vs_upstream']:.3f} | {f['vs_live']:.3f} |")
            shape = ""
    lines += ["", "Runs (each on " + ", ".join(sorted({r["device"] for r in records})) + "):", ""]
    lines += [f"- `{record['command']}`" for record in records]
    return "\n".join(lines + ["", *targets(records)]) + "\n"


def targets(records: list[dict]) -> list[str]:
    """Each target of the update pass against the runs: the variants that miss it, by shape and EP."""
    misses = {"host issue <= 0.5 x device": [], "MFU >= 30% of the bf16 peak": [],
              "replay <= 1.00 x live": [], "replay <= 0.95 x upstream": []}
    for record in records:
        where = f"{record['microbatches']} x {record['seq_length']} EP={record['ep']}"
        for variant, f in record["variants"].items():
            if f["issue_over_device"] is not None and f["issue_over_device"] > 0.5:
                misses["host issue <= 0.5 x device"].append(f"{where} {variant} ({f['issue_over_device']:.2f})")
            if f["of_peak"] is not None and f["of_peak"] < 0.30:
                misses["MFU >= 30% of the bf16 peak"].append(f"{where} {variant} ({f['of_peak']:.1%})")
            if variant.startswith("replay") and f["vs_live"] > 1.0:
                misses["replay <= 1.00 x live"].append(f"{where} {variant} ({f['vs_live']:.3f})")
            if variant.startswith("replay") and f["vs_upstream"] > 0.95:
                misses["replay <= 0.95 x upstream"].append(f"{where} {variant} ({f['vs_upstream']:.3f})")
    return [f"- {target}: " + ("met by every row" if not missed else "missed by " + ", ".join(missed))
            for target, missed in misses.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", type=Path, help="bench.step's JSON records (beside its --out)")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    records = []
    for path in args.records:
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            sys.exit(f"bench.step_table: {path}: not a bench.step record ({err})")
    publish_report(table(records), args.out)


if __name__ == "__main__":
    main()
