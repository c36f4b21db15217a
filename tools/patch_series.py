#!/usr/bin/env python3
"""Apply, check and build the megatron-r3 patch series.

The upstream series is split into pull requests, one folder of ``patches/`` each, listed in
apply order in ``patches/series`` (``name: prerequisite ...``). Every pull request has one form
per base, ``patches/<pr>/<base>/`` with its own ``series`` file, in ``git format-patch`` form:

  0.19  Megatron-Core 0.19: the megatron-core 0.19.2 sdist (what ``make install`` patches) and
        Megatron-LM tag core_v0.19.0 (5be9626709, whose package_info says 0.19.1). The form is
        made on the tag, so its blob ids are Megatron-LM's; the sdist differs from the tag in
        six files, in lines no patch touches (patches apply there with line offsets).
  main  Megatron-LM main at the pinned commit MAIN_COMMIT (package_info says 0.20.0).

``patches/cpu/series`` (the CPU series, trailer ``Series: cpu``) applies on top of the 0.19
form only: what running Megatron on CPUs and gloo process groups needs.

Commands:
  apply [--cpu] DIR
                recognise the base of a Megatron-LM checkout or an extracted sdist by its
                package_info version, apply that base's form (with --cpu the CPU series too,
                0.19 only) after a rehearsal on a scratch copy; refuse an unknown base, naming
                the supported ones, and a tree that has the series already.
  check SDIST [--megatron DIR]
                with ``git am`` on scratch repositories: the 0.19 form and the CPU series on the
                pristine sdist, every pull request on the base alone plus its prerequisites,
                every header; with --megatron, the form of that checkout's base on its HEAD
                (the main base is checked only there).
  build SDIST OUT
                extract SDIST into OUT, apply the 0.19 form and the CPU series and stamp the
                version as 0.19.2+r3, ready for ``pip install OUT``.
  workspace --base BASE MEGATRON_GIT DIR
                make DIR a clone of a Megatron-LM history at the base's commit with one commit
                per patch (git am), a tag ``pr/<name>`` on each pull request's last commit and,
                for 0.19, the CPU series after them: edit, commit, move the tags, then export.
  export --base BASE REPO
                regenerate the base's form of every pull request (and, for 0.19, the CPU series)
                from the commits of REPO after the base commit, split at the ``pr/<name>`` tags.
  digest        a digest of what make install applies (make install rebuilds when it changes).
  base          the install base's version, sdist file name and its pinned sha256.
"""

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
# The CPU series: a folder of PATCH_DIR, and the trailer that marks its commits.
CPU_SERIES = "cpu"
SERIES_TRAILER = "Series"
# Workspace commits (the base commit of an sdist workspace) carry this identity.
AUTHOR_NAME = "megatron-r3 maintainers"
AUTHOR_EMAIL = "maintainers@megatron-r3.dev"
SDIST_VERSION = (0, 19, 2)
SDIST_NAME = "megatron_core-0.19.2.tar.gz"
SDIST_SHA256 = "de643eee32007a7504ad52f061103fe7432503603b6321c16c861eb67dbd3353"
MAIN_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
LOCAL_LABEL = "r3"
# A test file of Megatron-LM's tree, as a patch's 'Tests:' paragraph names it.
TEST_FILE = re.compile(r"tests/[\w/.-]+\.py")
PACKAGE_INFO = Path("megatron/core/package_info.py")
VERSION_LINE = "__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])"
# package_info appends the commit of a git repository around the installed package (a venv inside
# a project's checkout) as a local label of its own; after ours it must join with a dot (PEP 440).
VCS_SUFFIX_LINE = "__version__ += f'+{_git.stdout.strip()}'"


@dataclass(frozen=True)
class Base:
    """A tree the series has a form for: its name (the folder of each pull request's form),
    the package_info versions that identify it, and the Megatron-LM commit the form is made on."""

    name: str
    versions: dict = field(hash=False)  # (major, minor, patch) -> what declares it
    commit: str
    cpu_series: bool  # whether the CPU series has a form for it


