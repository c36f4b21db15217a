"""CPU tests of tools/upstream_tests.py: prepare on a synthetic Megatron-LM-like tree, run with
its pytest plugin (a hang, a crash, the resume after them), and the comparison table on
crafted junit files."""

import importlib.util
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "upstream_tests.py"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ut = _load("upstream_tests", TOOL)


@pytest.fixture(autouse=True)
def _no_device_probe(monkeypatch):
    """`run` asks torch about the device (2 s of import); the tests need not."""
    monkeypatch.setattr(ut, "_device_line", lambda python: "test machine")


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


PACKAGE_INFO = "MAJOR = 0\nMINOR = 19\nPATCH = 2\n__version__ = '0.19.2'{}\n"


def _fake_core(base, label=""):
    """megatron/core and megatron/training of a fake megatron-core tree at `base`."""
    _write(base / "megatron" / "core" / "__init__.py",
           "from megatron.core import package_info\nSIDE = %r\n" % (label or "pristine"))
    (base / "megatron" / "core" / "package_info.py").write_text(
        PACKAGE_INFO.format(" + '+r3'" if label == "patched" else ""))
    _write(base / "megatron" / "training" / "__init__.py", "")
    _write(base / "megatron" / "training" / "helpers.py", "from megatron.rl import thing\n")


@pytest.fixture
def upstream(tmp_path):
    """A Megatron-LM-like checkout, a pristine 'sdist' and a patched tree."""
    repo = tmp_path / "Megatron-LM"
    _fake_core(repo)
    _write(repo / "megatron" / "rl" / "__init__.py", "thing = 1\n")
    _write(repo / "megatron" / "rl" / "more.py", "import megatron.elastic\n")
    _write(repo / "megatron" / "elastic" / "__init__.py", "")
    _write(repo / "megatron" / "unused" / "__init__.py", "")
    _write(repo / "gpt_builders.py", "def load():\n    import yaml_like_dep\n")
    _write(repo / "pyproject.toml", """\
        [tool.pytest.ini_options]
        markers = ["internal: a marker upstream declares"]
        """)
    _write(repo / "tests" / "__init__.py", "")
    _write(repo / "tests" / "unit_tests" / "__init__.py", "")
    _write(repo / "tests" / "unit_tests" / "conftest.py", "from tests.unit_tests.helpers import X\n")
    _write(repo / "tests" / "unit_tests" / "helpers.py", "import numpy\nX = 1\n")
    _write(repo / "tests" / "unit_tests" / "unused_helper.py", "")
    _write(repo / "tests" / "test_utils" / "python_scripts" / "dl.py", "import click\n")
    _write(repo / "tests" / "unit_tests" / "moe" / "__init__.py", "")
    _write(repo / "tests" / "unit_tests" / "moe" / "test_a.py", """\
        import time

        import pytest

        from megatron.core import SIDE
        from tests.test_utils.python_scripts import dl
        from megatron.training.helpers import thing


        def test_pass():
            assert True


        def test_side_dependent():
            assert SIDE == "pristine", "only the pristine side passes"


        @pytest.mark.skip(reason="not here")
        def test_skip():
            pass


        def test_hang():
            if SIDE == "patched":
                time.sleep(60)


        def test_after_hang():
            from gpt_builders import __name__ as name  # a lazy import of a repo-top module
            assert name
        """)
    _write(repo / "tests" / "unit_tests" / "other" / "test_b.py", "def test_b():\n    pass\n")
    sdist_src = tmp_path / "sdist" / "megatron_core-0.19.2"
    _fake_core(sdist_src)
    sdist = tmp_path / "fake-megatron-core.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(sdist_src, arcname="megatron_core-0.19.2")
    patched = tmp_path / "patched-tree"
    _fake_core(patched, "patched")
    return repo, sdist, patched


def _prepare(upstream, out, *extra):
    repo, sdist, patched = upstream
    return ut.main(["prepare", "--megatron", str(repo), "--sdist", str(sdist), "--patched",
                    str(patched), "--out", str(out), "--files", "tests/unit_tests/moe/", *extra])


