"""The patch tooling: pull requests with a form per base, checked with git am, applied to the
base a checkout is, refused for an unknown base or a patched tree."""

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = [sys.executable, str(ROOT / "tools" / "patch_series.py")]

import patch_series  # noqa: E402  (tools/ is on sys.path: conftest)


def run_tool(*args):
    return subprocess.run([*TOOL, *args], capture_output=True, text=True)


def git(tree, *args):
    ident = ["-c", "user.name=T Tester", "-c", "user.email=t@example.com"]
    return subprocess.run(["git", *ident, *args], cwd=tree, check=True, capture_output=True,
                          text=True).stdout


def git_checkout(sdist, dest):
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (tree,) = Path(dest).iterdir()
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "base")
    return tree


def install_form():
    return patch_series.form_files(patch_series.BASES[patch_series.INSTALL_BASE])


# The real series on the pinned sdist.


def test_every_pull_request_and_the_stack_apply_with_git_am(megatron_sdist):
    proc = run_tool("check", megatron_sdist)
    assert proc.returncode == 0, proc.stderr
    for pr in patch_series.pull_requests():
        assert f"ok  {pr.name} (" in proc.stdout
    assert all(f"ok  {patch_series.label(p)}" in proc.stdout
               for p in install_form() + patch_series.cpu_files())
    assert "main: NOT CHECKED (no Megatron-LM checkout of it given" in proc.stdout


def test_every_patch_is_signed_off_and_no_header_names_tests_outside_it():
    for pr in patch_series.pull_requests():
        for base in patch_series.BASES.values():
            for path in patch_series.pr_files(pr, base):
                head = path.read_text().split("\n---\n", 1)[0]
                assert "\nSigned-off-by: " in head, path
                assert "the project's" not in head, path


def test_apply_to_checkout_then_refuse_second_time(megatron_sdist, tmp_path):
    tree = git_checkout(megatron_sdist, tmp_path)
    first = run_tool("apply", str(tree))
    assert first.returncode == 0, first.stderr
    assert "(0.19 form)" in first.stdout
    changed = git(tree, "diff", "--name-only")
    assert "megatron/core/transformer/moe/router.py" in changed
    second = run_tool("apply", str(tree))
    assert second.returncode == 1
    assert "already has the megatron-r3 series applied" in second.stderr


def test_git_am_of_each_pull_request_in_series_order(megatron_sdist, tmp_path):
    """What a maintainer does: `git am patches/<pr>/0.19/*.diff`, pull request by pull request
    (the shell's name order is each series' order)."""
    tree = git_checkout(megatron_sdist, tmp_path)
    for pr in patch_series.pull_requests():
        folder = ROOT / "patches" / pr.name / "0.19"
        diffs = sorted(folder.glob("*.diff"))
        assert [d.name for d in diffs] == (folder / "series").read_text().split()
        git(tree, "am", "-q", *map(str, diffs))
    assert run_tool("apply", str(tree)).returncode == 1  # and the tool sees the series applied


def test_an_unknown_base_is_refused_naming_the_supported_ones(megatron_sdist, tmp_path):
    tree = git_checkout(megatron_sdist, tmp_path)
    info = tree / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 19", "MINOR = 16").replace("PATCH = 2", "PATCH = 1"))
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1
    assert "Megatron-Core 0.16.1, which the series has no form for" in proc.stderr
    assert "0.19.2 (the megatron-core 0.19.2 release" in proc.stderr
    assert "core_v0.19.0" in proc.stderr and "0.20.0 (Megatron-LM main at d98e8a64dd" in proc.stderr
    assert git(tree, "diff", "--name-only", "--", "megatron/core/transformer") == ""


def test_refuse_a_tree_that_is_not_megatron(tmp_path):
    proc = run_tool("apply", str(tmp_path))
    assert proc.returncode == 1 and "not a Megatron-LM checkout" in proc.stderr