BASES = {
    "0.19": Base(
        "0.19",
        {
            (0, 19, 2): "the megatron-core 0.19.2 release (the sdist make install patches)",
            (0, 19, 1): "Megatron-LM tag core_v0.19.0, commit 5be9626709",
        },
        commit="core_v0.19.0",
        cpu_series=True,
    ),
    "main": Base(
        "main",
        {(0, 20, 0): f"Megatron-LM main at {MAIN_COMMIT[:10]} (2026-08-22)"},
        commit=MAIN_COMMIT,
        cpu_series=False,
    ),
}
INSTALL_BASE = "0.19"  # the form make install applies to the sdist


class SeriesError(RuntimeError):
    """A user-facing failure: printed without a traceback."""


@dataclass(frozen=True)
class PullRequest:
    name: str
    requires: tuple


def label(path):
    """A patch's name relative to patches/: <pr>/<base>/NAME, or cpu/NAME."""
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


def pull_requests():
    """The pull requests of patches/series, in apply order, each with its prerequisites."""
    series = PATCH_DIR / "series"
    if not series.is_file():
        raise SeriesError(f"{series} is missing: it lists the pull requests in apply order")
    prs = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, requires = line.partition(":")
        name, requires = name.strip(), tuple(requires.split())
        known = [pr.name for pr in prs]
        late = [r for r in requires if r not in known]
        if late:
            raise SeriesError(
                f"patches/series: {name} requires {late}, which must be listed before it"
            )
        if not (PATCH_DIR / name).is_dir():
            raise SeriesError(f"patches/series names {name}, but patches/{name}/ does not exist")
        prs.append(PullRequest(name, requires))
    if not prs:
        raise SeriesError("patches/series lists no pull request")
    return prs


def with_prerequisites(names):
    """The pull requests named and every prerequisite of theirs, in series order."""
    prs = pull_requests()
    by_name = {pr.name: pr for pr in prs}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SeriesError(
            f"no pull request {unknown} in patches/series (it lists {', '.join(by_name)})"
        )
    needed, stack = set(), list(names)
    while stack:
        name = stack.pop()
        if name not in needed:
            needed.add(name)
            stack.extend(by_name[name].requires)
    return [pr for pr in prs if pr.name in needed]


def pr_files(pr, base):
    """The base's form of one pull request (may be empty where a change is upstream already)."""
    return read_series(PATCH_DIR / pr.name / base.name)


def form_files(base, prs=None):
    """Every pull request's form for ``base`` (``prs``: those named and their prerequisites), in
    apply order."""
    chosen = pull_requests() if prs is None else with_prerequisites(prs)
    return [path for pr in chosen for path in pr_files(pr, base)]


def cpu_files():
    """The CPU series, patches/cpu/series (on top of the 0.19 form); may be empty."""
    return read_series(PATCH_DIR / CPU_SERIES)


def series_digest():
    """A digest of what make install applies and of the version stamp."""
    digest = hashlib.sha256()
    for path in form_files(BASES[INSTALL_BASE]) + cpu_files():
        digest.update(label(path).encode())
        digest.update(path.read_bytes())
    digest.update(repr(version_stamps()).encode())  # a new stamp is a new install too
    return digest.hexdigest()[:16]


def check_header(path, cpu):
    """A patch starts with a Subject, a body that says why and what, and a Signed-off-by; the
    CPU series' patches, and only those, carry the 'Series: cpu' trailer. An upstream patch
    carries its tests (check_tests)."""
    text = path.read_text()
    head = text.split("\n---\n", 1)[0]
    if not re.search(r"^Subject: .+", head, re.M):
        raise SeriesError(f"{label(path)}: no 'Subject:' header")
    if "Why:" not in head or "What:" not in head:
        raise SeriesError(f"{label(path)}: the header must say 'Why:' and 'What:'")
    if not re.search(r"^Signed-off-by: .+ <.+@.+>$", head, re.M):
        raise SeriesError(f"{label(path)}: no 'Signed-off-by:' (git commit -s)")
    marked = re.search(rf"^{SERIES_TRAILER}: {CPU_SERIES}$", head, re.M) is not None
    if marked != cpu:
        raise SeriesError(
            f"{label(path)}: its header {'has' if marked else 'lacks'} the trailer "
            f"'{SERIES_TRAILER}: {CPU_SERIES}', which marks the CPU series (patches/cpu/)"
        )
    if not cpu:
        check_tests(path, text)


