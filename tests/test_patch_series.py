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

    assert importlib.metadata.version("megatron-core") == "0.19.2+r3"
    from megatron.core.transformer.moe import moe_routing, paged_stash

    # The replay patches are in, and Megatron imports without Triton (the kernels load lazily).
    assert hasattr(moe_routing, "MoERouting")
    assert not hasattr(paged_stash, "paged_stash_copy_kernel")


def test_a_late_conflict_leaves_the_tree_untouched(megatron_sdist, tmp_path):
    tree = git_checkout(megatron_sdist, tmp_path)
    # The last patch touches the schedules; a local edit there must stop the whole
    # series before the first patch is written.
    last = (ROOT / "patches" / (ROOT / "patches" / "series").read_text().split()[-1]).read_text()
    target = last.split("diff --git a/", 1)[1].split()[0]
    (tree / target).write_text("# a local change the series does not expect\n")
    proc = run_tool("apply", str(tree))
    assert proc.returncode == 1 and "does not apply" in proc.stderr
    changed = subprocess.run(["git", "diff", "--name-only"], cwd=tree, capture_output=True, text=True)
    assert changed.stdout.split() == [target]
