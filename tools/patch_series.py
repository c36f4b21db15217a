#!/usr/bin/env python3
"""Apply, check and build the megatron-r3 patch series.

The series in ``patches/series`` targets megatron-core 0.19.2, the PyPI sdist
``megatron-core==0.19.2``. In Megatron-LM's git history the nearest tag is
``core_v0.19.0`` (commit 5be9626709, whose package_info says 0.19.1); it differs
from the 0.19.2 sdist in six files, in lines no patch touches, so the series
applies to a checkout of that tag too.

Commands:
  apply DIR     apply the series to a Megatron-LM checkout (or an extracted
                sdist) after a dry run; refuses a wrong base or a patched tree.
  check SDIST   apply the series to a pristine copy of the sdist and fail on
                fuzz, offsets, or a patch without a header.
  build SDIST OUT
                extract SDIST into OUT, apply the series and stamp the version
                as 0.19.2+r3, ready for ``pip install OUT``.
  workspace SDIST DIR
                make DIR a git checkout of the pristine sdist (tag 'base') with
                one commit per patch (git am): edit, commit, then 'export'.
  export REPO BASE
                regenerate patches/ from the commits BASE..HEAD of a git
                checkout of megatron-core (one commit per patch, its message
                the header).
  digest        a digest of the series (make install rebuilds when it changes).
  base          the base version, sdist file name and its pinned sha256.
"""

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
BASE_VERSION = (0, 19, 2)
SDIST_NAME = "megatron_core-0.19.2.tar.gz"
SDIST_SHA256 = "de643eee32007a7504ad52f061103fe7432503603b6321c16c861eb67dbd3353"
# Trees the series applies to, by the version their package_info declares.
ACCEPTED_BASES = {
    (0, 19, 2): "the megatron-core 0.19.2 release",
    (0, 19, 1): "Megatron-LM tag core_v0.19.0, commit 5be9626709",
}
LOCAL_LABEL = "r3"
PACKAGE_INFO = Path("megatron/core/package_info.py")
VERSION_LINE = "__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])"


class SeriesError(RuntimeError):
    """A user-facing failure: printed without a traceback."""


def series_files():
    """The patch files named in patches/series, in order."""
    series = PATCH_DIR / "series"
    names = [
        line.strip()
        for line in series.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    files = [PATCH_DIR / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SeriesError(f"patches/series names files that do not exist: {missing}")
    return files


def series_digest():
    """A digest of the whole series, so an install can tell it is up to date."""
    digest = hashlib.sha256()
    for path in series_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def check_header(path):
    """Each patch starts with a Subject line and a body that says why and what."""
    text = path.read_text()
    head = text.split("\n---\n", 1)[0]
    if not re.search(r"^Subject: .+", head, re.M):
        raise SeriesError(f"{path.name}: no 'Subject:' header")
    if "Why:" not in head or "What:" not in head:
        raise SeriesError(f"{path.name}: the header must say 'Why:' and 'What:'")


def base_version(tree):
    """The (major, minor, patch) a Megatron tree declares, or None if it is not one."""
    info = tree / PACKAGE_INFO
    if not info.is_file():
        return None
    text = info.read_text()
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"^{name} = (\d+)", text, re.M)
        if not match:
            return None
        parts.append(int(match.group(1)))
    return tuple(parts)


def run_patch(tree, patch, dry_run, reverse=False):
    """Apply one patch with GNU patch, refusing any fuzz; returns its output."""
    cmd = ["patch", "-p1", "-F0", "--forward", "--no-backup-if-mismatch", "-i", str(patch)]
    if reverse:
        cmd[cmd.index("--forward")] = "--reverse"
    if dry_run:
        cmd.append("--dry-run")
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def is_git_checkout(tree):
    proc = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=tree, capture_output=True, text=True
    )
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == tree.resolve()


def refuse_wrong_base(tree):
    version = base_version(tree)
    if version is None:
        raise SeriesError(
            f"{tree} is not a Megatron-LM checkout or megatron-core sdist "
            f"({PACKAGE_INFO} not found)"
        )
    if version not in ACCEPTED_BASES:
        have = ".".join(map(str, version))
        accepted = "; ".join(
            f"{'.'.join(map(str, v))}: {what}" for v, what in ACCEPTED_BASES.items()
        )
        raise SeriesError(
            f"{tree} is Megatron-Core {have}; the series targets 0.19.2 ({accepted}). The last "
            "megatron-r3 commit for 0.16.1 is named in the README"
        )


def git_apply(tree, patch, *flags):
    """`git apply` one patch at `tree`; returns (exit code, output)."""
    proc = subprocess.run(
        ["git", "apply", *flags, str(patch)], cwd=tree, capture_output=True, text=True
    )
    return proc.returncode, proc.stdout + proc.stderr