def check_tests(path, text):
    """An upstream patch carries its tests in Megatron-LM's form: the header's 'Tests:'
    paragraph names test files the patch adds or changes, and every test file it adds or
    changes is named there (the CPU series' tests live in this repository instead)."""
    head, _, rest = text.partition("\n---\n")
    paragraph = re.search(r"^Tests: (.*?)(?=\n\n|\Z)", head, re.M | re.S)
    if paragraph is None:
        raise SeriesError(f"{label(path)}: no 'Tests:' paragraph naming the tests the patch carries")
    named = set(TEST_FILE.findall(paragraph.group(1)))
    if not named:
        raise SeriesError(f"{label(path)}: its 'Tests:' paragraph names no tests/...py file")
    changed = set(re.findall(r"^diff --git a/(\S+) b/", rest, re.M))
    absent = sorted(named - changed)
    if absent:
        raise SeriesError(f"{label(path)}: 'Tests:' names {absent}, which the patch does not "
                          "add or change")
    unnamed = sorted(f for f in changed - named if TEST_FILE.fullmatch(f)
                     and Path(f).name.startswith("test_"))
    if unnamed:
        raise SeriesError(f"{label(path)}: changes {unnamed}, which its 'Tests:' paragraph "
                          "does not name")


def check_headers(files, cpu=()):
    for path in files:
        check_header(path, cpu=False)
    for path in cpu:
        check_header(path, cpu=True)


def tree_version(tree):
    """The (major, minor, patch) a Megatron tree declares, or None if it is not one."""
    info = Path(tree) / PACKAGE_INFO
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


def supported_bases():
    return "; ".join(
        f"{'.'.join(map(str, v))} ({what}): the {base.name} form"
        for base in BASES.values()
        for v, what in base.versions.items()
    )


def recognise_base(tree):
    """The base whose form applies to ``tree``, by the version its package_info declares."""
    version = tree_version(tree)
    if version is None:
        raise SeriesError(
            f"{tree} is not a Megatron-LM checkout or megatron-core sdist ({PACKAGE_INFO} not found)"
        )
    for base in BASES.values():
        if version in base.versions:
            return base
    raise SeriesError(
        f"{tree} is Megatron-Core {'.'.join(map(str, version))}, which the series has no form "
        f"for. Supported: {supported_bases()}. The last megatron-r3 commit for 0.16.1 is named "
        "in the README"
    )


def preimage_blobs(files):
    """{path: abbreviated blob id} of each file as the first patch that touches it expects it."""
    blobs = {}
    for path in files:
        for match in re.finditer(
            r"^diff --git a/(\S+) b/\S+\n(?:(?:new|deleted) file mode \d+\n)?index (\w+)\.\.",
            path.read_text(),
            re.M,
        ):
            blobs.setdefault(match.group(1), match.group(2))
    return blobs


def differing_files(tree, files):
    """Files the form touches whose content is not the blob the form was made on."""
    out = []
    for rel, blob in preimage_blobs(files).items():
        target = Path(tree) / rel
        if set(blob) == {"0"}:
            if target.exists():
                out.append(rel)
            continue
        if not target.is_file():
            out.append(rel)
            continue
        have = subprocess.run(
            ["git", "hash-object", "--no-filters", str(target)], capture_output=True, text=True
        ).stdout.strip()
        if not have.startswith(blob):
            out.append(rel)
    return out


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
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == Path(tree).resolve()


def git_apply(tree, patch, *flags):
    """`git apply` one patch at `tree`; returns (exit code, output)."""
    proc = subprocess.run(
        ["git", "apply", *flags, str(patch)], cwd=tree, capture_output=True, text=True
    )
    return proc.returncode, proc.stdout + proc.stderr


def has_patch(tree, path):
    """Whether `path` is applied at `tree`: check makes sure no later patch touches the
    hunks of a series' last patch, so it reverses cleanly."""
    return run_patch(tree, path, dry_run=True, reverse=True)[0] == 0


def copy_for_rehearsal(tree, scratch):
    """The folders of `tree` the series touches, copied to `scratch`."""
    for top in ("megatron", "tests"):
        if (tree / top).is_dir():
            shutil.copytree(tree / top, scratch / top, ignore=shutil.ignore_patterns("__pycache__"))


