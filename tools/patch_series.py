#!/usr/bin/env python3
"""Apply, check and build the megatron-r3 patch series.

Two series target megatron-core 0.19.2: ``patches/series``, what upstream
Megatron-Core should take (routing replay and general fixes), and
``patches/cpu/series``, applied on top of it, what only running Megatron on
CPUs and gloo process groups needs. A commit of the CPU series carries the
trailer ``Series: cpu`` in its message (so in its patch header); ``export``
sorts commits into the two series by it.

Both target the PyPI sdist
``megatron-core==0.19.2``. In Megatron-LM's git history the nearest tag is
``core_v0.19.0`` (commit 5be9626709, whose package_info says 0.19.1); it differs
from the 0.19.2 sdist in six files, in lines no patch touches, so the series
apply to a checkout of that tag too.

Commands:
  apply [--cpu] DIR
                apply the upstream series (and with --cpu the CPU series) to a
                Megatron-LM checkout or an extracted sdist after a dry run;
                refuses a wrong base or a patched tree. With --cpu, a tree that
                has only the upstream series gets the CPU series.
  check SDIST   apply the upstream series to a pristine copy of the sdist, then
                the CPU series on top; fail on fuzz, offsets, or a patch without
                a header.
  build SDIST OUT
                extract SDIST into OUT, apply both series and stamp the version
                as 0.19.2+r3, ready for ``pip install OUT``.
  workspace SDIST DIR
                make DIR a git checkout of the pristine sdist (tag 'base') with
                one commit per patch (git am), upstream series first: edit,
                commit, then 'export'.
  export REPO BASE
                regenerate both series from the commits BASE..HEAD of a git
                checkout of megatron-core (one commit per patch, its message
                the header; 'Series: cpu' commits to patches/cpu/, after all
                the others).
  digest        a digest of both series (make install rebuilds when it changes).
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
# The CPU series: a folder of PATCH_DIR, and the trailer that marks its commits.
CPU_SERIES = "cpu"
SERIES_TRAILER = "Series"
# The one author of every patch, and the identity of workspace commits.
AUTHOR_NAME = "megatron-r3 maintainers"
AUTHOR_EMAIL = "maintainers@megatron-r3.dev"
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
# package_info appends the commit of a git repository around the installed package (a venv inside
# a project's checkout) as a local label of its own; after ours it must join with a dot (PEP 440).
VCS_SUFFIX_LINE = "__version__ += f'+{_git.stdout.strip()}'"


class SeriesError(RuntimeError):
    """A user-facing failure: printed without a traceback."""


def label(path):
    """A patch's name as the series files give it: NAME upstream, cpu/NAME in the CPU series."""
    return path.relative_to(PATCH_DIR).as_posix()