def apply_series(tree):
    """Apply the series to a checkout, all or nothing.

    The whole series is first rehearsed patch by patch (`git apply --check`, then
    apply) on a scratch copy of the tree's megatron/ folder, because later patches
    build on earlier ones. Only then is the real tree touched: with `git apply` in
    a git checkout, with GNU patch elsewhere (an extracted sdist).
    """
    tree = Path(tree).resolve()
    refuse_wrong_base(tree)
    files = series_files()
    for path in files:
        check_header(path)
    # The last patch's hunks are not touched again by any patch after it.
    if run_patch(tree, files[-1], dry_run=True, reverse=True)[0] == 0:
        raise SeriesError(f"{tree} already has the megatron-r3 series applied")
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copytree(tree / "megatron", Path(scratch) / "megatron")
        for path in files:
            code, out = git_apply(scratch, path, "--check")
            if code == 0:
                code, out = git_apply(scratch, path)
            if code != 0:
                raise SeriesError(f"{path.name} does not apply to {tree}:\n{out}")
    in_git = is_git_checkout(tree)
    for path in files:
        code, out = git_apply(tree, path) if in_git else run_patch(tree, path, dry_run=False)
        if code != 0:
            raise SeriesError(f"{path.name} failed on {tree} after a clean rehearsal:\n{out}")
    print(f"applied {len(files)} patches to {tree}")


def extract_sdist(sdist, out):
    """Extract the sdist's single top-level folder to `out` (replacing it)."""
    out = Path(out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        top.rename(out)
    return out


def check_series(sdist):
    """Apply every patch, in order, to a pristine sdist; fail on fuzz or offsets."""
    files = series_files()
    for path in files:
        check_header(path)
    with tempfile.TemporaryDirectory() as tmp:
        tree = extract_sdist(sdist, Path(tmp) / "megatron-core")
        refuse_wrong_base(tree)
        for path in files:
            code, out = run_patch(tree, path, dry_run=False)
            if code != 0:
                raise SeriesError(f"{path.name} does not apply:\n{out}")
            if re.search(r"offset|fuzz", out, re.I):
                raise SeriesError(f"{path.name} applies only with offsets or fuzz:\n{out}")
            print(f"ok  {path.name}", flush=True)
    print(f"{len(files)} patches apply cleanly to {Path(sdist).name}")


def build_tree(sdist, out):
    """Extract, patch and stamp the version: the tree `pip install` turns into 0.19.2+r3."""
    tree = extract_sdist(sdist, out)
    apply_series(tree)
    info = tree / PACKAGE_INFO
    text = info.read_text()
    if text.count(VERSION_LINE) != 1:
        raise SeriesError(f"cannot find the version line in {info}")
    stamped = VERSION_LINE + f" + '+{LOCAL_LABEL}'"
    info.write_text(text.replace(VERSION_LINE, stamped))
    version = ".".join(map(str, BASE_VERSION))
    print(f"patched tree ready at {tree} (megatron-core {version}+{LOCAL_LABEL})")


def make_workspace(sdist, out):
    """A git checkout of the sdist, tagged 'base', with the series as commits."""
    tree = extract_sdist(sdist, out)
    ident = ["-c", "user.name=megatron-r3", "-c", "user.email=megatron-r3@localhost"]
    git = lambda *args: subprocess.run(["git", *ident, *args], cwd=tree, check=True)
    git("init", "-q")
    (tree / ".git" / "info" / "exclude").write_text("*.so\n*.egg-info\nbuild/\n__pycache__/\n")
    git("add", "-A")
    git("commit", "-qm", f"megatron-core {'.'.join(map(str, BASE_VERSION))} sdist")
    git("tag", "base")
    git("am", "-q", "--keep-cr", *map(str, series_files()))
    print(f"workspace ready at {tree}: edit, commit, then "
          f"'tools/patch_series.py export {tree} base'")


def export_series(repo, base):
    """Rewrite patches/ and patches/series from the commits base..HEAD of `repo`."""
    for old in PATCH_DIR.glob("*.diff"):
        old.unlink()
    out = subprocess.run(
        ["git", "format-patch", "--no-signature", "--zero-commit", "--no-numbered",
         "--suffix=.diff", "-o", str(PATCH_DIR), f"{base}..HEAD"],
        cwd=repo, capture_output=True, text=True, check=True,
    ).stdout.split()
    names = [Path(p).name for p in out]
    (PATCH_DIR / "series").write_text("".join(n + "\n" for n in names))
    for name in names:
        check_header(PATCH_DIR / name)
    print(f"exported {len(names)} patches to {PATCH_DIR}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("apply").add_argument("tree")
    sub.add_parser("check").add_argument("sdist")
    build = sub.add_parser("build")
    build.add_argument("sdist")
    build.add_argument("out")
    workspace = sub.add_parser("workspace")
    workspace.add_argument("sdist")
    workspace.add_argument("out")
    export = sub.add_parser("export")
    export.add_argument("repo")
    export.add_argument("base")
    sub.add_parser("digest")
    sub.add_parser("base")
    args = parser.parse_args(argv)
    try:
        if args.command == "apply":
            apply_series(args.tree)
        elif args.command == "check":
            check_series(args.sdist)
        elif args.command == "build":
            build_tree(args.sdist, args.out)
        elif args.command == "workspace":
            make_workspace(args.sdist, args.out)
        elif args.command == "export":
            export_series(args.repo, args.base)
        elif args.command == "digest":
            print(series_digest())
        elif args.command == "base":
            print(".".join(map(str, BASE_VERSION)), SDIST_NAME, SDIST_SHA256)
    except SeriesError as err:
        print(f"patch_series: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