def apply_series(tree, cpu=False, prs=None):
    """Apply the form of the tree's base (`prs`: only those pull requests, each with its
    prerequisites), and with `cpu` the CPU series, all or nothing.

    A tree that already has the form gets only the CPU series. What is applied is first
    rehearsed patch by patch (`git apply --check`, then apply) on a scratch copy of the tree,
    because later patches build on earlier ones. Only then is the real tree touched: with
    `git apply` in a git checkout, with GNU patch elsewhere (an extracted sdist, which may sit
    inside another git checkout, where `git apply` would take paths from that checkout's root).
    """
    tree = Path(tree).resolve()
    base = recognise_base(tree)
    form = form_files(base, prs)
    if cpu and not base.cpu_series:
        raise SeriesError(
            f"{tree} is the {base.name} base; the CPU series has a form for the "
            f"{', '.join(b.name for b in BASES.values() if b.cpu_series)} base only"
        )
    cpu_patches = cpu_files() if cpu else []
    check_headers(form, cpu_patches)
    if cpu_patches and has_patch(tree, cpu_patches[-1]):
        raise SeriesError(f"{tree} already has the megatron-r3 series applied (the CPU series too)")
    if has_patch(tree, form[-1]):
        if not cpu_patches:
            raise SeriesError(f"{tree} already has the megatron-r3 series applied")
        files = cpu_patches
    else:
        files = form + cpu_patches
    with tempfile.TemporaryDirectory() as scratch:
        copy_for_rehearsal(tree, Path(scratch))
        for path in files:
            code, out = git_apply(scratch, path, "--check")
            if code == 0:
                code, out = git_apply(scratch, path)
            if code != 0:
                differ = differing_files(tree, form)
                hint = (
                    f"; these files differ from {base.commit}, the commit the {base.name} "
                    f"form is made on: {differ}" if differ else ""
                )
                raise SeriesError(f"{label(path)} does not apply to {tree}{hint}:\n{out}")
    in_git = is_git_checkout(tree)
    for path in files:
        code, out = git_apply(tree, path) if in_git else run_patch(tree, path, dry_run=False)
        if code != 0:
            raise SeriesError(f"{label(path)} failed on {tree} after a clean rehearsal:\n{out}")
    print(f"applied {len(files)} patches ({base.name} form) to {tree}")


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


GIT_IDENT = ["-c", f"user.name={AUTHOR_NAME}", "-c", f"user.email={AUTHOR_EMAIL}"]


def git(repo, *args, check=True):
    proc = subprocess.run(["git", *GIT_IDENT, *args], cwd=repo, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} in {repo} failed:\n{proc.stdout}{proc.stderr}")
    return proc


def scratch_repo(tree, dest):
    """A git repository at `dest` whose HEAD is `tree` as it is: a shared clone of its HEAD
    where `tree` is a git checkout, else a one-commit repository of its files."""
    if is_git_checkout(tree):
        subprocess.run(["git", "clone", "-q", "--shared", str(tree), str(dest)], check=True)
    else:
        shutil.copytree(tree, dest, ignore=shutil.ignore_patterns("__pycache__"))
        git(dest, "init", "-q")
        git(dest, "add", "-A")
        git(dest, "commit", "-qm", "base", "--no-verify")
    return git(dest, "rev-parse", "HEAD").stdout.strip()


def git_am(repo, files, what):
    """`git am` each file in order on `repo` (no three-way merge: a patch applies as it is)."""
    for path in files:
        proc = git(repo, "am", "-q", "--keep-cr", str(path), check=False)
        if proc.returncode != 0:
            git(repo, "am", "--abort", check=False)
            raise SeriesError(f"{label(path)} does not apply with git am ({what}):\n{proc.stderr}")


