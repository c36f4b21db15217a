#!/usr/bin/env python3
"""Apply, check and build the Megatron-LM series (patches/megatron-lm/).

The core series (patches/, tools/patch_series.py) changes megatron-core; this one changes
what only a Megatron-LM checkout has: megatron/rl/, train_rl.py and the parts of the
inference engine the RL loop needs, so that `train_rl.py --moe-enable-routing-replay`
replays the routes its inference engine records (docs/megatron_rl.md). It is made on
Megatron-LM main (the core series' "main" base) on top of the core series' form for it,
one commit per patch, in `git format-patch` form with a `series` file.

Commands:
  apply [--only-main] CHECKOUT
                   apply the series to a Megatron-LM main checkout that has the core
                   series' main form (make patch applies both); a rehearsal first, then
                   `git apply`; refuses another base or a patched tree (--only-main: says
                   so and succeeds where the tree is no Megatron-LM main checkout).
  check [--megatron GIT] [--python PY]
                   on a scratch clone of Megatron-LM main: `git am --3way` of the core
                   series' main form, then of this series; byte-compile every file the series
                   touches; with --python, collect tests/unit_tests/rl with that interpreter.
  checkout [--megatron GIT] [--pristine] DIR
                   DIR: the files of Megatron-LM main (no .git, no functional tests, docs or
                   images) with the core series' main form and this series applied: what
                   launch/train_rl_r3.sh runs (--pristine: the same files without either series).
  compare-rl-tests --python PY [--nproc N] [--out DIR] PRISTINE PATCHED
                   run tests/unit_tests/rl in both trees (pytest with PY, from each tree's root;
                   --nproc N: under torch.distributed.run with N ranks, as Megatron-LM's CI runs
                   its unit tests, so the multi-rank cases run too) and compare them test by
                   test; a test that kills its rank (a device-side assert) is "crashed" and the
                   run goes on after it (tools/upstream_tests.py's runner); fails where a test
                   that passes on PRISTINE does not on PATCHED, or is missing there. Each test
                   whose outcome differs then runs again alone (a launch of its own) in both
                   trees: a test run after a device-side assert in the same process meets a
                   broken CUDA context, which is not its own outcome. --out DIR keeps each
                   side's per-rank records and launch logs.
  workspace GIT DIR
                   DIR: a clone of Megatron-LM main with the core series (tag core-r3) and
                   this series as commits: edit, commit, then 'export DIR'.
  export DIR       rewrite the series from core-r3..HEAD of a workspace.
  extract PATH OUT write the file PATH as the series leaves it (a file the series creates)
                   under OUT: what CPU tests import without a Megatron-LM checkout.
"""

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERIES_DIR = ROOT / "patches" / "megatron-lm"
CORE_TAG = "core-r3"
# The default Megatron-LM git repository for check: the fetched mirror of this workplace.
DEFAULT_MEGATRON_GIT = "/work/.mirror/NVIDIA+Megatron-LM/repo"
RL_TESTS = "tests/unit_tests/rl"
EXCLUDED = [":!tests/functional_tests", ":!docs", ":!images"]


class SeriesError(RuntimeError):
    """A user-facing failure: printed without a traceback."""


def _tool(name):
    """tools/<name>.py as a module: patch_series (the core series and its bases), upstream_tests (the runner
    of Megatron's unit tests pristine and patched under torchrun)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def series_files():
    """The Megatron-LM series, in apply order (patches/megatron-lm/series)."""
    series = SERIES_DIR / "series"
    if not series.is_file():
        raise SeriesError(f"{series} is missing")
    names = [line.strip() for line in series.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    files = [SERIES_DIR / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise SeriesError(f"patches/megatron-lm/series names files that do not exist: {missing}")
    for path in files:
        head = path.read_text().split("\n---\n", 1)[0]
        if "Subject: " not in head or "Why:" not in head or "What:" not in head:
            raise SeriesError(f"{path.name}: the header must have a Subject and say 'Why:' and 'What:'")
    return files


def core_main_form():
    """The core series' form for Megatron-LM main, and the commit it is made on."""
    core = _tool("patch_series")
    if not hasattr(core, "form_files") or "main" not in getattr(core, "BASES", {}):
        raise SeriesError("the core series in patches/ has no form for Megatron-LM main "
                          "(tools/patch_series.py has no 'main' base)")
    base = core.BASES["main"]
    return core.form_files(base), base.commit


def git(repo, *args, check=True):
    ident = ["-c", "user.name=megatron-r3 maintainers", "-c", "user.email=maintainers@megatron-r3.dev"]
    proc = subprocess.run(["git", *ident, *args], cwd=repo, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} in {repo} failed:\n{proc.stdout}{proc.stderr}")
    return proc