def read_series(directory):
    """The patch files named in directory/series, in order; none where there is no series file."""
    series = directory / "series"
    if not series.is_file():
        return []
    names = [
        line.strip()
        for line in series.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    files = [directory / name for name in names]
    missing = [label(f) for f in files if not f.is_file()]
    if missing:
        raise SeriesError(f"{label(series)} names files that do not exist: {missing}")
    return files


def upstream_files():
    """The upstream series, patches/series: what Megatron-Core should take."""
    files = read_series(PATCH_DIR)
    if not files:
        raise SeriesError(f"{PATCH_DIR / 'series'} lists no patches")
    return files


def cpu_files():
    """The CPU series, patches/cpu/series (applied on top of the upstream one); may be empty."""
    return read_series(PATCH_DIR / CPU_SERIES)


def series_digest():
    """A digest of both series and of the version stamp, so an install can tell it is up to date."""
    digest = hashlib.sha256()
    for path in upstream_files() + cpu_files():
        digest.update(label(path).encode())
        digest.update(path.read_bytes())
    digest.update(repr(version_stamps()).encode())  # a new stamp is a new install too
    return digest.hexdigest()[:16]


def check_header(path, cpu):
    """Each patch starts with a Subject line and a body that says why and what; the CPU
    series' patches, and only those, carry the 'Series: cpu' trailer export sorts by."""
    text = path.read_text()
    head = text.split("\n---\n", 1)[0]
    if not re.search(r"^Subject: .+", head, re.M):
        raise SeriesError(f"{label(path)}: no 'Subject:' header")
    if "Why:" not in head or "What:" not in head:
        raise SeriesError(f"{label(path)}: the header must say 'Why:' and 'What:'")
    marked = re.search(rf"^{SERIES_TRAILER}: {CPU_SERIES}$", head, re.M) is not None
    if marked != cpu:
        where = f"patches/{CPU_SERIES}/" if marked else "patches/"
        raise SeriesError(
            f"{label(path)}: its header {'has' if marked else 'lacks'} the trailer "
            f"'{SERIES_TRAILER}: {CPU_SERIES}', so export would write it to {where}"
        )


def check_headers(upstream, cpu):
    for path in upstream:
        check_header(path, cpu=False)
    for path in cpu:
        check_header(path, cpu=True)


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


def has_patch(tree, path):
    """Whether `path` is applied at `tree`: check_series makes sure no later patch
    touches the hunks of a series' last patch, so it reverses cleanly."""
    return run_patch(tree, path, dry_run=True, reverse=True)[0] == 0


def apply_series(tree, cpu=False):
    """Apply the upstream series, and with `cpu` the CPU series, to a checkout, all or nothing.

    A tree that already has the upstream series gets only the CPU series. What is
    applied is first rehearsed patch by patch (`git apply --check`, then apply) on
    a scratch copy of the tree's megatron/ folder, because later patches build on
    earlier ones. Only then is the real tree touched: with `git apply` in a git
    checkout, with GNU patch elsewhere (an extracted sdist).
    """
    tree = Path(tree).resolve()
    refuse_wrong_base(tree)
    upstream = upstream_files()
    cpu_patches = cpu_files() if cpu else []
    check_headers(upstream, cpu_patches)
    if cpu_patches and has_patch(tree, cpu_patches[-1]):
        raise SeriesError(f"{tree} already has the megatron-r3 series applied (the CPU series too)")
    if has_patch(tree, upstream[-1]):
        if not cpu_patches:
            raise SeriesError(f"{tree} already has the megatron-r3 series applied")
        files = cpu_patches
    else:
        files = upstream + cpu_patches
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copytree(tree / "megatron", Path(scratch) / "megatron")
        for path in files:
            code, out = git_apply(scratch, path, "--check")
            if code == 0:
                code, out = git_apply(scratch, path)
            if code != 0:
                raise SeriesError(f"{label(path)} does not apply to {tree}:\n{out}")
    in_git = is_git_checkout(tree)
    for path in files:
        code, out = git_apply(tree, path) if in_git else run_patch(tree, path, dry_run=False)
        if code != 0:
            raise SeriesError(f"{label(path)} failed on {tree} after a clean rehearsal:\n{out}")
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
    """Apply the upstream series, in order, to a pristine sdist, then the CPU series on
    top; fail on fuzz or offsets, and where a later patch touches a series' last patch."""
    upstream, cpu = upstream_files(), cpu_files()
    check_headers(upstream, cpu)
    with tempfile.TemporaryDirectory() as tmp:
        tree = extract_sdist(sdist, Path(tmp) / "megatron-core")
        refuse_wrong_base(tree)
        for path in upstream + cpu:
            code, out = run_patch(tree, path, dry_run=False)
            if code != 0:
                raise SeriesError(f"{label(path)} does not apply:\n{out}")
            if re.search(r"offset|fuzz", out, re.I):
                raise SeriesError(f"{label(path)} applies only with offsets or fuzz:\n{out}")
            print(f"ok  {label(path)}", flush=True)
        for files in (upstream, cpu):
            if files and not has_patch(tree, files[-1]):
                raise SeriesError(
                    f"a later patch changes the lines of {label(files[-1])}, the last of its "
                    "series, so 'apply' could no longer tell a patched tree"
                )
    print(f"{len(upstream)} upstream and {len(cpu)} CPU patches apply cleanly to {Path(sdist).name}")


def version_stamps():
    """The lines of package_info that build_tree replaces, and what it writes in their place."""
    return [(VERSION_LINE, VERSION_LINE + f" + '+{LOCAL_LABEL}'"),
            (VCS_SUFFIX_LINE, VCS_SUFFIX_LINE.replace("f'+", "f'."))]


def build_tree(sdist, out):
    """Extract, patch and stamp the version: the tree `pip install` turns into 0.19.2+r3."""
    tree = extract_sdist(sdist, out)
    apply_series(tree, cpu=True)
    info = tree / PACKAGE_INFO
    text = info.read_text()
    for line, stamped in version_stamps():
        if text.count(line) != 1:
            raise SeriesError(f"cannot find the line {line!r} in {info}")
        text = text.replace(line, stamped)
    info.write_text(text)
    version = ".".join(map(str, BASE_VERSION))
    print(f"patched tree ready at {tree} (megatron-core {version}+{LOCAL_LABEL})")


def make_workspace(sdist, out):
    """A git checkout of the sdist, tagged 'base', with the series as commits."""
    tree = extract_sdist(sdist, out)
    ident = ["-c", f"user.name={AUTHOR_NAME}", "-c", f"user.email={AUTHOR_EMAIL}"]
    git = lambda *args: subprocess.run(["git", *ident, *args], cwd=tree, check=True)
    git("init", "-q")
    (tree / ".git" / "info" / "exclude").write_text("*.so\n*.egg-info\nbuild/\n__pycache__/\n")
    git("add", "-A")
    git("commit", "-qm", f"megatron-core {'.'.join(map(str, BASE_VERSION))} sdist")
    git("tag", "base")
    git("am", "-q", "--keep-cr", *map(str, upstream_files() + cpu_files()))
    print(f"workspace ready at {tree}: edit, commit, then "
          f"'tools/patch_series.py export {tree} base'")


def git_out(repo, *args):
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def commit_series(repo, commit):
    """The series a commit belongs to: its 'Series:' trailer, none for upstream."""
    value = git_out(
        repo, "log", "-1", f"--format=%(trailers:key={SERIES_TRAILER},valueonly,separator=%x2C)",
        commit,
    ).strip()
    if value not in ("", CPU_SERIES):
        subject = git_out(repo, "log", "-1", "--format=%s", commit).strip()
        raise SeriesError(
            f"commit {commit[:10]} ({subject}) says '{SERIES_TRAILER}: {value}'; "
            f"the only series a trailer names is '{CPU_SERIES}'"
        )
    return value or "upstream"


def write_series(repo, revisions, directory, cpu):
    """format-patch `revisions` into `directory` (numbered from 1) with its series file."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.diff"):
        old.unlink()
    out = git_out(
        repo, "format-patch", "--no-signature", "--zero-commit", "--no-numbered",
        "--suffix=.diff", "-o", str(directory), revisions,
    ).split()
    names = [Path(p).name for p in out]
    (directory / "series").write_text("".join(n + "\n" for n in names))
    for name in names:
        check_header(directory / name, cpu)
    return names


def export_series(repo, base):
    """Rewrite both series from the commits base..HEAD of `repo`: the upstream commits
    first, then those marked 'Series: cpu', which go to patches/cpu/."""
    commits = git_out(repo, "rev-list", "--reverse", f"{base}..HEAD").split()
    kinds = [commit_series(repo, c) for c in commits]
    upstream_count = kinds.count("upstream")
    misplaced = [c for c, kind in zip(commits[upstream_count:], kinds[upstream_count:])
                 if kind == "upstream"]
    if misplaced:
        subject = git_out(repo, "log", "-1", "--format=%s", misplaced[0]).strip()
        raise SeriesError(
            f"commit {misplaced[0][:10]} ({subject}) belongs to the upstream series but comes "
            f"after a '{SERIES_TRAILER}: {CPU_SERIES}' commit; the CPU series applies on top "
            "of the upstream one, so move it before the CPU commits"
        )
    if upstream_count == 0:
        raise SeriesError(f"{base}..HEAD has no upstream commit")
    split = commits[upstream_count - 1]
    names = write_series(repo, f"{base}..{split}", PATCH_DIR, cpu=False)
    cpu_dir = PATCH_DIR / CPU_SERIES
    if upstream_count < len(commits):
        cpu_names = write_series(repo, f"{split}..HEAD", cpu_dir, cpu=True)
    else:
        cpu_names = []
        if cpu_dir.is_dir():
            shutil.rmtree(cpu_dir)
    print(f"exported {len(names)} patches to {PATCH_DIR} and {len(cpu_names)} to {cpu_dir}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply")
    apply.add_argument("--cpu", action="store_true", help="the CPU series too")
    apply.add_argument("tree")
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
            apply_series(args.tree, cpu=args.cpu)
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