def check_form(tree, base, cpu=()):
    """Check the base's form on a scratch repository of `tree` with git am: every pull request
    on the base plus its prerequisites, then all of them in order, then the CPU series."""
    prs = pull_requests()
    form = form_files(base)
    check_headers(form, cpu)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "tree"
        head = scratch_repo(tree, repo)
        for pr in prs:
            chain = with_prerequisites([pr.name])
            git(repo, "reset", "-q", "--hard", head)
            for link in chain:
                git_am(repo, pr_files(link, base), f"{pr.name} on the {base.name} base" + (
                    f" with {', '.join(p.name for p in chain[:-1])}" if len(chain) > 1 else ""))
            names = [p.name for p in chain[:-1]]
            print(f"ok  {pr.name} ({len(pr_files(pr, base))} patches) on the {base.name} base"
                  + (f" with {' + '.join(names)}" if names else ""), flush=True)
        git(repo, "reset", "-q", "--hard", head)
        git_am(repo, form, f"the {base.name} form in series order")
        git_am(repo, cpu, "the CPU series on the 0.19 form")
        for path in form + list(cpu):
            print(f"ok  {label(path)}", flush=True)
        for files in (form, list(cpu)):
            if files and not has_patch(repo, files[-1]):
                raise SeriesError(
                    f"a later patch changes the lines of {label(files[-1])}, the last of its "
                    "series, so 'apply' could no longer tell a patched tree"
                )
    return len(form)


def check_series(sdist, megatron=None):
    """Check the install form and the CPU series on the pristine sdist, and the form of the
    base of `megatron` (a Megatron-LM checkout) on it when given."""
    install = BASES[INSTALL_BASE]
    with tempfile.TemporaryDirectory() as tmp:
        tree = extract_sdist(sdist, Path(tmp) / "megatron-core")
        if recognise_base(tree) is not install:
            raise SeriesError(f"{sdist} is not the {install.name} base")
        count = check_form(tree, install, cpu_files())
    print(f"{install.name}: {count} upstream and {len(cpu_files())} CPU patches apply with git am "
          f"to {Path(sdist).name}")
    checked = {install.name}
    if megatron is not None:
        megatron = Path(megatron).resolve()
        base = recognise_base(megatron)
        if not is_git_checkout(megatron):
            raise SeriesError(f"{megatron} is not a git checkout: the {base.name} form is checked "
                              "with git am on its HEAD")
        count = check_form(megatron, base)
        commit = git(megatron, "rev-parse", "--short=10", "HEAD").stdout.strip()
        print(f"{base.name}: {count} patches apply with git am to {megatron} (HEAD {commit})")
        checked.add(base.name)
    for base in BASES.values():
        if base.name not in checked:
            print(f"{base.name}: NOT CHECKED (no Megatron-LM checkout of it given: make "
                  f"check-patches MEGATRON=/path/to/Megatron-LM at {base.commit[:10]})")


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
    version = ".".join(map(str, SDIST_VERSION))
    print(f"patched tree ready at {tree} (megatron-core {version}+{LOCAL_LABEL})")


def pr_tag(pr):
    return f"pr/{pr.name}"


def make_workspace(base, megatron_git, out):
    """A clone of a Megatron-LM history at the base's commit, the form as commits (a tag on
    each pull request's last one) and, for the 0.19 base, the CPU series after them."""
    out = Path(out).resolve()
    if out.exists():
        raise SeriesError(f"{out} exists; choose a new folder")
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(megatron_git), str(out)], check=True)
    git(out, "checkout", "-q", "-b", f"r3-{base.name}", base.commit)
    git(out, "tag", "-f", "base")
    for pr in pull_requests():
        git_am(out, pr_files(pr, base), f"{pr.name} in the workspace")
        git(out, "tag", "-f", pr_tag(pr))
    if base.cpu_series:
        git_am(out, cpu_files(), "the CPU series in the workspace")
    print(f"workspace ready at {out}: edit and commit (git commit -s), keep each tag pr/<name> "
          f"on its pull request's last commit, then 'tools/patch_series.py export --base "
          f"{base.name} {out}'")


def commit_series(repo, commit):
    """The series a commit belongs to: its 'Series:' trailer, none for upstream."""
    value = git(
        repo, "log", "-1", f"--format=%(trailers:key={SERIES_TRAILER},valueonly,separator=%x2C)",
        commit,
    ).stdout.strip()
    if value not in ("", CPU_SERIES):
        subject = git(repo, "log", "-1", "--format=%s", commit).stdout.strip()
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
    out = git(
        repo, "format-patch", "--no-signature", "--zero-commit", "--no-numbered",
        "--suffix=.diff", "-o", str(directory), revisions,
    ).stdout.split()
    names = [Path(p).name for p in out]
    (directory / "series").write_text("".join(n + "\n" for n in names))
    for name in names:
        check_header(directory / name, cpu)
    return names