def test_installed_megatron_is_the_patched_fork():
    import importlib.metadata

    import megatron.core
    from packaging.version import Version

    assert importlib.metadata.version("megatron-core") == "0.19.2+r3"
    # At run time package_info adds the commit of a git checkout around the venv (this one's, or
    # none in a plain venv): a valid version either way, as Megatron's experimental decorators parse
    # it (0.19.2+r3+<commit> broke Megatron-LM's test_utils.py, and so its test_optimizer.py).
    version = Version(megatron.core.__version__)
    assert version.public == "0.19.2" and version.local.split(".")[0] == "r3"
    from megatron.core.transformer.moe import moe_routing, paged_stash

    # The replay patches are in, and Megatron imports without Triton (the kernels load lazily).
    assert hasattr(moe_routing, "MoERouting")
    assert not hasattr(paged_stash, "paged_stash_copy_kernel")


def test_a_late_conflict_leaves_the_tree_untouched(megatron_sdist, tmp_path):
    tree = git_checkout(megatron_sdist, tmp_path)
    # A local edit to a pristine file that the last patch changes (so do earlier patches, but
    # not the first) must stop the whole series before the first patch is written.
    touched = [part.split()[0] for part in install_form()[-1].read_text().split("diff --git a/")[1:]]
    target = next(path for path in touched if (tree / path).is_file())
    (tree / target).write_text("# a local change the series does not expect\n")
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1 and "does not apply" in proc.stderr
    assert git(tree, "diff", "--name-only").split() == [target]


# Synthetic bases: a Megatron-LM history with a 0.19 tag and a later main, and patches/ of three
# pull requests ('one', 'two', and 'three' that needs 'one') plus the CPU series.

LAYER = "megatron/core/layer.py"


def package_info(version):
    major, minor, patch = version
    return (f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nVERSION = (MAJOR, MINOR, PATCH)\n"
            + patch_series.VERSION_LINE + "\n" + "    " + patch_series.VCS_SUFFIX_LINE + "\n")


