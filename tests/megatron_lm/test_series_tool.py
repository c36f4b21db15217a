"""tools/megatron_lm_series.py on this repository's series (no Megatron-LM checkout needed)."""

import re
import sys

import pytest

from tests.support.megatron_lm import _series_tool

tool = _series_tool()


def test_the_series_has_headers_and_touches_the_rl_loop_and_the_engine_ledger():
    files = tool.series_files()
    touched = tool.touched_files(files)
    assert {"megatron/rl/routing_replay.py", "megatron/rl/rl_utils.py", "train_rl.py",
            "megatron/core/inference/inference_request.py"} <= set(touched)
    for path in files:  # each says why and what; the ones that hand the engine's routes on link the issue
        header = path.read_text().split("\n---\n", 1)[0]
        assert "\nWhy: " in header and "\nWhat: " in header, path.name
        carries_routes = {"megatron/rl/routing_replay.py", "megatron/core/inference/inference_request.py"}
        if carries_routes & set(tool.touched_files([path])):
            assert "Link: https://github.com/NVIDIA/Megatron-LM/issues/4168" in header, path.name


def test_every_timer_the_series_adds_is_one_megatron_logs():
    # Megatron-LM logs only the RL timers rl_profiling.RL_LOGGABLE_TIMER_NAMES lists (training.py's
    # timers_to_log): a pass timed under a new name and not listed there is timed and never logged.
    diff = "".join(path.read_text() for path in tool.series_files())
    added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    kept = [line for line in diff.splitlines() if not line.startswith("+")]
    timed = set(re.findall(r'nvtx_range\("([^"]+)", time=True', "\n".join(added)))
    new = {name for name in timed if not any(f'"{name}"' in line for line in kept)}
    assert "rl/compute-live-logprobs" in new
    assert "diff --git a/megatron/rl/rl_profiling.py" in diff, "the series leaves the list of logged RL timers alone"
    profiling = diff.split("diff --git a/megatron/rl/rl_profiling.py")[1].split("diff --git")[0]
    for name in new:
        assert f'+    "{name}",' in profiling, f"{name} is timed and not in RL_LOGGABLE_TIMER_NAMES"
    # in the logged list, beside the pass it is paired with (the hierarchy indents by 8, the summary by 12)
    assert ('     "rl/compute-old-logprobs",\n+    "rl/compute-live-logprobs",\n     "rl/compute-ref-logprobs",'
            in profiling)


def test_extract_refuses_a_file_the_series_only_changes(tmp_path):
    with pytest.raises(tool.SeriesError, match="does not create train_rl.py"):
        tool.extract("train_rl.py", tmp_path)


def test_apply_refuses_a_tree_that_is_no_megatron_lm_main_checkout(tmp_path, capsys):
    info = tmp_path / "megatron/core/package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 19\nPATCH = 2\n")
    with pytest.raises(tool.SeriesError, match="not a Megatron-LM main checkout"):
        tool.apply_series(tmp_path)
    tool.apply_series(tmp_path, only_main=True)  # make patch on a 0.19 tree: said, not applied
    assert "made on main only, not applied" in capsys.readouterr().out


def _rl_tree(root, tests):
    """A tree with tests/unit_tests/rl/test_rl.py holding ``tests`` (name -> body), and the megatron.core
    package the runner checks is the tree's own."""
    path = root / "tests" / "unit_tests" / "rl" / "test_rl.py"
    path.parent.mkdir(parents=True)
    path.write_text("import pytest\n\n" + "".join(f"def {name}():\n    {body}\n\n" for name, body in tests.items()))
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text("__version__ = '0.0.0'\n")
    return root


COMMON = {"test_passes": "pass", "test_fails": "assert False", "test_skips": "pytest.skip('no GPU')"}


def test_compare_rl_tests_reports_what_the_series_adds_and_changes(tmp_path, capsys):
    # A pytest configuration above both trees would make it the root of both runs, and every test's name
    # would differ by its tree's folder: each tree is its own root.
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    pristine = _rl_tree(tmp_path / "pristine", COMMON)
    patched = _rl_tree(tmp_path / "patched", {**COMMON, "test_fails": "pass", "test_added": "pass"})
    tool.compare_rl_tests(sys.executable, pristine, patched)
    out = capsys.readouterr().out
    assert "pristine: 1 passed, 1 failed, 0 error, 1 skipped\n" in out
    assert "patched: 3 passed, 0 failed, 0 error, 1 skipped\n" in out
    assert "test_rl::test_added: pristine absent, patched passed\n" in out  # nothing to run alone in pristine
    assert "test_rl::test_fails: pristine failed, patched passed; alone: pristine failed, patched passed\n" in out
    assert "ok  2 tests differ, none passing pristine only; run alone, 0 of 1 have the same outcome" in out


