"""The patch tooling: check, apply to a checkout, refuse a wrong base or a patched tree."""

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = [sys.executable, str(ROOT / "tools" / "patch_series.py")]


def run_tool(*args):
    return subprocess.run([*TOOL, *args], capture_output=True, text=True)


def git_checkout(sdist, dest):
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (tree,) = Path(dest).iterdir()
    env = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tree, check=True)
    subprocess.run(["git", *env, "commit", "-qm", "base"], cwd=tree, check=True)
    return tree


def test_series_applies_cleanly_with_headers(megatron_sdist):
    proc = run_tool("check", megatron_sdist)
    assert proc.returncode == 0, proc.stderr
    series = (ROOT / "patches" / "series").read_text().split()
    assert series and all(f"ok  {name}" in proc.stdout for name in series)


def test_apply_to_checkout_then_refuse_second_time(megatron_sdist, tmp_path):
    tree = git_checkout(megatron_sdist, tmp_path)
    first = run_tool("apply", str(tree))
    assert first.returncode == 0, first.stderr
    changed = subprocess.run(["git", "diff", "--name-only"], cwd=tree, capture_output=True, text=True)
    assert "megatron/core/transformer/moe/router.py" in changed.stdout
    second = run_tool("apply", str(tree))
    assert second.returncode == 1
    assert "already has the megatron-r3 series applied" in second.stderr