def export_series(repo, base):
    """Rewrite the base's form of every pull request from the commits of `repo` after `base`
    (a tag pr/<name> on each pull request's last commit) and, for the 0.19 base, the CPU series
    from the commits after the last pull request."""
    repo = Path(repo)
    start = git(repo, "rev-parse", "base").stdout.strip()
    commits = git(repo, "rev-list", "--reverse", f"{start}..HEAD").stdout.split()
    previous = start
    for pr in pull_requests():
        tag = git(repo, "rev-parse", "-q", "--verify", f"{pr_tag(pr)}^{{commit}}", check=False)
        end = tag.stdout.strip()
        if not end or (end != start and end not in commits):
            raise SeriesError(
                f"tag {pr_tag(pr)} is missing or not on HEAD's history after 'base': tag the last "
                f"commit of {pr.name} (git tag -f {pr_tag(pr)} <commit>)"
            )
        span = git(repo, "rev-list", f"{previous}..{end}").stdout.split()
        if end != previous and git(repo, "merge-base", "--is-ancestor", previous, end,
                                    check=False).returncode != 0:
            raise SeriesError(f"tag {pr_tag(pr)} comes before the tag of the pull request "
                              "listed before it in patches/series")
        for commit in span:
            if commit_series(repo, commit) != "upstream":
                raise SeriesError(f"commit {commit[:10]} of {pr.name} is marked "
                                  f"'{SERIES_TRAILER}: {CPU_SERIES}'")
        directory = PATCH_DIR / pr.name / base.name
        names = write_series(repo, f"{previous}..{end}", directory, cpu=False) if span else []
        if not span:
            directory.mkdir(parents=True, exist_ok=True)
            for old in directory.glob("*.diff"):
                old.unlink()
            (directory / "series").write_text("")
        print(f"exported {len(names)} patches to {directory}")
        previous = end
    rest = git(repo, "rev-list", f"{previous}..HEAD").stdout.split()
    if rest and not base.cpu_series:
        raise SeriesError(f"{len(rest)} commits after the last pull request's tag: the "
                          f"{base.name} base has no CPU series; move the tags")
    if base.cpu_series:
        for commit in rest:
            if commit_series(repo, commit) != CPU_SERIES:
                subject = git(repo, "log", "-1", "--format=%s", commit).stdout.strip()
                raise SeriesError(
                    f"commit {commit[:10]} ({subject}) comes after the last pull request but "
                    f"lacks '{SERIES_TRAILER}: {CPU_SERIES}': move a tag pr/<name> to include "
                    "it, or mark it for the CPU series"
                )
        names = write_series(repo, f"{previous}..HEAD", PATCH_DIR / CPU_SERIES, cpu=True)
        print(f"exported {len(names)} patches to {PATCH_DIR / CPU_SERIES}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply")
    apply.add_argument("--cpu", action="store_true", help="the CPU series too (0.19 base)")
    apply.add_argument("tree")
    check = sub.add_parser("check")
    check.add_argument("sdist")
    check.add_argument("--megatron", help="a Megatron-LM git checkout: check its base's form")
    build = sub.add_parser("build")
    build.add_argument("sdist")
    build.add_argument("out")
    workspace = sub.add_parser("workspace")
    workspace.add_argument("--base", choices=sorted(BASES), required=True)
    workspace.add_argument("megatron_git")
    workspace.add_argument("out")
    export = sub.add_parser("export")
    export.add_argument("--base", choices=sorted(BASES), required=True)
    export.add_argument("repo")
    sub.add_parser("digest")
    sub.add_parser("base")
    args = parser.parse_args(argv)
    try:
        if args.command == "apply":
            apply_series(args.tree, cpu=args.cpu)
        elif args.command == "check":
            check_series(args.sdist, args.megatron)
        elif args.command == "build":
            build_tree(args.sdist, args.out)
        elif args.command == "workspace":
            make_workspace(BASES[args.base], args.megatron_git, args.out)
        elif args.command == "export":
            export_series(args.repo, BASES[args.base])
        elif args.command == "digest":
            print(series_digest())
        elif args.command == "base":
            print(".".join(map(str, SDIST_VERSION)), SDIST_NAME, SDIST_SHA256)
    except SeriesError as err:
        print(f"patch_series: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