def am(repo, files, what):
    """`git am --3way` each patch in order; on failure abort and name the patch."""
    for path in files:
        proc = git(repo, "am", "-q", "--3way", "--keep-cr", str(path), check=False)
        if proc.returncode != 0:
            git(repo, "am", "--abort", check=False)
            raise SeriesError(f"{path.name} ({what}) does not apply with git am --3way:\n{proc.stderr}")


def touched_files(files):
    """Paths the series' patches create or change, in first-touch order."""
    seen = []
    for path in files:
        for line in path.read_text().splitlines():
            if line.startswith("diff --git a/"):
                name = line.split(" b/", 1)[1]
                if name not in seen:
                    seen.append(name)
    return seen


def is_megatron_lm_main(tree):
    """Whether ``tree`` is a Megatron-LM checkout (train_rl.py) of the core series' main base."""
    core = _tool("patch_series")
    return (tree / "train_rl.py").is_file() and core.tree_version(tree) in core.BASES["main"].versions


def apply_series(tree, only_main=False):
    """Apply the series to a Megatron-LM main checkout that has the core series' main form."""
    tree = Path(tree).resolve()
    if only_main and not is_megatron_lm_main(tree):
        print(f"{tree} is no Megatron-LM main checkout: the Megatron-LM series (patches/megatron-lm/) "
              "is made on main only, not applied")
        return
    if not is_megatron_lm_main(tree):
        raise SeriesError(f"{tree} is not a Megatron-LM main checkout (train_rl.py and Megatron-Core "
                          "0.20.0): the Megatron-LM series is made on main only")
    files = series_files()
    core_files, _ = core_main_form()
    if git(tree, "apply", "--check", "--reverse", str(core_files[-1]), check=False).returncode != 0:
        raise SeriesError(f"{tree} lacks the core series: apply it first (make patch MEGATRON={tree})")
    if git(tree, "apply", "--check", "--reverse", str(files[-1]), check=False).returncode == 0:
        raise SeriesError(f"{tree} already has the Megatron-LM series applied")
    with tempfile.TemporaryDirectory() as scratch:
        # Rehearse on a copy of the files the series touches: later patches build on earlier ones.
        for name in touched_files(files):
            if (tree / name).is_file():
                (Path(scratch) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / name, Path(scratch) / name)
        for path in files:
            proc = subprocess.run(["git", "apply", str(path)], cwd=scratch, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SeriesError(f"{path.name} does not apply to {tree}:\n{proc.stderr}")
    for path in files:
        git(tree, "apply", str(path))
    print(f"applied {len(files)} Megatron-LM patches to {tree}")


def patched_clone(megatron_git, scratch):
    """A clone of Megatron-LM main under ``scratch`` with the core series' main form (tagged
    core-r3) and this series as commits (``git am --3way``); returns it and the base commit."""
    core_files, commit = core_main_form()
    repo = Path(scratch) / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(megatron_git), str(repo)], check=True)
    git(repo, "checkout", "-q", "-b", "megatron-lm-r3", commit)
    am(repo, core_files, "core series, main form")
    git(repo, "tag", "-f", CORE_TAG)
    am(repo, series_files(), "Megatron-LM series")
    return repo, commit


def collect_rl_tests(repo, python):
    """The test ids ``pytest --collect-only`` finds under tests/unit_tests/rl of ``repo``'s work tree."""
    proc = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", RL_TESTS],
                          cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"{RL_TESTS} does not collect in {repo}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
    return [line for line in proc.stdout.splitlines() if "::" in line]