def test_prepare_copies_what_the_tests_import_and_each_sides_core(upstream, tmp_path):
    out = tmp_path / "bundle"
    assert _prepare(upstream, out) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["test_files"] == ["tests/unit_tests/moe/test_a.py"]
    support = set(manifest["support_files"])
    # conftest, the tests.* modules it and the tests import, package __init__ files
    assert {"tests/unit_tests/conftest.py", "tests/unit_tests/helpers.py", "tests/__init__.py",
            "tests/test_utils/python_scripts/dl.py", "gpt_builders.py"} <= support
    assert "tests/unit_tests/unused_helper.py" not in support
    # megatron packages the sdist lacks, found through the training package and through them
    assert manifest["extra_megatron_packages"] == ["elastic", "rl"]
    assert manifest["third_party_modules"] == ["click", "numpy", "pytest", "yaml_like_dep"]
    for side in ("pristine", "patched"):
        root = out / side
        assert (root / "megatron" / "rl" / "more.py").is_file()
        assert not (root / "megatron" / "unused").exists()
        assert (root / "tests" / "unit_tests" / "moe" / "test_a.py").is_file()
        assert not (root / "tests" / "unit_tests" / "other").exists()
        assert (root / "r3_upstream_plugin.py").is_file()
        assert "internal: a marker upstream declares" in (root / "pytest.ini").read_text()
    assert "SIDE = 'patched'" in (out / "patched" / "megatron" / "core" / "__init__.py").read_text()
    assert "SIDE = 'pristine'" in (out / "pristine" / "megatron" / "core" / "__init__.py").read_text()
    assert manifest["sides"]["patched"]["version"] == "0.19.2+r3"
    assert manifest["sides"]["pristine"]["version"] == "0.19.2"
    # an existing bundle is replaced only with --force
    assert _prepare(upstream, out) == 2
    assert _prepare(upstream, out, "--force") == 0


def test_prepare_refuses_a_tree_without_the_series_and_a_too_large_bundle(upstream, tmp_path):
    repo, sdist, _ = upstream
    not_patched = tmp_path / "not-patched"
    _fake_core(not_patched)
    code = ut.main(["prepare", "--megatron", str(repo), "--sdist", str(sdist), "--patched",
                    str(not_patched), "--out", str(tmp_path / "b1"), "--files", "tests/unit_tests"])
    assert code == 2 and not (tmp_path / "b1").exists()
    assert _prepare(upstream, tmp_path / "b2", "--max-mb", "0.001") == 2
    assert not (tmp_path / "b2").exists()


def test_prepare_takes_tests_from_a_git_history_at_a_tag(upstream, tmp_path):
    repo, sdist, patched = upstream
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "-A"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-qm", "x"], cwd=repo, check=True)
    subprocess.run(git + ["tag", "core_v0.19.0"], cwd=repo, check=True)
    (repo / "tests" / "unit_tests" / "moe" / "test_a.py").write_text("changed after the tag\n")
    out = tmp_path / "bundle"
    code = ut.main(["prepare", "--megatron", str(repo / ".git"), "--tag", "core_v0.19.0",
                    "--sdist", str(sdist), "--patched", str(patched), "--out", str(out),
                    "--files", "tests/unit_tests/moe/"])
    assert code == 0
    text = (out / "patched" / "tests" / "unit_tests" / "moe" / "test_a.py").read_text()
    assert "def test_hang" in text
    assert "core_v0.19.0" in json.loads((out / "manifest.json").read_text())["source"]