def change_line(tree, number, text, subject, cpu=False):
    """Commit one changed line of layer.py, signed off; `cpu` marks the commit for the CPU series,
    an upstream commit carries a test file named in its 'Tests:' paragraph."""
    path = Path(tree) / LAYER
    lines = path.read_text().splitlines(keepends=True)
    lines[number] = text + "\n"
    path.write_text("".join(lines))
    trailer = f"\n{patch_series.SERIES_TRAILER}: {patch_series.CPU_SERIES}\n" if cpu else ""
    tests = ""
    if not cpu:
        test = f"tests/unit_tests/test_{subject.split(': ')[1].replace(' ', '_')}.py"
        (Path(tree) / test).parent.mkdir(parents=True, exist_ok=True)
        (Path(tree) / test).write_text(f"def test_line_{number}():\n    pass\n")
        git(tree, "add", test)
        tests = f"\n\nTests: {test} (new), test_line_{number}."
    git(tree, "commit", "-s", "-qam",
        f"{subject}\n\nWhy: a test needs it.\n\nWhat: line {number}.{tests}\n{trailer}")


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    """{'history', 'sdist', 'main', 'ws019', 'wsmain'}: the history, a 0.19.2 sdist of the tag's
    files, a checkout of main, and one workspace per base, exported to patches/."""
    history = tmp_path / "history"
    (history / "megatron/core").mkdir(parents=True)
    git(history, "init", "-q")
    (history / patch_series.PACKAGE_INFO).write_text(package_info((0, 19, 1)))
    (history / LAYER).write_text("".join(f"line {i}\n" for i in range(30)))
    git(history, "add", "-A")
    git(history, "commit", "-qm", "0.19")
    git(history, "tag", "v0.19")
    (history / patch_series.PACKAGE_INFO).write_text(package_info((0, 20, 0)))
    layer = history / LAYER
    layer.write_text(layer.read_text().replace("line 25\n", "line 25 on main\n"))
    git(history, "commit", "-qam", "main")
    main_commit = git(history, "rev-parse", "HEAD").strip()

    top = tmp_path / "src" / "megatron-core-0.19.2"
    (top / "megatron/core").mkdir(parents=True)
    (top / patch_series.PACKAGE_INFO).write_text(package_info((0, 19, 2)))
    (top / LAYER).write_text(git(history, "show", f"v0.19:{LAYER}"))
    sdist = tmp_path / "megatron_core-0.19.2.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(top, arcname=top.name)

    bases = {
        "0.19": patch_series.Base("0.19", {(0, 19, 2): "the sdist", (0, 19, 1): "the tag"},
                                  commit="v0.19", cpu_series=True),
        "main": patch_series.Base("main", {(0, 20, 0): "main"}, commit=main_commit,
                                  cpu_series=False),
    }
    monkeypatch.setattr(patch_series, "BASES", bases)
    patches = tmp_path / "patches"
    for name in ("one", "two", "three"):
        (patches / name).mkdir(parents=True)
    (patches / "series").write_text("one\ntwo\nthree: one\n")
    monkeypatch.setattr(patch_series, "PATCH_DIR", patches)

    workspaces = {}
    for base, start in (("0.19", "v0.19"), ("main", main_commit)):
        ws = tmp_path / f"ws-{base}"
        subprocess.run(["git", "clone", "-q", str(history), str(ws)], check=True)
        git(ws, "checkout", "-q", "-b", "r3", start)
        git(ws, "tag", "base")
        change_line(ws, 2, "one", "layer: one")
        git(ws, "tag", "pr/one")
        change_line(ws, 10, "two", "layer: two")
        git(ws, "tag", "pr/two")
        change_line(ws, 4, "three after one", "layer: three")
        git(ws, "tag", "pr/three")
        if base == "0.19":
            change_line(ws, 10, "cpu on top of two", "layer: cpu", cpu=True)
        patch_series.export_series(ws, bases[base])
        workspaces[base] = ws
    main = tmp_path / "main-checkout"
    subprocess.run(["git", "clone", "-q", str(history), str(main)], check=True)
    git(main, "checkout", "-q", main_commit)
    return dict(history=history, sdist=sdist, main=main, ws019=workspaces["0.19"],
                wsmain=workspaces["main"])


def test_export_writes_each_pull_request_per_base(synthetic):
    patches = patch_series.PATCH_DIR
    assert (patches / "one/0.19/series").read_text().split() == ["0001-layer-one.diff"]
    assert (patches / "three/main/series").read_text().split() == ["0001-layer-three.diff"]
    assert (patches / "cpu/series").read_text().split() == ["0001-layer-cpu.diff"]
    assert "Series: cpu" in (patches / "cpu/0001-layer-cpu.diff").read_text()
    # Real blob ids: main's form names main's layer.py, the 0.19 form the tag's.
    history = synthetic["history"]
    for base, rev in (("0.19", "v0.19"), ("main", "HEAD")):
        blob = git(history, "rev-parse", f"{rev}:{LAYER}").strip()
        assert f"index {blob[:7]}" in (patches / f"one/{base}/0001-layer-one.diff").read_text()


def test_check_runs_each_pull_request_with_its_prerequisites_and_says_main_was_not_checked(
    synthetic, capsys
):
    patch_series.check_series(synthetic["sdist"])
    out = capsys.readouterr().out
    assert "ok  two (1 patches) on the 0.19 base\n" in out
    assert "ok  three (1 patches) on the 0.19 base with one\n" in out
    assert "ok  cpu/0001-layer-cpu.diff" in out
    assert "main: NOT CHECKED" in out
    patch_series.check_series(synthetic["sdist"], synthetic["main"])
    out = capsys.readouterr().out
    assert "ok  three (1 patches) on the main base with one\n" in out
    assert "main: 3 patches apply with git am to" in out