def check_series(megatron_git, python=None):
    """git am --3way of both series on a scratch clone of Megatron-LM main; compile; with ``python``,
    collect the RL unit tests pristine (the base commit) and patched."""
    files = series_files()
    with tempfile.TemporaryDirectory() as scratch:
        repo, commit = patched_clone(megatron_git, scratch)
        print(f"ok  git am --3way: the core series' main form and {len(files)} Megatron-LM patches on {commit[:10]}",
              flush=True)
        sources = [name for name in touched_files(files) if name.endswith(".py")]
        proc = subprocess.run([sys.executable, "-m", "py_compile", *sources], cwd=repo,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SeriesError(f"the patched files do not compile:\n{proc.stderr}")
        print(f"ok  {len(sources)} patched Python files compile", flush=True)
        if python is not None:
            patched = collect_rl_tests(repo, python)
            git(repo, "checkout", "-q", commit)
            pristine = collect_rl_tests(repo, python)
            lost = sorted(set(pristine) - set(patched))
            if lost:
                raise SeriesError(f"{RL_TESTS}: the patched tree loses {len(lost)} tests the pristine one "
                                  f"collects, first {lost[:5]}")
            print(f"ok  {RL_TESTS} collects {len(pristine)} tests pristine and {len(patched)} patched "
                  "(every pristine one among them)")


def make_checkout(megatron_git, out, pristine=False):
    """``out``: Megatron-LM main's files with both series (``pristine``: without them), without git
    history (unpacked beside ``out``, then renamed into place)."""
    out = Path(out).resolve()
    if out.exists():
        raise SeriesError(f"{out} exists: remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryDirectory(dir=out.parent) as staging:
        if pristine:
            repo, commit = Path(megatron_git), core_main_form()[1]
        else:
            repo, commit = patched_clone(megatron_git, scratch)
        # Without the functional tests, docs and images (50 MB of the 69): small enough to carry.
        archive = subprocess.run(["git", "archive", "--format=tar", commit if pristine else "HEAD", "--", ".",
                                  *EXCLUDED], cwd=repo, capture_output=True, check=True)
        tree = Path(staging) / out.name
        tree.mkdir()
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        tree.rename(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    what = "pristine" if pristine else "with both series"
    print(f"Megatron-LM {commit[:10]} {what} at {out} ({size / 2**20:.0f} MiB)")


# A test still running this long is recorded as a timeout and its side goes on after it (a new launch);
# a side's whole run stops after SIDE_SECONDS (Megatron-LM's RL tests take about 70 s a side on an H200).
TEST_SECONDS, SIDE_SECONDS = 600.0, 3600.0


def rl_test_outcomes(name, tree, python, out, nproc=1, targets=(RL_TESTS,)):
    """Each test of ``targets`` (tests/unit_tests/rl) in ``tree`` -> its row (``load_side``'s: the pytest id
    and the outcome, the worst over ``nproc`` ranks: passed, failed, error, skipped, crashed, timeout, ...).
    tools/upstream_tests.py's runner runs them from the tree's root (its megatron is the one imported; a test
    is named alike in either tree), launch after launch past a test that kills its rank (a device-side assert
    aborts the process): that test is ``crashed``, the others still run. Its records and logs go under
    ``out``/``name``."""
    runner = _tool("upstream_tests")
    tree = Path(tree).resolve()
    args = argparse.Namespace(python=python, nproc=nproc, launcher="torchrun" if nproc > 1 else "plain",
                              timeout=TEST_SECONDS, grace=30.0, side_timeout=SIDE_SECONDS, all_sizes=True,
                              k=None, pytest_args=[])
    try:
        timeout_plugin = "pytest_timeout" not in runner.missing_modules(python, ["pytest_timeout"], tree)
    except runner.ToolError as err:
        raise SeriesError(str(err)) from err
    side_out = Path(out) / name
    side_out.mkdir(parents=True)
    try:
        status = runner.run_side(name, tree, list(targets), args, side_out, timeout_plugin)
    finally:  # the runner's plugin, copied into the tree's root for the run
        (tree / f"{runner.PLUGIN_NAME}.py").unlink(missing_ok=True)
    if status != "finished":
        raise SeriesError(f"{name} ({tree}): {status}")
    return runner.load_side(side_out)


COUNTED = ("passed", "failed", "error", "skipped")
# Tests whose outcomes differ run again alone, this many at most (each is a launch per tree).
ALONE_AT_MOST = 8


def compare_rl_tests(python, pristine, patched, nproc=1, out=None):
    """Run the RL unit tests in both trees (on ``nproc`` ranks; records and logs under ``out``, else a
    scratch folder); print the counts and every test whose outcome differs, with its outcomes when it runs
    alone in each tree; refuse a test that passes pristine and not patched."""
    if nproc < 1:
        raise SeriesError(f"--nproc {nproc}: give 1 or more ranks")
    if out and Path(out).exists():
        raise SeriesError(f"--out {out} exists: give a new folder")
    trees = {"pristine": pristine, "patched": patched}
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(out) if out else Path(scratch)
        rows = {name: rl_test_outcomes(name, tree, python, where, nproc) for name, tree in trees.items()}
        sides = {name: {test: row["outcome"] for test, row in side.items()} for name, side in rows.items()}
        for name, outcomes in sides.items():
            counts = Counter(outcomes.values())
            others = sorted(set(counts) - set(COUNTED))  # crashed, timeout, xfailed, ...: said where there are any
            print(f"{name}: " + ", ".join(f"{counts[k]} {k}" for k in (*COUNTED, *others)))
        before, after = sides["pristine"], sides["patched"]
        differ = sorted(t for t in before.keys() | after.keys() if before.get(t) != after.get(t))
        in_both = [t for t in differ if t in before and t in after]
        alone = {}
        for index, test in enumerate(in_both[:ALONE_AT_MOST]):
            alone[test] = {}
            for name, tree in trees.items():
                side = rl_test_outcomes(f"{name}-alone-{index}", tree, python, where, nproc,
                                        targets=[rows[name][test]["id"]])
                alone[test][name] = side.get(test, {}).get("outcome", "not run")
    for test in differ:
        ran_alone = (f"; alone: pristine {alone[test]['pristine']}, patched {alone[test]['patched']}"
                     if test in alone else "")
        print(f"  {test}: pristine {before.get(test, 'absent')}, patched {after.get(test, 'absent')}{ran_alone}")
    if len(in_both) > ALONE_AT_MOST:
        print(f"  ({len(in_both) - ALONE_AT_MOST} more tests differ than ran alone)")
    lost = [t for t in differ if before.get(t) == "passed"]
    if lost:
        raise SeriesError(f"{len(lost)} tests pass pristine and not patched, first {lost[:5]}")
    same_alone = sum(outcomes["pristine"] == outcomes["patched"] for outcomes in alone.values())
    print(f"ok  {len(differ)} tests differ, none passing pristine only"
          + (f"; run alone, {same_alone} of {len(alone)} have the same outcome in both trees" if alone else ""))


def make_workspace(megatron_git, out):
    with tempfile.TemporaryDirectory() as scratch:
        repo, _ = patched_clone(megatron_git, scratch)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(repo), out)
    print(f"workspace ready at {out}: edit, commit, then 'tools/megatron_lm_series.py export {out}'")


def export_series(repo):
    repo = Path(repo)
    SERIES_DIR.mkdir(parents=True, exist_ok=True)
    for old in SERIES_DIR.glob("*.diff"):
        old.unlink()
    out = git(repo, "format-patch", "--no-signature", "--zero-commit", "--no-numbered", "--suffix=.diff",
              "-o", str(SERIES_DIR), f"{CORE_TAG}..HEAD").stdout.split()
    names = [Path(p).name for p in out]
    (SERIES_DIR / "series").write_text("".join(n + "\n" for n in names))
    series_files()
    print(f"exported {len(names)} patches to {SERIES_DIR}")


def extract(path, out):
    """Write ``path`` as the series leaves it under ``out`` (it must be a file the series creates)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    touching = [f for f in series_files() if f"diff --git a/{path} b/{path}" in f.read_text()]
    if not touching or f"--- /dev/null\n+++ b/{path}\n" not in touching[0].read_text():
        raise SeriesError(f"the Megatron-LM series does not create {path}")
    proc = subprocess.run(["git", "apply", f"--include={path}", *map(str, touching)], cwd=out,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"cannot extract {path} from the series:\n{proc.stderr}")
    return out / path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply")
    apply.add_argument("--only-main", action="store_true", help="skip a tree that is no Megatron-LM main checkout")
    apply.add_argument("checkout")
    check = sub.add_parser("check")
    check.add_argument("--megatron", default=DEFAULT_MEGATRON_GIT, help="a Megatron-LM git repository")
    check.add_argument("--python", help="collect tests/unit_tests/rl with this interpreter")
    workspace = sub.add_parser("workspace")
    workspace.add_argument("megatron_git")
    workspace.add_argument("out")
    checkout = sub.add_parser("checkout")
    checkout.add_argument("--megatron", default=DEFAULT_MEGATRON_GIT, help="a Megatron-LM git repository")
    checkout.add_argument("--pristine", action="store_true", help="without either series")
    checkout.add_argument("out")
    compare = sub.add_parser("compare-rl-tests")
    compare.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest in both trees")
    compare.add_argument("--nproc", type=int, default=1,
                         help="ranks to run the tests on (torch.distributed.run), one GPU each on a GPU node")
    compare.add_argument("--out", help="keep each side's per-rank records and launch logs here (a new folder)")
    compare.add_argument("pristine")
    compare.add_argument("patched")
    sub.add_parser("export").add_argument("repo")
    ext = sub.add_parser("extract")
    ext.add_argument("path")
    ext.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.command == "apply":
            apply_series(args.checkout, args.only_main)
        elif args.command == "check":
            check_series(args.megatron, args.python)
        elif args.command == "checkout":
            make_checkout(args.megatron, args.out, args.pristine)
        elif args.command == "compare-rl-tests":
            compare_rl_tests(args.python, args.pristine, args.patched, args.nproc, args.out)
        elif args.command == "workspace":
            make_workspace(args.megatron_git, args.out)
        elif args.command == "export":
            export_series(args.repo)
        elif args.command == "extract":
            print(extract(args.path, args.out))
    except SeriesError as err:
        print(f"megatron_lm_series: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