def test_prepare_says_where_to_put_a_checkout(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ut, "CHECKOUT_CANDIDATES", (tmp_path / "nothing-here",))
    assert ut.main(["prepare", "--sdist", str(tmp_path / "x.tar.gz"), "--out",
                    str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "no Megatron-LM checkout found" in err and str(tmp_path / "nothing-here") in err


def test_run_names_a_hung_test_goes_on_after_it_and_compares(upstream, tmp_path):
    out = tmp_path / "bundle"
    assert _prepare(upstream, out) == 0
    results = tmp_path / "results"
    export = tmp_path / "export"
    code = ut.main(["run", "--bundle", str(out), "--out", str(results), "--launcher", "plain",
                    "--tests", "tests/unit_tests/moe/", "--timeout", "1", "--grace", "1",
                    "--side-timeout", "60", "--export", str(export)])
    assert code == 1  # the sides differ
    table = json.loads((results / "comparison.json").read_text())
    rows = {r["id"].split("::")[-1]: r for r in table["rows"]}
    assert (rows["test_pass"]["pristine"], rows["test_pass"]["patched"]) == ("passed", "passed")
    assert rows["test_side_dependent"]["patched"] == "failed"
    assert "only the pristine side passes" in rows["test_side_dependent"]["patched_message"]
    assert rows["test_skip"]["pristine"] == rows["test_skip"]["patched"] == "skipped"
    assert rows["test_hang"]["pristine"] == "passed"
    # the pure-Python sleep is interrupted by pytest-timeout where it is installed; the
    # watchdog ends the rank otherwise: either way the hang has the test's name
    assert rows["test_hang"]["patched"] in ("failed", "timeout")
    # the test after the hang still ran on the patched side
    assert rows["test_after_hang"]["patched"] == "passed"
    # differences first, regressions (pristine passed) on top
    order = [r["id"].split("::")[-1] for r in table["rows"]]
    assert set(order[:2]) == {"test_side_dependent", "test_hang"}
    md = (results / "comparison.md").read_text()
    assert "2 tests differ." in md and "| test | pristine | patched |" in md
    # junit per rank and attempt, the rank filled in by the plugin; the watchdog's end of a rank
    # starts a second attempt, pytest-timeout's failure does not
    last_attempt = 1 if rows["test_hang"]["patched"] == "timeout" else 0
    assert (results / "patched" / f"junit-attempt{last_attempt}-rank0.xml").is_file()
    assert (results / "pristine" / "junit-attempt0-rank0.xml").is_file()
    assert sorted(p.name for p in export.iterdir()) == [
        "comparison.json", "comparison.md", "upstream-tests-results.tar.gz"]
    assert table["meta"]["stubbed_modules"] == ["click"] or "click" not in table["meta"][
        "missing_modules"]


def test_watchdog_ends_a_rank_stuck_outside_python_and_resume_skips_it(upstream, tmp_path):
    out = tmp_path / "bundle"
    assert _prepare(upstream, out) == 0
    test_file = out / "patched" / "tests" / "unit_tests" / "moe" / "test_a.py"
    # a hang pytest-timeout's signal cannot interrupt: blocked in C with signals ignored
    test_file.write_text(test_file.read_text().replace(
        "time.sleep(60)",
        "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM]); "
        "time.sleep(60)"))
    results = tmp_path / "results"
    code = ut.main(["run", "--bundle", str(out), "--out", str(results), "--launcher", "plain",
                    "--sides", "patched", "--tests", "tests/unit_tests/moe/", "--timeout", "1",
                    "--grace", "1", "--side-timeout", "60"])
    assert code == 1
    side = ut.load_side(results / "patched")
    by_name = {v["id"].split("::")[-1]: v["outcome"] for v in side.values()}
    assert by_name["test_hang"] == "timeout"
    assert by_name["test_after_hang"] == "passed"
    assert by_name["test_pass"] == "passed"
    assert (results / "patched" / "attempt1.log").is_file()
    assert "still running after" in (results / "patched" / "attempt0.log").read_text()
    stacks = (results / "patched" / "results" / "timeout-rank0-attempt0.txt").read_text()
    assert "test_hang still running after 2 s" in stacks and "test_a.py" in stacks


def _junit(path, cases):
    items = []
    for classname, name, seconds, kind in cases:
        body = {"passed": "", "failed": '<failure message="boom">x</failure>',
                "error": '<error message="setup broke">x</error>',
                "skipped": '<skipped type="pytest.skip" message="no TE">x</skipped>',
                "xfailed": '<skipped type="pytest.xfail" message="known">x</skipped>'}[kind]
        items.append(f'<testcase classname="{classname}" name="{name}" time="{seconds}">'
                     f'{body}</testcase>')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                    + "".join(items) + "</testsuite></testsuites>")


def test_compare_on_crafted_junit_files(tmp_path):
    mod = "tests.unit_tests.moe.test_x"
    _junit(tmp_path / "pristine" / "junit-attempt0-rank0.xml", [
        (mod, "test_ok", 1.0, "passed"), (mod + ".TestR", "test_reg[a]", 2.0, "passed"),
        (mod, "test_fixed", 0.5, "failed"), (mod, "test_te", 0.0, "skipped"),
        (mod, "test_gone", 0.1, "passed")])
    _junit(tmp_path / "pristine" / "junit-attempt0-rank1.xml", [
        (mod, "test_ok", 1.5, "passed"), (mod + ".TestR", "test_reg[a]", 2.0, "passed"),
        (mod, "test_fixed", 0.5, "failed"), (mod, "test_te", 0.0, "skipped"),
        (mod, "test_gone", 0.1, "passed")])
    _junit(tmp_path / "patched" / "junit-attempt0-rank0.xml", [
        (mod, "test_ok", 3.0, "passed"), (mod + ".TestR", "test_reg[a]", 2.0, "passed"),
        (mod, "test_fixed", 0.4, "passed"), (mod, "test_te", 0.0, "skipped"),
        (mod, "test_new", 0.1, "xfailed")])
    # one rank failing is enough: the test failed
    _junit(tmp_path / "patched" / "junit-attempt0-rank1.xml", [
        (mod, "test_ok", 3.0, "passed"), (mod + ".TestR", "test_reg[a]", 2.5, "failed"),
        (mod, "test_fixed", 0.4, "passed"), (mod, "test_te", 0.0, "skipped")])
    assert ut.main(["compare", str(tmp_path)]) == 1
    table = json.loads((tmp_path / "comparison.json").read_text())
    rows = [(r["id"], r["pristine"], r["patched"], r["pristine_s"], r["patched_s"])
            for r in table["rows"]]
    assert rows[0] == (mod + ".TestR::test_reg[a]", "passed", "failed", 2.0, 2.5)
    assert rows[1] == (mod + "::test_gone", "passed", "absent", 0.1, None)
    assert {r[0] for r in rows[2:4]} == {mod + "::test_fixed", mod + "::test_new"}
    assert rows[4:] == [(mod + "::test_ok", "passed", "passed", 1.5, 3.0),
                        (mod + "::test_te", "skipped", "skipped", 0.0, 0.0)]
    assert table["counts"]["pristine"] == {"failed": 1, "passed": 3, "skipped": 1}
    assert table["counts"]["patched"] == {"failed": 1, "passed": 2, "xfailed": 1, "skipped": 1}
    assert table["rows"][0]["patched_message"] == "boom"
    md = (tmp_path / "comparison.md").read_text()
    assert "4 tests differ." in md
    assert f"| `{mod}.TestR::test_reg[a]` | **passed** | **failed** | 2.00 | 2.50 |" in md


def test_nodeid_and_junit_keys_agree():
    assert ut.nodeid_key("tests/unit_tests/moe/test_x.py::TestR::test_reg[a-b]") == \
        "tests.unit_tests.moe.test_x.TestR::test_reg[a-b]"
    assert ut.nodeid_key("tests/unit_tests/test_y.py::test_f") == "tests.unit_tests.test_y::test_f"


def test_a_rank_killed_mid_test_reads_as_crashed(tmp_path):
    results = tmp_path / "side" / "results"
    results.mkdir(parents=True)
    nid = "tests/unit_tests/moe/test_x.py::test_"
    lines = [
        {"event": "session", "attempt": 0},
        {"event": "start", "nodeid": nid + "a"}, {"event": "end", "nodeid": nid + "a",
                                                  "outcome": "passed", "seconds": 1.0},
        {"event": "start", "nodeid": nid + "b"},
        {"event": "session", "attempt": 1},
        {"event": "start", "nodeid": nid + "c"},
    ]
    (results / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"ev')
    (results / "collected-0.json").write_text(json.dumps([nid + x for x in "abcd"]))
    side = ut.load_side(tmp_path / "side")
    outcome = {v["id"][-1]: v["outcome"] for v in side.values()}
    assert outcome == {"a": "passed", "b": "crashed", "c": "crashed", "d": "not run"}


def test_a_rank_torchrun_stopped_did_not_crash_its_test(tmp_path):
    """Rank 1 dies in b; torchrun stops rank 0, which had gone on to c: b crashed, c runs again."""
    results = tmp_path / "side" / "results"
    results.mkdir(parents=True)
    nid = "tests/unit_tests/moe/test_x.py::test_"

    def ran(*names):
        return [r for n in names for r in ({"event": "start", "nodeid": nid + n},
                                          {"event": "end", "nodeid": nid + n, "outcome": "passed"})]

    first = {0: [{"event": "session", "attempt": 0}, *ran("a", "b"), {"event": "start", "nodeid": nid + "c"},
                 {"event": "terminated"}],
             1: [{"event": "session", "attempt": 0}, *ran("a"), {"event": "start", "nodeid": nid + "b"}]}
    for rank, lines in first.items():
        (results / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert ut.finished_ids(results, nproc=2) == ({nid + "a"}, {nid + "b"})
    assert not ut._session_ended(results, 0, nproc=2)
    for rank in first:  # the next attempt, past a and b
        with open(results / f"rank{rank}.jsonl", "a") as handle:
            for line in [{"event": "session", "attempt": 1}, *ran("c"), {"event": "session_end"}]:
                handle.write(json.dumps(line) + "\n")
    assert ut.finished_ids(results, nproc=2) == ({nid + "a", nid + "c"}, {nid + "b"})
    assert ut._session_ended(results, 1, nproc=2)
    outcome = {v["id"][-1]: v["outcome"] for v in ut.load_side(tmp_path / "side").values()}
    assert outcome == {"a": "passed", "b": "crashed", "c": "passed"}


def test_a_node_id_relative_to_a_folder_above_the_side_names_the_same_test():
    """pytest may make node ids relative to a rootdir above the bundle (the checkout's own
    pytest.ini): the side's folder in them must not make every test differ."""
    from upstream_tests import nodeid_key

    plain = "tests/unit_tests/transformer/moe/test_routers.py::TestTop2Router::test_forward[1]"
    assert nodeid_key("build/upstream-tests/pristine/" + plain) == nodeid_key(plain)
    assert nodeid_key("build/upstream-tests/patched/" + plain) == nodeid_key(plain)


def test_a_file_that_does_not_import_is_named_with_its_error(upstream, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert _prepare(upstream, out) == 0
    broken = out / "patched" / "tests" / "unit_tests" / "moe" / "test_a.py"
    broken.write_text("from megatron.core import NOT_THERE\n\ndef test_b():\n    pass\n")
    code = ut.main(["run", "--bundle", str(out), "--out", str(tmp_path / "results"),
                    "--launcher", "plain", "--sides", "patched", "--tests", "tests/unit_tests/moe/",
                    "--timeout", "5", "--grace", "1", "--side-timeout", "60"])
    assert code == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "COLLECTION ERROR" in line]
    assert len(lines) == 1
    assert "tests/unit_tests/moe/test_a.py" in lines[0] and "NOT_THERE" in lines[0]


@pytest.mark.parametrize("params,needed", [
    ({}, None), ({"permute_fusion": True}, None), ({"tp_size": 1, "ep_size": 1}, 1),
    ({"tp_size": 1, "ep_size": 8}, 8), ({"tp_size": 4, "ep_size": 2}, 8), ({"tp_size": 8, "ep_size": 1}, 8),
    ({"tp_size": 2, "ep_size": 2, "moe_tp_size": 1}, 2), ({"tp_size": 2, "pp_size": 2}, 4),
    ({"ep_size": 3, "tp_size": 2}, 6),
    # tuples named by their parts, a checkpoint's source and destination layouts both
    ({"tp_pp_ep": (2, 2, 1), "is_moe": False}, 4), ({"tp_pp": (1, 1)}, 1),
    ({"src_tp_pp": (2, 4), "dest_tp_pp": (4, 1)}, 8), ({"src_tp_pp_exp": (1, 1, 4), "dest_tp_pp_exp": (2, 1, 1)}, 4),
    ({"src_tp_pp_ep_etp": (2, 1, 2, 1), "dest_tp_pp_ep_etp": (1, 1, 1, 1)}, 2),
    ({"tp_pp": (2, 2, 2)}, None), ({"step_size": (2, 2)}, None),  # not a layout: lengths or names differ
])
def test_ranks_needed_by_a_tests_parallel_sizes(params, needed):
    assert _load("r3_plugin", ut.PLUGIN_SOURCE).ranks_needed(params) == needed


def test_tests_the_world_cannot_hold_are_not_run_unless_asked(upstream, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert _prepare(upstream, out) == 0
    sized = textwrap.dedent("""\
        import pytest

        @pytest.mark.parametrize("tp_size,ep_size", [(1, 1), (2, 1), (1, 8)])
        def test_sized(tp_size, ep_size):
            assert tp_size * ep_size == 1
        """)
    (out / "patched" / "tests" / "unit_tests" / "moe" / "test_a.py").write_text(sized)
    run = ["run", "--bundle", str(out), "--launcher", "plain", "--sides", "patched",
           "--tests", "tests/unit_tests/moe/", "--timeout", "5", "--grace", "1", "--side-timeout", "60"]
    ut.main(run + ["--out", str(tmp_path / "fit")])
    ran = {v["id"].split("::")[-1]: v["outcome"] for v in ut.load_side(tmp_path / "fit" / "patched").values()}
    assert ran == {"test_sized[1-1]": "passed"}
    assert "2 tests need more ranks than the world of 1" in capsys.readouterr().out
    ut.main(run + ["--out", str(tmp_path / "all"), "--all-sizes"])
    ran = {v["id"].split("::")[-1]: v["outcome"] for v in ut.load_side(tmp_path / "all" / "patched").values()}
    assert ran == {"test_sized[1-1]": "passed", "test_sized[2-1]": "failed", "test_sized[1-8]": "failed"}


SERIES_TEST = "tests/unit_tests/moe/test_series.py"


def _with_series_test(tree):
    """The series' own test in a patched tree: it passes only on the patched core."""
    _write(tree / SERIES_TEST, """\
        from megatron.core import SIDE
        from tests.unit_tests.helpers import X


        def test_needs_the_series():
            assert SIDE == "patched" and X == 1
        """)


@pytest.fixture
def series_bundle(upstream, tmp_path, monkeypatch):
    """A 0.19 bundle prepared with the series' own test in the patched tree."""
    _with_series_test(upstream[2])
    monkeypatch.setattr(ut, "series_tests", lambda base, prs=None: [SERIES_TEST])
    out = tmp_path / "bundle"
    assert _prepare(upstream, out, "--lists", "series") == 0
    return out


def test_prepare_puts_the_series_tests_into_both_sides(upstream, series_bundle, tmp_path):
    repo, sdist, patched = upstream
    out = series_bundle
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["series_tests"] == [SERIES_TEST] and manifest["base"] == "0.19"
    assert SERIES_TEST in manifest["test_files"]
    assert "tests/unit_tests/helpers.py" in manifest["support_files"]  # its imports are followed
    for side in ("pristine", "patched"):
        assert (out / side / SERIES_TEST).read_text() == (patched / SERIES_TEST).read_text()
    # A patched tree without the series' tests is refused.
    (patched / SERIES_TEST).unlink()
    assert _prepare(upstream, tmp_path / "b2", "--lists", "series") == 2


def test_the_series_tests_are_expected_to_fail_on_pristine_only(series_bundle, tmp_path):
    out = series_bundle
    (out / "pristine" / "tests" / "unit_tests" / "moe" / "test_a.py").unlink()
    (out / "patched" / "tests" / "unit_tests" / "moe" / "test_a.py").unlink()
    run = ["run", "--bundle", str(out), "--launcher", "plain", "--lists", "series",
           "--timeout", "5", "--grace", "1", "--side-timeout", "60"]
    assert ut.main(run + ["--out", str(tmp_path / "r1")]) == 0  # failing on pristine is expected
    table = json.loads((tmp_path / "r1" / "comparison.json").read_text())
    (row,) = table["series_rows"]
    assert (row["pristine"], row["patched"]) == ("failed", "passed")
    assert row["verdict"] == "expected: needs the series" and table["rows"] == []
    md = (tmp_path / "r1" / "comparison.md").read_text()
    assert "## The series' own tests" in md and "0 of 1 fail on the patched core." in md
    # A series test that fails on the patched core fails the run.
    test = out / "patched" / SERIES_TEST
    test.write_text(test.read_text().replace('SIDE == "patched"', 'SIDE == "neither"'))
    assert ut.main(run + ["--out", str(tmp_path / "r2")]) == 1
    table = json.loads((tmp_path / "r2" / "comparison.json").read_text())
    assert table["series_rows"][0]["verdict"] == "FAILS on the patched core"
    assert not table["ok"] and table["counts_equal"]


def test_prepare_main_takes_core_and_tests_from_the_pinned_commit(upstream, tmp_path, monkeypatch):
    """The main base: both sides' megatron/ come from Megatron-LM main at the pinned commit, the
    patched one with the main form applied; another commit is refused."""
    repo, _, _ = upstream
    (repo / "megatron" / "core" / "package_info.py").write_text(
        PACKAGE_INFO.replace("19", "20").replace("PATCH = 2", "PATCH = 0").format(""))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "-A"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-qm", "main"], cwd=repo, check=True)
    pinned = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                            text=True).stdout.strip()
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "later"], cwd=repo, check=True)
    monkeypatch.setattr(ut.patch_series, "MAIN_COMMIT", pinned)
    monkeypatch.setitem(ut.DEFAULT_REVS, "main", pinned)

    def apply_main_form(tree, prs=None):  # stands in for patch_series.apply_series on main
        core = Path(tree) / "megatron" / "core" / "__init__.py"
        core.write_text(core.read_text().replace("'pristine'", "'patched'"))
        _with_series_test(Path(tree))

    monkeypatch.setattr(ut.patch_series, "apply_series", apply_main_form)
    monkeypatch.setattr(ut.patch_series, "form_files", lambda base, prs=None: [Path("last.diff")])
    monkeypatch.setattr(ut.patch_series, "series_digest", lambda: "digest")
    monkeypatch.setattr(ut.patch_series, "has_patch",
                        lambda tree, path: "'patched'" in (Path(tree) / "megatron/core/__init__.py")
                        .read_text())
    monkeypatch.setattr(ut, "series_tests", lambda base, prs=None: [SERIES_TEST])
    out = tmp_path / "bundle-main"
    code = ut.main(["prepare", "--base", "main", "--megatron", str(repo), "--out", str(out),
                    "--lists", "series", "--files", "tests/unit_tests/moe/test_a.py"])
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["base"] == "main" and manifest["source_commit"] == pinned
    assert manifest["sides"]["pristine"]["version"] == "0.20.0"
    assert "SIDE = 'patched'" in (out / "patched/megatron/core/__init__.py").read_text()
    assert "SIDE = 'pristine'" in (out / "pristine/megatron/core/__init__.py").read_text()
    for side in ("pristine", "patched"):
        # the whole megatron/ of main travels; nothing is taken from an sdist
        assert (out / side / "megatron" / "rl" / "more.py").is_file()
        assert (out / side / SERIES_TEST).is_file()
    assert manifest["extra_megatron_packages"] == []
    code = ut.main(["prepare", "--base", "main", "--megatron", str(repo), "--tag", "HEAD",
                    "--out", str(tmp_path / "b2"), "--lists", "series"])
    assert code == 2 and not (tmp_path / "b2").exists()


def test_pull_requests_are_of_the_main_base_and_named_in_the_series(tmp_path, capsys):
    """`prepare --pull-requests` builds main's patched side from patches/: another base, a tree of
    one's own or a name patches/series does not list is refused in one line, and nothing is built."""
    out = tmp_path / "bundle"
    cases = [(["--base", "0.19", "--pull-requests", "fixes"], "give --base main and no --patched"),
             (["--base", "main", "--patched", str(tmp_path), "--pull-requests", "fixes"], "no --patched"),
             (["--base", "main", "--pull-requests", "fixes", "routing_replay"],
              "no pull request ['routing_replay'] in patches/series (it lists fixes, non-replay, ")]
    for argv, says in cases:
        assert ut.main(["prepare", *argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_a_series_file_that_imports_only_on_the_patched_core_counts_as_collected_there():
    # As on 2 x H200 (2026-11-28): test_moe_routing.py fails at import on pristine, one row keyed by its
    # module; on patched its tests (plain and in a class) are rows of their own.
    module = "tests.unit_tests.transformer.moe.test_moe_routing"
    pristine = {module: {"id": "tests/unit_tests/transformer/moe/test_moe_routing.py", "outcome": "error",
                         "seconds": 0.0, "message": "collection failure"}}
    patched = {f"{module}::test_a": {"id": f"{module}::test_a", "outcome": "passed", "seconds": 1.0, "message": ""},
               f"{module}.TestB::test_b": {"id": f"{module}.TestB::test_b", "outcome": "failed", "seconds": 1.0,
                                            "message": ""}}
    series = ["tests/unit_tests/transformer/moe/test_moe_routing.py"]
    upstream, own = ut.split_series(ut.compare(pristine, patched), series)
    outcomes = {row["key"]: (row["pristine"], row["patched"], row["verdict"]) for row in own}
    assert upstream == []
    assert outcomes[module] == ("error", "collected", "expected: needs the series")
    assert outcomes[f"{module}::test_a"] == ("absent", "passed", "expected: needs the series")
    assert outcomes[f"{module}.TestB::test_b"] == ("absent", "failed", "FAILS on the patched core")
    # A file absent from a side altogether stays absent there.
    upstream, own = ut.split_series(ut.compare(pristine, {}), series)
    assert [(row["patched"], row["verdict"]) for row in own] == [("absent", "FAILS on the patched core")]
