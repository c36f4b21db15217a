"""bench/series_cost.py: its arithmetic, arguments, refusal without a bundle, the worker's
sys.path (the chosen tree first), side alternation; and, on a GPU, a tiny run on both sides."""

import json
from pathlib import Path

import pytest

from bench import series_cost as sc

ROOT = Path(__file__).resolve().parent.parent


def _fake_tree(root, version):
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text(f"__version__ = {version!r}\n")


def _fake_bundle(path, base="0.19"):
    for side, version in (("pristine", "0.19.2"), ("patched", "0.19.2+r3")):
        _fake_tree(path / side, version)
    manifest = {"base": base, "project_commit": "abc123", "source_rev": "core_v0.19.0",
                "source_commit": "5be96267", "sides": {
                    "pristine": {"version": "0.19.2", "from": "sdist"},
                    "patched": {"version": "0.19.2+r3", "from": "patches/"}}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_summary_takes_round_medians_then_median_and_range():
    rounds = [{"device_ms": [1.0, 2.0, 9.0], "host_ms": [0.5, 0.5, 0.7]},
              {"device_ms": [3.0, 3.0, 3.0], "host_ms": [4.0, 5.0, 6.0]},
              {"device_ms": [2.5, 2.5, 1.0], "host_ms": [1.0, 1.0, 1.0]}]
    s = sc.side_summary(rounds)
    assert s["device_ms"] == (2.5, 2.0, 3.0)
    assert s["host_ms"] == (1.0, 0.5, 5.0)
    assert sc.host_bound({"device_ms": (2.0, 1, 3), "host_ms": (2.5, 1, 3)})
    assert not sc.host_bound({"device_ms": (2.0, 1, 3), "host_ms": (1.5, 1, 3)})
    assert sc.ratio(3.0, 2.0) == 1.5


def test_report_lists_sides_ratios_and_host_bound_rows():
    summary = {"pristine": {"device_ms": (2.0, 1.9, 2.2), "host_ms": (2.5, 2.4, 2.6)},
               "patched": {"device_ms": (1.8, 1.7, 1.9), "host_ms": (0.9, 0.8, 1.0)}}
    meta = {"command": "python -m bench.series_cost", "device": "GPU X", "torch": "2.13",
            "transformer_engine": None, "base": "0.19", "bundle": "b", "project_commit": "abc",
            "source_rev": "core_v0.19.0", "source_commit": "5be9", "tokens": 64, "hidden": 128,
            "experts": 8, "topk": 2, "moe_ffn_hidden": 64, "router_fusion": "off", "rounds": 3, "iters": 4,
            "warmup": 1, "sides": {"pristine": {"version": "0.19.2", "from": "sdist"},
                      "patched": {"version": "0.19.2+r3", "from": "patches/"}}}
    text = sc.render([{"experts_class": "TEGroupedMLP", "spec": "te", "summary": summary}], meta)
    assert "| TEGroupedMLP | pristine | te | 2.000 (1.900-2.200) | 2.500 (2.400-2.600) | host |" in text
    assert "| TEGroupedMLP | patched | te | 1.800 (1.700-1.900) | 0.900 (0.800-1.000) | device |" in text
    assert "| TEGroupedMLP | 0.900 | 0.360 |" in text
    assert "Transformer Engine not installed" in text and "router fusion off" in text
    assert "measures the host" in text


def test_arguments_defaults_and_refusals(capsys):
    args = sc.parse_args(["--base", "main"])
    assert args.bundle == (ROOT / "build" / "upstream-tests-main").resolve()
    assert args.out.name == "series-cost-main.md"
    assert (args.tokens, args.hidden, args.experts, args.topk, args.moe_ffn_hidden) == (4096, 2048, 128, 8, 768)
    assert args.router_fusion == "off"
    for bad, said in ((["--topk", "9", "--experts", "8"], "--topk 9 exceeds --experts 8"),
                      (["--rounds", "0"], "--rounds must be at least 1"),
                      (["--grouped-gemm", "maybe"], "invalid choice")):
        with pytest.raises(SystemExit):
            sc.parse_args(bad)
        assert said in capsys.readouterr().err


def test_missing_bundle_is_one_line_naming_make_upstream_tests(tmp_path, capsys):
    assert sc.main(["--base", "main", "--bundle", str(tmp_path / "none"), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "`make upstream-tests UPSTREAM_BASE=main`" in err and str(tmp_path / "none") in err
    wrong = _fake_bundle(tmp_path / "b", base="0.19")
    assert sc.main(["--base", "main", "--bundle", str(wrong), "--out", str(tmp_path / "r.md")]) == 2
    assert "is for base 0.19, not main" in capsys.readouterr().err


def test_worker_imports_the_chosen_tree_first(tmp_path):
    """The .venv's own megatron-core is installed; the worker must still import the side's tree."""
    bundle = _fake_bundle(tmp_path / "bundle")
    for side, version in (("pristine", "0.19.2"), ("patched", "0.19.2+r3")):
        root = bundle / side
        assert sc.worker_command("py", {"probe": True})[1] == str(sc.WORKER)
        assert sc.worker_env(root, tmp_path / "s")["PYTHONPATH"].split(":")[0] == str(root)
        got = sc.run_worker(sc.sys.executable, root, {"probe": True}, tmp_path / "s" / side, 60)
        assert got == {"megatron_core": str(root / "megatron" / "core"), "version": version}


def test_sides_alternate_round_by_round_and_report_is_written(tmp_path, monkeypatch):
    bundle = _fake_bundle(tmp_path / "bundle")
    calls = []

    def fake_worker(python, root, settings, scratch, timeout):
        side = Path(root).name
        calls.append((side, settings["grouped_gemm"], settings["router_fusion"]))
        ms = 2.0 if side == "pristine" else 1.0
        return {"experts_class": "SequentialMLP" if not settings["grouped_gemm"] else "TEGroupedMLP",
                "spec": "te", "device": "GPU X", "torch": "t", "transformer_engine": "2.x",
                "device_ms": [ms] * settings["iters"], "host_ms": [ms / 2] * settings["iters"]}

    monkeypatch.setattr(sc, "run_worker", fake_worker)
    out = tmp_path / "r.md"
    assert sc.main(["--bundle", str(bundle), "--out", str(out), "--rounds", "2", "--iters", "3",
                    "--grouped-gemm", "both", "--router-fusion", "on"]) == 0
    assert calls == ([("pristine", True, True), ("patched", True, True)] * 2
                     + [("pristine", False, True), ("patched", False, True)] * 2)
    text = out.read_text()
    assert "router fusion on" in text
    assert "| TEGroupedMLP | 0.500 | 0.500 |" in text and "| SequentialMLP | 0.500 | 0.500 |" in text
    assert "project commit abc123" in text and "megatron-core 0.19.2+r3 from patches/" in text


@pytest.mark.gpu
@pytest.mark.parametrize("base", ["0.19", "main"])
def test_tiny_shape_runs_on_both_sides(base, tmp_path):
    bundle = sc.upstream_tests.DEFAULT_BUNDLES[base]
    if not (bundle / "manifest.json").is_file():
        pytest.skip(f"no bundle at {bundle}: `make upstream-tests` (UPSTREAM_BASE={base}) makes it")
    out = tmp_path / "r.md"
    assert sc.main(["--base", base, "--out", str(out), "--rounds", "1", "--iters", "3", "--warmup", "1",
                    "--tokens", "256", "--hidden", "256", "--experts", "8", "--topk", "2",
                    "--moe-ffn-hidden", "128", "--grouped-gemm", "both"]) == 0
    text = out.read_text()
    assert "| patched |" in text and "| pristine |" in text and "nan" not in text