def test_plain_git_apply_of_the_diffs_in_name_order(megatron_sdist, tmp_path):
    """The documented `git apply patches/*.diff`: the shell's name order is the series order."""
    series = (ROOT / "patches" / "series").read_text().split()
    diffs = sorted(p.name for p in (ROOT / "patches").glob("*.diff"))
    assert diffs == series
    tree = git_checkout(megatron_sdist, tmp_path)
    proc = subprocess.run(["git", "apply", *(str(ROOT / "patches" / name) for name in diffs)],
                          cwd=tree, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert run_tool("apply", str(tree)).returncode == 1  # and the tool sees the series applied


def test_refuse_wrong_base(megatron_sdist, tmp_path):
    tree = git_checkout(megatron_sdist, tmp_path)
    info = tree / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 19", "MINOR = 16").replace("PATCH = 2", "PATCH = 1"))
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1
    assert "Megatron-Core 0.16.1" in proc.stderr and "targets 0.19.2" in proc.stderr
    assert "core_v0.19.0" in proc.stderr and "0.16.1 is named in the README" in proc.stderr
    assert subprocess.run(["git", "diff", "--quiet", "--", "megatron/core/transformer"], cwd=tree).returncode == 0


def test_refuse_a_tree_that_is_not_megatron(tmp_path):
    proc = run_tool("apply", str(tmp_path))
    assert proc.returncode == 1 and "not a Megatron-LM checkout" in proc.stderr


def test_check_rejects_a_patch_without_header(megatron_sdist, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import patch_series

    bad_dir = tmp_path / "patches"
    bad_dir.mkdir()
    first = (ROOT / "patches" / (ROOT / "patches" / "series").read_text().split()[0]).read_text()
    body = first.split("\n---\n", 1)[1]
    (bad_dir / "0001-bare.diff").write_text("Subject: [PATCH] bare\n\nno reasons given\n---\n" + body)
    (bad_dir / "series").write_text("0001-bare.diff\n")
    monkeypatch.setattr(patch_series, "PATCH_DIR", bad_dir)
    with pytest.raises(patch_series.SeriesError, match="Why:"):
        patch_series.check_series(megatron_sdist)


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
    last = (ROOT / "patches" / (ROOT / "patches" / "series").read_text().split()[-1]).read_text()
    touched = [part.split()[0] for part in last.split("diff --git a/")[1:]]
    target = next(path for path in touched if (tree / path).is_file())
    (tree / target).write_text("# a local change the series does not expect\n")
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1 and "does not apply" in proc.stderr
    changed = subprocess.run(["git", "diff", "--name-only"], cwd=tree, capture_output=True, text=True)
    assert changed.stdout.split() == [target]


# The two series (upstream, then CPU on top), on a synthetic megatron-core tree.
import patch_series  # noqa: E402  (tools/ is on sys.path: conftest)

LAYER = "megatron/core/layer.py"


def git(tree, *args):
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    return subprocess.run(["git", *ident, *args], cwd=tree, check=True, capture_output=True,
                          text=True).stdout


def change_line(tree, number, text, subject, cpu=False):
    """Commit one changed line of layer.py; `cpu` marks the commit for the CPU series."""
    path = Path(tree) / LAYER
    lines = path.read_text().splitlines(keepends=True)
    lines[number] = text + "\n"
    path.write_text("".join(lines))
    trailer = f"\n{patch_series.SERIES_TRAILER}: {patch_series.CPU_SERIES}\n" if cpu else ""
    git(tree, "commit", "-qam", f"{subject}\n\nWhy: a test needs it.\n\nWhat: line {number}.\n{trailer}")


def synthetic_sdist(tmp_path):
    """A tiny megatron-core 0.19.2 sdist: package_info.py and a layer.py of 20 lines.
    Returns it and a git checkout of it, tagged 'base'."""
    top = tmp_path / "src" / "megatron-core-0.19.2"
    (top / "megatron/core").mkdir(parents=True)
    (top / patch_series.PACKAGE_INFO).write_text(
        "MAJOR = 0\nMINOR = 19\nPATCH = 2\nVERSION = (MAJOR, MINOR, PATCH)\n"
        + patch_series.VERSION_LINE + "\n" + "    " + patch_series.VCS_SUFFIX_LINE + "\n"
    )
    (top / LAYER).write_text("".join(f"line {i}\n" for i in range(20)))
    sdist = tmp_path / "megatron_core-0.19.2.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    repo = git_checkout(sdist, tmp_path / "repo")
    git(repo, "tag", "base")
    return sdist, repo


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    """The synthetic sdist, its checkout and patches/ of two series:
    upstream 'one' and 'two', and 'cpu' (line 2, changed by 'one' first) on top."""
    sdist, repo = synthetic_sdist(tmp_path)
    change_line(repo, 2, "upstream one", "layer: one")
    change_line(repo, 10, "upstream two", "layer: two")
    change_line(repo, 2, "cpu on top of one", "layer: cpu", cpu=True)
    monkeypatch.setattr(patch_series, "PATCH_DIR", tmp_path / "patches")
    patch_series.export_series(repo, "base")
    return sdist, repo


def test_export_writes_each_commit_to_its_series(synthetic):
    patches = patch_series.PATCH_DIR
    assert (patches / "series").read_text().split() == ["0001-layer-one.diff", "0002-layer-two.diff"]
    assert (patches / "cpu/series").read_text().split() == ["0001-layer-cpu.diff"]
    assert "Series: cpu" in (patches / "cpu/0001-layer-cpu.diff").read_text()
    assert "Series:" not in (patches / "0002-layer-two.diff").read_text()


def test_export_refuses_an_upstream_commit_after_the_cpu_series(synthetic):
    _, repo = synthetic
    change_line(repo, 15, "upstream three", "layer: three")
    with pytest.raises(patch_series.SeriesError, match="layer: three.*move it before the CPU"):
        patch_series.export_series(repo, "base")


def test_export_refuses_an_unknown_series(synthetic):
    _, repo = synthetic
    path = Path(repo) / LAYER
    path.write_text(path.read_text() + "more\n")
    git(repo, "commit", "-qam", "layer: more\n\nWhy: w.\n\nWhat: w.\n\nSeries: gpu\n")
    with pytest.raises(patch_series.SeriesError, match="'Series: gpu'"):
        patch_series.export_series(repo, "base")


def test_check_applies_upstream_then_cpu_on_top(synthetic, capsys):
    sdist, _ = synthetic
    patch_series.check_series(sdist)
    out = capsys.readouterr().out
    assert "ok  0002-layer-two.diff\nok  cpu/0001-layer-cpu.diff\n" in out
    assert "2 upstream and 1 CPU patches apply cleanly" in out
    # A CPU patch that no longer applies on top of the upstream series fails the check.
    cpu_patch = patch_series.PATCH_DIR / "cpu/0001-layer-cpu.diff"
    cpu_patch.write_text(cpu_patch.read_text().replace("-upstream one", "-line 2"))
    with pytest.raises(patch_series.SeriesError, match="cpu/0001-layer-cpu.diff does not apply"):
        patch_series.check_series(sdist)


def test_check_refuses_a_cpu_patch_over_the_last_upstream_one(synthetic):
    """apply tells a patched tree by its series' last patch: no later patch may change it."""
    sdist, repo = synthetic
    change_line(repo, 10, "cpu on top of two", "layer: cpu two", cpu=True)
    patch_series.export_series(repo, "base")
    with pytest.raises(patch_series.SeriesError, match="lines of 0002-layer-two.diff, the last"):
        patch_series.check_series(sdist)


def test_check_refuses_a_misfiled_patch(synthetic):
    sdist, _ = synthetic
    upstream_patch = patch_series.PATCH_DIR / "0001-layer-one.diff"
    text = upstream_patch.read_text()
    upstream_patch.write_text(text.replace("What: line 2.\n", "What: line 2.\n\nSeries: cpu\n"))
    with pytest.raises(patch_series.SeriesError, match="0001-layer-one.diff: its header has"):
        patch_series.check_series(sdist)


def test_apply_upstream_then_cpu_on_request(synthetic, tmp_path):
    sdist, _ = synthetic
    tree = git_checkout(sdist, tmp_path / "user")
    layer = tree / LAYER
    patch_series.apply_series(tree)
    assert "upstream one" in layer.read_text() and "upstream two" in layer.read_text()
    with pytest.raises(patch_series.SeriesError, match="already has the megatron-r3 series"):
        patch_series.apply_series(tree)
    patch_series.apply_series(tree, cpu=True)  # only the CPU series is left to apply
    assert "cpu on top of one" in layer.read_text() and "upstream two" in layer.read_text()
    with pytest.raises(patch_series.SeriesError, match="the CPU series too"):
        patch_series.apply_series(tree, cpu=True)


def test_build_applies_both_series(synthetic, tmp_path):
    sdist, _ = synthetic
    out = tmp_path / "built"
    patch_series.build_tree(sdist, out)
    text = (out / LAYER).read_text()
    assert "upstream two" in text and "cpu on top of one" in text
    info = (out / patch_series.PACKAGE_INFO).read_text()
    assert "'+r3'" in info and "__version__ += f'.{_git" in info


def test_workspace_and_export_round_trip(synthetic, tmp_path):
    sdist, _ = synthetic
    before = {p.relative_to(patch_series.PATCH_DIR): p.read_bytes()
              for p in patch_series.PATCH_DIR.rglob("*") if p.is_file()}
    workspace = tmp_path / "ws"
    patch_series.make_workspace(sdist, workspace)
    assert git(workspace, "log", "--format=%(trailers:key=Series,valueonly)%s", "base..HEAD").split(
        "\n")[:3] == ["cpu", "layer: cpu", "layer: two"]
    patch_series.export_series(workspace, "base")
    after = {p.relative_to(patch_series.PATCH_DIR): p.read_bytes()
             for p in patch_series.PATCH_DIR.rglob("*") if p.is_file()}
    assert after == before


def test_digest_covers_the_cpu_series(synthetic):
    first = patch_series.series_digest()
    cpu_patch = patch_series.PATCH_DIR / "cpu/0001-layer-cpu.diff"
    cpu_patch.write_text(cpu_patch.read_text().replace("What: line 2.", "What: line two."))
    assert patch_series.series_digest() != first