@pytest.mark.parametrize("change", [{"test_passes": "assert False"}, {"test_passes": "pytest.skip('x')"}])
def test_compare_rl_tests_refuses_a_test_that_passes_only_pristine(change, tmp_path):
    pristine = _rl_tree(tmp_path / "pristine", COMMON)
    patched = _rl_tree(tmp_path / "patched", {**COMMON, **change})
    with pytest.raises(tool.SeriesError, match=r"1 tests pass pristine and not patched, first \[.*test_passes"):
        tool.compare_rl_tests(sys.executable, pristine, patched)


def test_compare_rl_tests_on_two_ranks_takes_each_tests_worst_rank(tmp_path, capsys):
    """Under torch.distributed.run every rank runs every test: one that fails on rank 1 only has failed."""
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    on_two = "import os; assert os.environ['WORLD_SIZE'] == '2'"
    pristine = _rl_tree(tmp_path / "pristine", {**COMMON, "test_two_ranks": on_two})
    not_on_rank_1 = "import os; assert os.environ['RANK'] != '1'"
    patched = _rl_tree(tmp_path / "patched", {**COMMON, "test_two_ranks": not_on_rank_1})
    with pytest.raises(tool.SeriesError, match=r"1 tests pass pristine and not patched, first \[.*test_two_ranks"):
        tool.compare_rl_tests(sys.executable, pristine, patched, nproc=2)
    out = capsys.readouterr().out
    assert "pristine: 2 passed, 1 failed, 0 error, 1 skipped\n" in out
    assert "patched: 1 passed, 2 failed, 0 error, 1 skipped\n" in out
    with pytest.raises(tool.SeriesError, match="--nproc 0"):
        tool.compare_rl_tests(sys.executable, pristine, patched, nproc=0)


def test_compare_rl_tests_goes_on_after_a_test_that_kills_its_rank(tmp_path, capsys):
    """A device-side assert aborts the process of the rank it hits: that test is crashed, on the side it
    crashed on only, and the tests after it still run (here on rank 1 of 2, as on 2 x H200)."""
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    abort_on_rank_1 = "import os, signal; os.environ['RANK'] == '1' and os.kill(os.getpid(), signal.SIGABRT)"
    tests = {"test_a_first": "pass", "test_b_aborts": abort_on_rank_1, "test_c_after": "pass"}
    pristine = _rl_tree(tmp_path / "pristine", tests)
    patched = _rl_tree(tmp_path / "patched", {**tests, "test_b_aborts": "pass"})
    tool.compare_rl_tests(sys.executable, pristine, patched, nproc=2, out=tmp_path / "records")
    out = capsys.readouterr().out
    assert "pristine: 2 passed, 0 failed, 0 error, 0 skipped, 1 crashed\n" in out
    assert "patched: 3 passed, 0 failed, 0 error, 0 skipped\n" in out
    assert "test_rl::test_b_aborts: pristine crashed, patched passed; alone: pristine crashed, patched passed" in out
    assert "ok  1 tests differ" in out
    assert len(list((tmp_path / "records" / "pristine").glob("attempt*.log"))) == 2  # a launch after the crash
    assert (tmp_path / "records" / "pristine-alone-0" / "attempt0.log").exists()
    assert not (pristine / "r3_upstream_plugin.py").exists()  # the runner's plugin leaves the tree with the run
    with pytest.raises(tool.SeriesError, match="exists: give a new folder"):
        tool.compare_rl_tests(sys.executable, pristine, patched, out=tmp_path / "records")


def test_compare_rl_tests_runs_each_test_that_differs_alone(tmp_path, capsys):
    """As on 2 x H200: a pristine test hits a device-side assert that surfaces as its failure, and the test
    after it in the same process meets the broken CUDA context and fails too; patched, the same assert aborts
    the process and the next launch runs the test after it clean. Run alone, the second test passes in both
    trees, and the first differs only in how the same assert ends it."""
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    after = "import os; assert 'BROKEN' not in os.environ"
    breaks = "import os; os.environ['BROKEN'] = '1'; assert False"
    aborts = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    pristine = _rl_tree(tmp_path / "pristine", {"test_a_breaks": breaks, "test_b_after": after})
    patched = _rl_tree(tmp_path / "patched", {"test_a_breaks": aborts, "test_b_after": after})
    tool.compare_rl_tests(sys.executable, pristine, patched)
    out = capsys.readouterr().out
    assert "test_rl::test_a_breaks: pristine failed, patched crashed; alone: pristine failed, patched crashed\n" in out
    assert "test_rl::test_b_after: pristine failed, patched passed; alone: pristine passed, patched passed\n" in out
    assert "ok  2 tests differ, none passing pristine only; run alone, 1 of 2 have the same outcome in both trees" in out


def test_compare_rl_tests_refuses_a_test_the_patched_tree_loses(tmp_path):
    pristine = _rl_tree(tmp_path / "pristine", COMMON)
    patched = _rl_tree(tmp_path / "patched", {k: v for k, v in COMMON.items() if k != "test_passes"})
    with pytest.raises(tool.SeriesError, match="test_passes"):
        tool.compare_rl_tests(sys.executable, pristine, patched)