def test_some_pull_requests_apply_with_their_prerequisites_and_no_other(synthetic):
    """`apply_series(prs=...)` (one pull request's share of the series, tools/upstream_tests.py
    --pull-requests): the pull requests named and their prerequisites, in series order."""
    assert [pr.name for pr in patch_series.with_prerequisites(["three"])] == ["one", "three"]
    assert [pr.name for pr in patch_series.with_prerequisites(["three", "two"])] == ["one", "two", "three"]
    with pytest.raises(patch_series.SeriesError, match=r"no pull request \['four'\] in patches/series "
                                                       r"\(it lists one, two, three\)"):
        patch_series.with_prerequisites(["four"])
    tree = synthetic["main"]
    patch_series.apply_series(tree, prs=["three"])
    lines = (tree / LAYER).read_text().splitlines()
    assert (lines[2], lines[4], lines[10]) == ("one", "three after one", "line 10")
    assert (tree / "tests/unit_tests/test_three.py").is_file()
    assert not (tree / "tests/unit_tests/test_two.py").exists()


def test_check_refuses_a_pull_request_that_needs_an_undeclared_one(synthetic):
    (patch_series.PATCH_DIR / "series").write_text("one\ntwo\nthree\n")
    with pytest.raises(patch_series.SeriesError,
                       match="three/0.19/0001-layer-three.diff does not apply with git am "
                             r"\(three on the 0.19 base\)"):
        patch_series.check_series(synthetic["sdist"])


def test_check_refuses_an_unsigned_or_misfiled_patch(synthetic):
    path = patch_series.PATCH_DIR / "one/0.19/0001-layer-one.diff"
    text = path.read_text()
    path.write_text(text.replace("Signed-off-by:", "Reviewed-by:"))
    with pytest.raises(patch_series.SeriesError, match="0001-layer-one.diff: no 'Signed-off-by:'"):
        patch_series.check_series(synthetic["sdist"])
    path.write_text(text.replace("What: line 2.\n", "What: line 2.\n\nSeries: cpu\n"))
    with pytest.raises(patch_series.SeriesError, match="0001-layer-one.diff: its header has"):
        patch_series.check_series(synthetic["sdist"])
    path.write_text("Subject: [PATCH] bare\n\nno reasons given\n---\n" + text.split("\n---\n", 1)[1])
    with pytest.raises(patch_series.SeriesError, match="Why:"):
        patch_series.check_series(synthetic["sdist"])


def test_check_refuses_an_upstream_patch_without_its_tests(synthetic):
    path = patch_series.PATCH_DIR / "one/0.19/0001-layer-one.diff"
    text = path.read_text()
    test = "tests/unit_tests/test_one.py"
    assert f"Tests: {test} (new)" in text and f"diff --git a/{test} b/{test}" in text
    path.write_text(text.replace(f"\nTests: {test} (new), test_line_2.\n", ""))
    with pytest.raises(patch_series.SeriesError, match="0001-layer-one.diff: no 'Tests:'"):
        patch_series.check_series(synthetic["sdist"])
    path.write_text(text.replace(f"Tests: {test}", "Tests: tests/unit_tests/test_other.py"))
    with pytest.raises(patch_series.SeriesError,
                       match=r"names \['tests/unit_tests/test_other.py'\], which the patch does"):
        patch_series.check_series(synthetic["sdist"])
    path.write_text(text.replace(f"Tests: {test} (new), test_line_2.", "Tests: none."))
    with pytest.raises(patch_series.SeriesError, match="names no tests/...py file"):
        patch_series.check_series(synthetic["sdist"])
    extra = "tests/unit_tests/test_extra.py"
    path.write_text(text + f"diff --git a/{extra} b/{extra}\nnew file mode 100644\n"
                    f"--- /dev/null\n+++ b/{extra}\n@@ -0,0 +1 @@\n+x = 1\n")
    with pytest.raises(patch_series.SeriesError,
                       match=r"changes \['tests/unit_tests/test_extra.py'\], which its 'Tests:'"):
        patch_series.check_series(synthetic["sdist"])


def test_apply_recognises_the_base_of_each_checkout(synthetic, tmp_path):
    main = synthetic["main"]
    patch_series.apply_series(main)
    assert "three after one" in (main / LAYER).read_text()
    assert "line 25 on main" in (main / LAYER).read_text()
    with pytest.raises(patch_series.SeriesError, match="already has the megatron-r3 series"):
        patch_series.apply_series(main)
    tag = tmp_path / "tag"
    subprocess.run(["git", "clone", "-q", str(synthetic["history"]), str(tag)], check=True)
    git(tag, "checkout", "-q", "v0.19")
    with pytest.raises(patch_series.SeriesError, match="the CPU series has a form for the 0.19"):
        patch_series.apply_series(main, cpu=True)
    patch_series.apply_series(tag, cpu=True)
    assert "cpu on top of two" in (tag / LAYER).read_text()


def test_a_main_checkout_that_moved_on_names_the_files_that_differ(synthetic):
    main = synthetic["main"]
    layer = main / LAYER
    layer.write_text(layer.read_text().replace("line 2\n", "line 2 changed upstream\n"))
    with pytest.raises(patch_series.SeriesError) as err:
        patch_series.apply_series(main)
    assert "main/0001-layer-one.diff does not apply" in str(err.value)
    assert f"these files differ from {patch_series.BASES['main'].commit}" in str(err.value)
    assert LAYER in str(err.value)


def test_build_applies_the_install_form_and_the_cpu_series(synthetic, tmp_path):
    out = tmp_path / "built"
    patch_series.build_tree(synthetic["sdist"], out)
    text = (out / LAYER).read_text()
    assert "three after one" in text and "cpu on top of two" in text
    info = (out / patch_series.PACKAGE_INFO).read_text()
    assert "'+r3'" in info and "__version__ += f'.{_git" in info


def test_workspace_and_export_round_trip(synthetic, tmp_path):
    before = {p.relative_to(patch_series.PATCH_DIR): p.read_bytes()
              for p in patch_series.PATCH_DIR.rglob("*") if p.is_file()}
    for base in ("0.19", "main"):
        ws = tmp_path / f"round-{base}"
        patch_series.make_workspace(patch_series.BASES[base], synthetic["history"], ws)
        patch_series.export_series(ws, patch_series.BASES[base])
    after = {p.relative_to(patch_series.PATCH_DIR): p.read_bytes()
             for p in patch_series.PATCH_DIR.rglob("*") if p.is_file()}
    assert after == before


def test_export_refuses_a_tag_off_the_history_and_an_unmarked_commit_after_the_last(synthetic):
    ws = synthetic["ws019"]
    change_line(ws, 20, "late", "layer: late")
    with pytest.raises(patch_series.SeriesError, match="layer: late.*lacks 'Series: cpu'"):
        patch_series.export_series(ws, patch_series.BASES["0.19"])
    git(ws, "reset", "-q", "--hard", "HEAD~1")
    git(ws, "checkout", "-q", "-b", "side", "base")
    change_line(ws, 12, "side", "layer: side")
    git(ws, "tag", "-f", "pr/two")  # a commit HEAD's history does not hold
    git(ws, "checkout", "-q", "r3")
    with pytest.raises(patch_series.SeriesError, match="tag pr/two is missing or not on HEAD"):
        patch_series.export_series(ws, patch_series.BASES["0.19"])


def test_digest_covers_the_install_form_and_the_cpu_series(synthetic):
    first = patch_series.series_digest()
    cpu_patch = patch_series.PATCH_DIR / "cpu/0001-layer-cpu.diff"
    cpu_patch.write_text(cpu_patch.read_text().replace("What: line", "What: the line"))
    second = patch_series.series_digest()
    assert second != first
    main_patch = patch_series.PATCH_DIR / "one/main/0001-layer-one.diff"
    main_patch.write_text(main_patch.read_text().replace("What: line", "What: the line"))
    assert patch_series.series_digest() == second  # make install applies the 0.19 form only
