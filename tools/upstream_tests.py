#!/usr/bin/env python3
"""Run Megatron-LM's own unit tests, and the series' own, on the pristine and on the patched
megatron-core.

Two steps, on two machines:

  prepare   (any machine, no GPU needed) builds a self-contained bundle folder for one base
            of the series (--base), git-ignored, with two run roots:

              --base 0.19 (build/upstream-tests/):
                pristine/  megatron/ of the megatron-core 0.19.2 sdist (core + training)
                patched/   the same with patches/ applied (tools/patch_series.py build)
              --base main (build/upstream-tests-main/):
                pristine/  megatron/ of Megatron-LM main at the pinned commit
                patched/   the same with the main form of every pull request applied

            and, identically in both, the chosen test files of Megatron-LM's tests/ (at tag
            core_v0.19.0, or main's pinned commit), the series' own tests (the test files its
            patches add, taken from the patched tree: they fail on pristine, as expected),
            every tests.* module, conftest.py and __init__.py they import, the top-level
            megatron packages they import that the side lacks, a pytest.ini with upstream's
            markers, and this tool's pytest plugin. A manifest (manifest.json) records the
            sources, commits, file lists, sizes and the third-party modules the tests import.

  run       (the GPU machine) runs, for each side, from that side's root
              torchrun --standalone --nproc-per-node N -m pytest <files> -p no:cacheprovider
                       --timeout T --junitxml ...
            so `import megatron.core` resolves to that side's tree (checked and printed per
            rank). Progress is printed as tests finish. A test still running T + grace seconds
            after it started is recorded as `timeout` by name and its rank exits; the side
            then goes on with the tests after it (a new torchrun), within the side's overall
            budget (--side-timeout). Both sides' results go side by side into
            comparison.md and comparison.json, differences first; the series' own tests
            get a table of their own (a test that fails on pristine and passes patched is
            expected there).

  compare   rebuilds the comparison from the results folders of a run (or from junit XML
            files alone).

Examples:
  tools/upstream_tests.py prepare                         # mirror + tag found, default lists
  tools/upstream_tests.py prepare --base main             # Megatron-LM main's tests and core
  tools/upstream_tests.py prepare --megatron ~/Megatron-LM --lists moe extra
  tools/upstream_tests.py run --nproc 2 --export "$OUT"   # on the GPU machine
  tools/upstream_tests.py run --base main --nproc 2       # the main bundle
"""

import argparse
import ast
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import patch_series  # noqa: E402  (the series' bases and forms)

sys.path.pop(0)
BASES = ("0.19", "main")
DEFAULT_BUNDLES = {
    "0.19": ROOT / "build" / "upstream-tests",
    "main": ROOT / "build" / "upstream-tests-main",
}
DEFAULT_BUNDLE = DEFAULT_BUNDLES["0.19"]
# The revision of Megatron-LM the tests come from, by base: the tag nearest the 0.19.2 release,
# and the main commit the main form is made on.
DEFAULT_REVS = {"0.19": "core_v0.19.0", "main": patch_series.MAIN_COMMIT}
PLUGIN_SOURCE = Path(__file__).resolve().parent / "upstream_tests_plugin.py"
PLUGIN_NAME = "r3_upstream_plugin"
STUBS_SOURCE = Path(__file__).resolve().parent / "upstream_tests_stubs"
SIDES = ("pristine", "patched")
# Where a Megatron-LM checkout (or its git history) is looked for when none is given.
CHECKOUT_CANDIDATES = (
    ROOT / "build" / "Megatron-LM",
    ROOT.parent / "Megatron-LM",
    Path("/work/.mirror/NVIDIA+Megatron-LM/repo"),
)
BUNDLE_SIZE_LIMIT = 40 * 1024 * 1024

# The default test files, by list. "moe" comes first; "extra" covers the other parts of
# megatron-core the series touches (schedules, DDP, optimizer, RNG, rope, checkpointing).
TEST_LISTS = {
    "moe": [
        "tests/unit_tests/transformer/moe/",
    ],
    "extra": [
        "tests/unit_tests/pipeline_parallel/test_schedules.py",
        "tests/unit_tests/distributed/test_distributed_data_parallel.py",
        "tests/unit_tests/distributed/test_param_and_grad_buffer.py",
        "tests/unit_tests/distributed/test_finalize_model_grads.py",
        "tests/unit_tests/distributed/test_grad_sync_with_expert_parallel.py",
        "tests/unit_tests/test_optimizer.py",
        "tests/unit_tests/optimizer/test_clip_grads.py",
        "tests/unit_tests/test_local_multi_tensor_fns.py",
        "tests/unit_tests/tensor_parallel/test_random.py",
        "tests/unit_tests/tensor_parallel/test_mappings.py",
        "tests/unit_tests/tensor_parallel/test_layers.py",
        "tests/unit_tests/transformer/test_rope.py",
        "tests/unit_tests/transformer/test_transformer_block.py",
        "tests/unit_tests/transformer/test_multi_token_prediction.py",
        "tests/unit_tests/models/test_gpt_model.py",
        "tests/unit_tests/fusions/test_torch_softmax.py",
        "tests/unit_tests/dist_checkpointing/test_optimizer.py",
        "tests/unit_tests/dist_checkpointing/test_async_save.py",
        "tests/unit_tests/dist_checkpointing/models/test_moe_experts.py",
    ],
}
# "series": the series' own tests, the test files its patches add or change (found in the base's
# form at prepare and listed in the manifest as series_tests).
TEST_LISTS["series"] = []
DEFAULT_LISTS = ("moe", "extra", "series")

# Outcomes, worst first: a test's outcome over ranks is the first one any rank had.
OUTCOME_ORDER = ("timeout", "crashed", "error", "failed", "xpassed", "passed", "xfailed",
                 "skipped", "not run")


class ToolError(RuntimeError):
    """A user-facing failure: printed without a traceback."""


def log(msg):
    print(f"[upstream-tests] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# Sources of Megatron-LM files: a checkout folder or a git history at a tag.


class DirSource:
    """Files of a Megatron-LM checkout folder."""

    def __init__(self, path):
        self.path = Path(path).resolve()
        self.rev = None
        self.commit = _git_out(["rev-parse", "HEAD"], cwd=self.path)
        self._files = None

    def describe(self):
        return f"checkout {self.path}" + (f" (commit {self.commit})" if self.commit else "")

    def files(self):
        if self._files is None:
            out = []
            for base in ("tests", "megatron"):
                top = self.path / base
                if top.is_dir():
                    for p in top.rglob("*"):
                        if p.is_file() and "__pycache__" not in p.parts:
                            out.append(p.relative_to(self.path).as_posix())
            for p in self.path.iterdir():
                if p.is_file():
                    out.append(p.name)
            self._files = set(out)
        return self._files

    def read(self, rel):
        return (self.path / rel).read_bytes()

    def extract(self, folder, dest):
        """Copy `folder` of the checkout to dest/folder."""
        shutil.copytree(self.path / folder, Path(dest) / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))


class GitSource:
    """Files of a git history (bare or not) at one revision."""

    def __init__(self, gitdir, rev):
        self.gitdir = Path(gitdir).resolve()
        self.rev = rev
        self.commit = _git_out(["rev-parse", f"{rev}^{{commit}}"], gitdir=self.gitdir)
        if not self.commit:
            raise ToolError(f"{self.gitdir} has no revision {rev!r} (git tag -l there lists tags)")
        self._files = None

    def describe(self):
        return f"git {self.gitdir} at {self.rev} (commit {self.commit})"

    def files(self):
        if self._files is None:
            out = _git_out(["ls-tree", "-r", "--name-only", self.commit], gitdir=self.gitdir)
            self._files = set(out.splitlines())
        return self._files

    def read(self, rel):
        proc = subprocess.run(
            ["git", "--git-dir", str(self.gitdir), "show", f"{self.commit}:{rel}"],
            capture_output=True,
        )
        if proc.returncode != 0:
            raise ToolError(f"cannot read {rel} at {self.rev}: {proc.stderr.decode().strip()}")
        return proc.stdout

    def extract(self, folder, dest):
        """Write `folder` at the revision to dest/folder (git archive)."""
        Path(dest).mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "--git-dir", str(self.gitdir), "archive", self.commit, folder],
            capture_output=True,
        )
        if archive.returncode != 0:
            raise ToolError(f"cannot export {folder} at {self.rev}: {archive.stderr.decode()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, filter="data")


def _git_out(args, cwd=None, gitdir=None):
    cmd = ["git"] + (["--git-dir", str(gitdir)] if gitdir else []) + args
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _is_git_history(path):
    return bool(_git_out(["rev-parse", "--git-dir"], gitdir=path)) and not (
        Path(path) / "megatron" / "core"
    ).is_dir()


def open_source(megatron=None, tag=None, base="0.19"):
    """The Megatron-LM source to take tests from: the given path, else the first candidate.

    For the 0.19 base a checkout is used as it is. The main base's core comes from the source
    too, so it must be the commit the main form is made on: a git history at that commit.
    """
    rev = tag or DEFAULT_REVS[base]
    pinned = base == "main"
    if megatron:
        path = Path(megatron).expanduser()
        if not path.exists():
            raise ToolError(f"--megatron {path}: no such folder")
        if (path / "tests" / "unit_tests").is_dir() and not tag and not pinned:
            return DirSource(path)
        if _is_git_history(path) or tag or (path / ".git").exists():
            gitdir = path if _is_git_history(path) else path / ".git"
            return _checked(GitSource(gitdir, rev), base)
        raise ToolError(f"--megatron {path} is neither a Megatron-LM checkout nor its git history")
    for cand in CHECKOUT_CANDIDATES:
        if (cand / "tests" / "unit_tests").is_dir():
            if tag or pinned:
                return _checked(GitSource(cand / ".git", rev), base)
            return DirSource(cand)
        if cand.exists() and _is_git_history(cand):
            return _checked(GitSource(cand, rev), base)
    raise ToolError(
        f"no Megatron-LM checkout found. Put one (`git clone https://github.com/NVIDIA/Megatron-LM`"
        f"; the {base} base's tests are at {rev}) at {CHECKOUT_CANDIDATES[0]}, or pass "
        "--megatron PATH (a checkout, or a git history with --tag)"
    )


def _checked(source, base):
    """The main base's source must be the commit its form is made on."""
    if base == "main" and source.commit != patch_series.MAIN_COMMIT:
        raise ToolError(
            f"{source.describe()} is not Megatron-LM main at {patch_series.MAIN_COMMIT[:10]}, "
            "the commit the main form is made on (leave --tag out)"
        )
    return source


class OverlaySource:
    """A source with some files replaced or added (the series' own tests, from the patched
    tree), so their imports are followed like those of upstream's tests."""

    def __init__(self, source, extra):
        self.source, self.extra = source, dict(extra)
        self.rev, self.commit = source.rev, source.commit

    def describe(self):
        return self.source.describe()

    def files(self):
        return self.source.files() | set(self.extra)

    def read(self, rel):
        return self.extra[rel] if rel in self.extra else self.source.read(rel)


def series_tests(base, prs=None):
    """The test files the base's form of the series (`prs`: of those pull requests and their
    prerequisites) adds or changes, in apply order."""
    out = []
    for path in patch_series.form_files(patch_series.BASES[base], prs):
        for rel in re.findall(r"^diff --git a/(tests/\S+\.py) b/", path.read_text(), re.M):
            if Path(rel).name.startswith("test_") and rel not in out:
                out.append(rel)
    return out


# --------------------------------------------------------------------------------------
# Which files the tests need.


def expand_tests(source, entries):
    """Test files named by `entries` (files or folders, repository-relative), in order."""
    files = source.files()
    out = []
    for entry in entries:
        entry = entry.strip().rstrip("/")
        if entry in files:
            out.append(entry)
            continue
        found = sorted(
            f for f in files
            if f.startswith(entry + "/") and Path(f).name.startswith("test_") and f.endswith(".py")
        )
        if not found:
            raise ToolError(f"{entry}: no such test file or folder in {source.describe()}")
        out.extend(found)
    seen = set()
    return [f for f in out if not (f in seen or seen.add(f))]


def module_file(files, module):
    """The repository file of a dotted module name, or None."""
    base = module.replace(".", "/")
    for cand in (base + ".py", base + "/__init__.py"):
        if cand in files:
            return cand
    return None


def imported_modules(text, rel):
    """Absolute names of the modules a file imports (anywhere in it), and pytest_plugins."""
    tree = ast.parse(text, filename=rel)
    package = rel[: -len(".py")].replace("/", ".")
    if not rel.endswith("__init__.py"):
        package = package.rsplit(".", 1)[0]
    else:
        package = package[: -len(".__init__")]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.append(mod)
            names.extend(f"{mod}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets):
                for const in ast.walk(node.value):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        names.append(const.value)
    return [n for n in names if n]


def parent_inits(files, rel):
    """The __init__.py files of the packages above `rel`."""
    out = []
    parts = rel.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        init = "/".join(parts[:i]) + "/__init__.py"
        if init in files:
            out.append(init)
    return out


def conftests(files, rel):
    """conftest.py files in the folders from the repository root down to `rel`'s."""
    parts = rel.split("/")[:-1]
    out = []
    for i in range(0, len(parts) + 1):
        cand = "/".join(parts[:i] + ["conftest.py"])
        if cand in files:
            out.append(cand)
    return out


def resolve_needs(source, test_files, side_packages, side_files=None):
    """Every file the tests need from `source`, beside the sides' own megatron packages.

    Follows imports (at any depth of a file, lazy ones too) from the test files and their
    conftest.py files through tests.* modules and through megatron top-level packages that
    the sides lack (`side_packages` holds the ones they have, e.g. {'core', 'training'}),
    which are copied whole. `side_files` ({path: text}: the sides' own megatron/training, say)
    are scanned for imports too, but not copied. Returns (files, extra megatron packages,
    third-party top-level modules, unresolved tests.* modules).
    """
    files = source.files()
    dirs = {f.rsplit("/", 1)[0] for f in files if "/" in f}
    stdlib = set(getattr(sys, "stdlib_module_names", ()))
    needed, queue = [], []
    extra_packages, third_party, unresolved = set(), set(), set()

    def add(rel):
        if rel not in needed:
            needed.append(rel)
            queue.append(rel)

    for rel in test_files:
        add(rel)
        for other in parent_inits(files, rel) + conftests(files, rel):
            add(other)
    side_files = dict(side_files or {})
    queue.extend(sorted(side_files))
    while queue:
        rel = queue.pop(0)
        if not rel.endswith(".py"):
            continue
        try:
            text = side_files[rel] if rel in side_files else source.read(rel).decode()
            mods = imported_modules(text, rel)
        except (SyntaxError, UnicodeDecodeError) as err:
            raise ToolError(f"cannot parse {rel}: {err}") from err
        for mod in mods:
            top = mod.split(".")[0]
            if top == "tests":
                target = module_file(files, mod)
                if target is None:
                    # `from tests.a import name`: `tests.a.name` is an attribute, not a module;
                    # a folder without __init__.py is a namespace package.
                    parent = mod.rsplit(".", 1)[0]
                    if mod.replace(".", "/") not in dirs and module_file(files, parent) is None:
                        unresolved.add(mod)
                    continue
                add(target)
                for init in parent_inits(files, target):
                    add(init)
            elif top == "megatron":
                parts = mod.split(".")
                if len(parts) < 2 or parts[1] in side_packages:
                    continue
                pkg = parts[1]
                if pkg in extra_packages:
                    continue
                prefix = f"megatron/{pkg}/"
                members = sorted(f for f in files if f.startswith(prefix))
                if not members and f"megatron/{pkg}.py" not in files:
                    continue  # an attribute of megatron/__init__ or a missing module: not ours
                extra_packages.add(pkg)
                for member in members or [f"megatron/{pkg}.py"]:
                    if "__pycache__" not in member:
                        add(member)
            elif rel in side_files:
                continue  # the sides' own third-party needs are megatron-core's, not the tests'
            elif top and top not in stdlib and top not in ("__future__",):
                # A module at the top of the Megatron-LM repository (gpt_builders.py, tools/...)
                # travels like a tests.* module; anything else is a third-party module.
                target = module_file(files, mod) or module_file(files, mod.rsplit(".", 1)[0])
                if target is None and module_file(files, top) is not None:
                    target = module_file(files, top)
                if target is None:
                    if not rel.startswith("megatron/"):  # the tests' needs, not megatron's
                        third_party.add(top)
                    continue
                add(target)
                for init in parent_inits(files, target):
                    add(init)
    if "megatron/__init__.py" in files and extra_packages:
        add("megatron/__init__.py")
    return needed, sorted(extra_packages), sorted(third_party), sorted(unresolved)


def pytest_ini(source):
    """A pytest.ini for the run roots: upstream's markers, nothing from parent folders."""
    markers = []
    if "pyproject.toml" in source.files():
        try:
            import tomllib

            data = tomllib.loads(source.read("pyproject.toml").decode())
            opts = data.get("tool", {}).get("pytest", {}).get("ini_options", {})
            markers = list(opts.get("markers", []))
        except Exception:  # an old Python without tomllib, or a pyproject we cannot read
            markers = []
    lines = [
        "# Written by tools/upstream_tests.py prepare. It keeps pytest from reading the",
        "# configuration of a parent folder; the markers are upstream's (pyproject.toml).",
        "[pytest]",
        "python_files = test_*.py",
    ]
    if markers:
        lines.append("markers =")
        lines.extend(f"    {m}" for m in markers)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# prepare


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_megatron(src_megatron, dest_megatron):
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.egg-info")
    shutil.copytree(src_megatron, dest_megatron, ignore=ignore)


def _tree_size(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _package_version(tree):
    text = (Path(tree) / "megatron" / "core" / "package_info.py").read_text()
    nums = [re.search(rf"^{n} = (\d+)", text, re.M) for n in ("MAJOR", "MINOR", "PATCH")]
    version = ".".join(m.group(1) for m in nums if m)
    return version + ("+r3" if "'+r3'" in text else "")


def given_patched_tree(patched):
    """The --patched tree, resolved, or an error if it holds no megatron/core."""
    patched = Path(patched).resolve()
    if not (patched / "megatron" / "core").is_dir():
        raise ToolError(f"--patched {patched}: no megatron/core inside")
    return patched


def side_trees(sdist, patched, scratch):
    """Folders holding megatron/ of the pristine sdist and of the patched tree (0.19 base)."""
    sdist = Path(sdist)
    if not sdist.is_file():
        raise ToolError(
            f"no pristine sdist at {sdist}: `make check-patches` downloads it to build/, or pass "
            f"--sdist PATH ({patch_series.SDIST_NAME})"
        )
    digest = _sha256(sdist)
    if sdist.name == patch_series.SDIST_NAME and digest != patch_series.SDIST_SHA256:
        raise ToolError(f"{sdist} has sha256 {digest}, not the pinned {patch_series.SDIST_SHA256}")
    pristine = patch_series.extract_sdist(sdist, Path(scratch) / "pristine")
    if patched:
        patched = given_patched_tree(patched)
        built_here = False
    else:
        patched = Path(scratch) / "patched"
        try:
            patch_series.build_tree(sdist, patched)
        except patch_series.SeriesError as err:
            raise ToolError(f"building the patched tree: {err}") from err
        built_here = True
    if "+r3" not in _package_version(patched):
        raise ToolError(f"{patched} does not say +r3 in its package_info: not a patched tree")
    return pristine, patched, {
        "pristine_tree": str(sdist), "sdist_sha256": digest,
        "series_digest": patch_series.series_digest(),
        "patched_tree": "built from the sdist and patches/" if built_here else str(patched),
    }


def main_side_trees(source, patched, scratch, prs=None):
    """Folders holding megatron/ of Megatron-LM main at the pinned commit (`source`) and of
    the same with the main form of every pull request (`prs`: of those and their
    prerequisites) applied (or the tree `patched`)."""
    pristine = Path(scratch) / "pristine"
    source.extract("megatron", pristine)
    if patched:
        patched = given_patched_tree(patched)
        built_here = False
    else:
        patched = Path(scratch) / "patched"
        shutil.copytree(pristine, patched)
        try:
            patch_series.apply_series(patched, prs=prs)
        except patch_series.SeriesError as err:
            raise ToolError(f"patching Megatron-LM main: {err}") from err
        built_here = True
    form = patch_series.form_files(patch_series.BASES["main"], prs)
    if not patch_series.has_patch(patched, form[-1]):
        raise ToolError(f"{patched} does not have the main form applied: not a patched tree")
    return pristine, patched, {
        "pristine_tree": source.describe(), "sdist_sha256": None,
        "series_digest": patch_series.series_digest(),
        "patched_tree": ("Megatron-LM main with patches/<pr>/main/ of pull_requests" if built_here
                         else str(patched)),
    }


def prepare(args):
    out = Path(args.out).resolve()
    if out.exists():
        if not (out / "manifest.json").is_file():
            raise ToolError(f"{out} exists and is not a bundle of this tool; choose another --out")
        if not args.force:
            raise ToolError(f"{out} exists; pass --force to rebuild it")
    source = open_source(args.megatron, args.tag, args.base)
    log(f"tests from {source.describe()} ({args.base} base)")
    entries = list(args.files or [])
    lists = args.lists or ([] if entries else DEFAULT_LISTS)
    for name in lists:
        entries.extend(TEST_LISTS[name])
    test_files = expand_tests(source, entries) if entries else []
    own_tests = series_tests(args.base, args.pull_requests) if "series" in lists else []
    log(f"{len(test_files)} upstream test files, {len(own_tests)} of the series")

    tmp_parent = out.parent
    tmp_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tmp_parent, prefix=".upstream-tests-") as scratch:
        if args.base == "main":
            pristine_src, patched_src, side_info = main_side_trees(source, args.patched, scratch,
                                                                   args.pull_requests)
        else:
            pristine_src, patched_src, side_info = side_trees(args.sdist, args.patched, scratch)
        # The series' tests come from the patched tree and go to both sides: on pristine they
        # fail, as they should.
        missing = [rel for rel in own_tests if not (patched_src / rel).is_file()]
        if missing:
            raise ToolError(f"{patched_src} lacks the series' tests {missing}: not a tree the "
                            "series was applied to with its tests")
        source = OverlaySource(source, {rel: (patched_src / rel).read_bytes() for rel in own_tests})
        test_files += [rel for rel in own_tests if rel not in test_files]
        side_packages = {p.name for p in (pristine_src / "megatron").iterdir() if p.is_dir()}
        # megatron/training ships in the sdist; what it imports from megatron must travel too.
        side_files = {
            p.relative_to(pristine_src).as_posix(): p.read_text()
            for p in (pristine_src / "megatron").rglob("*.py")
            if p.relative_to(pristine_src / "megatron").parts[0] != "core"
        }
        needed, extra_pkgs, third_party, unresolved = resolve_needs(
            source, test_files, side_packages, side_files
        )
        if unresolved:
            log(f"warning: imported tests.* modules not found at the source: {unresolved}")
        if extra_pkgs:
            log(f"megatron packages the side lacks, copied from the source into both roots: "
                f"{', '.join('megatron.' + p for p in extra_pkgs)}")
        staging = Path(scratch) / "bundle"
        ini = pytest_ini(source)
        for side, src in (("pristine", pristine_src), ("patched", patched_src)):
            root = staging / side
            root.mkdir(parents=True)
            _copy_megatron(src / "megatron", root / "megatron")
            for rel in needed:
                dest = root / rel
                if rel.startswith("megatron/") and rel.split("/")[1] in side_packages:
                    continue
                if rel == "megatron/__init__.py" and dest.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(source.read(rel))
            (root / "pytest.ini").write_text(ini)
            shutil.copyfile(PLUGIN_SOURCE, root / f"{PLUGIN_NAME}.py")
        sizes = {side: _tree_size(staging / side) for side in SIDES}
        total = sum(sizes.values())
        manifest = {
            "tool": "tools/upstream_tests.py",
            "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "source": source.describe(),
            "source_commit": source.commit,
            "source_rev": source.rev,
            "base": args.base,
            "sides": {
                "pristine": {"version": _package_version(pristine_src),
                             "from": side_info["pristine_tree"]},
                "patched": {"version": _package_version(patched_src),
                            "from": side_info["patched_tree"]},
            },
            "sdist_sha256": side_info["sdist_sha256"],
            "series_digest": side_info["series_digest"],
            "pull_requests": [pr.name for pr in patch_series.with_prerequisites(args.pull_requests)]
            if args.pull_requests else [pr.name for pr in patch_series.pull_requests()],
            "project_commit": _git_out(["rev-parse", "HEAD"], cwd=ROOT),
            "lists": {name: TEST_LISTS[name] for name in (args.lists or [])},
            "test_files": test_files,
            "series_tests": own_tests,
            "support_files": [f for f in needed if f not in test_files],
            "extra_megatron_packages": extra_pkgs,
            "third_party_modules": third_party,
            "unresolved_test_modules": unresolved,
            "bytes": sizes,
        }
        shutil.copytree(STUBS_SOURCE, staging / "stubs")
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if total > args.max_bytes:
            raise ToolError(
                f"the bundle would be {total / 2**20:.1f} MiB, over the {args.max_bytes / 2**20:.0f} "
                "MiB limit (--max-mb): choose fewer test files"
            )
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    log(f"bundle at {out}: {total / 2**20:.1f} MiB "
        f"(pristine {sizes['pristine'] / 2**20:.1f}, patched {sizes['patched'] / 2**20:.1f}); "
        f"{len(test_files)} test files ({len(own_tests)} of the series), "
        f"{len(needed) - len(test_files)} support files")
    log(f"third-party modules the tests import: {', '.join(third_party) or 'none'}")
    return 0


# --------------------------------------------------------------------------------------
# run


def load_manifest(bundle):
    path = Path(bundle) / "manifest.json"
    if not path.is_file():
        raise ToolError(
            f"no bundle at {bundle} (manifest.json missing): run `tools/upstream_tests.py "
            "prepare` first, and carry the bundle folder to this machine"
        )
    return json.loads(path.read_text())


def missing_modules(python, modules, cwd):
    """Top-level modules `python` cannot find (from `cwd`)."""
    code = (
        "import importlib.util, json, sys\n"
        "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))"
    )
    proc = subprocess.run([python, "-c", code, *modules], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolError(f"{python} cannot check modules: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def side_environment(root, side_out, stubs=None):
    """The environment of a side's ranks: its root first on sys.path, fresh compile caches.

    `stubs`, a folder of stand-ins for missing third-party modules, goes after the site
    packages (a .pth-free way: PYTHONPATH would put it before them, so it is only used for
    modules that are missing, which the caller checked).
    """
    env = dict(os.environ)
    paths = [str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if stubs:
        paths.append(str(stubs))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Each side compiles from a cold cache, so neither side's timings profit from the other's.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(side_out / "cache" / "inductor")
    env["TRITON_CACHE_DIR"] = str(side_out / "cache" / "triton")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def read_records(results_dir):
    """All JSON-line records of a side's ranks: {rank: [record, ...]}."""
    out = {}
    for path in sorted(Path(results_dir).glob("rank*.jsonl")):
        rank = int(path.stem[len("rank"):])
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a killed rank
        out[rank] = records
    return out


class Progress:
    """Prints finished tests of a side as their records arrive (rank 0; others' failures)."""

    def __init__(self, side, results_dir, total_hint=None):
        self.side = side
        self.results_dir = Path(results_dir)
        self.offsets = {}
        self.done = 0
        self.total = total_hint
        self.started = time.monotonic()
        self.running = {}
        self.last = None

    def poll(self):
        for path in sorted(self.results_dir.glob("rank*.jsonl")):
            rank = int(path.stem[len("rank"):])
            with open(path) as handle:
                handle.seek(self.offsets.get(path, 0))
                chunk = handle.read()
                complete = chunk.rsplit("\n", 1)[0] + "\n" if "\n" in chunk else ""
                self.offsets[path] = self.offsets.get(path, 0) + len(complete.encode())
            for line in complete.splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self._show(rank, rec)
        collected = sorted(self.results_dir.glob("collected-*.json"))
        if collected and self.total is None:
            try:
                self.total = len(json.loads(collected[0].read_text()))
            except (json.JSONDecodeError, OSError):
                pass

    def _show(self, rank, rec):
        elapsed = time.monotonic() - self.started
        if rec.get("event") == "start":
            self.running[rank] = (rec["nodeid"], time.monotonic())
            self.last = rec["nodeid"]
        elif rec.get("event") == "end":
            self.running.pop(rank, None)
            outcome = rec["outcome"]
            if rank == 0:
                self.done += 1
            if rank == 0 or outcome not in ("passed", "skipped", "xfailed"):
                total = f"/{self.total}" if self.total else ""
                msg = f" -- {rec['message'][:200]}" if rec.get("message") and outcome not in (
                    "skipped",) else ""
                log(f"{self.side} {self.done}{total} +{elapsed:.0f}s rank{rank} "
                    f"{outcome.upper()} {rec['nodeid']} ({rec.get('seconds', 0):.2f}s){msg}")
        elif rec.get("event") == "session" and rank == 0:
            log(f"{self.side}: megatron.core {rec.get('version')} from {rec.get('core_file')}")
        elif rec.get("event") == "deselected_for_world" and rank == 0:
            log(f"{self.side}: {len(rec['nodeids'])} tests need more ranks than the world of "
                f"{rec['world']} (tp*pp*cp or etp*ep*pp does not divide it): not run "
                "(--all-sizes runs them)")
        elif rec.get("event") == "collect_error" and rank == 0:
            log(f"{self.side} rank{rank} COLLECTION ERROR {rec['nodeid']} -- {rec['message']}")

    def heartbeat(self, every=30.0):
        now = time.monotonic()
        for rank, (nodeid, since) in list(self.running.items()):
            if now - since >= every and int(now - since) % int(every) == 0:
                log(f"{self.side} rank{rank} still in {nodeid} after {now - since:.0f}s")


def _kill_group(proc, grace=10.0):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def open_tests(records):
    """One rank's records -> [(test, terminated)]: per attempt of that rank, the test it was in when the
    attempt ended without ending it; terminated where torchrun stopped the rank because another one died
    (the plugin's ``terminated`` record): that rank did not die in its test, which runs again."""
    out, open_test, terminated = [], None, False
    for rec in [*records, {"event": "session"}]:  # the last record closes the last attempt
        event = rec.get("event")
        if event == "session":
            if open_test:
                out.append((open_test, terminated))
            open_test, terminated = None, False
        elif event == "start":
            open_test = rec["nodeid"]
        elif event == "end" and rec["nodeid"] == open_test:
            open_test = None
        elif event == "terminated":
            terminated = True
    return out


def finished_ids(results_dir, nproc=1):
    """Test ids every one of the ``nproc`` ranks ended, and those a rank died in (crashed, or hung past
    the watchdog): the next attempt skips both."""
    ended, died_in = {}, set()
    for rank, records in read_records(results_dir).items():
        for rec in records:
            if rec.get("event") == "end":
                ended.setdefault(rec["nodeid"], set()).add(rank)
        died_in |= {test for test, terminated in open_tests(records) if not terminated}
    return {test for test, ranks in ended.items() if len(ranks) >= nproc}, died_in


def run_side(side, root, targets, args, side_out, has_timeout_plugin, stubs=None):
    """Run one side under torchrun, attempt after attempt past hung or crashed tests."""
    # The plugin is the tool's own: a bundle prepared by an older tool gets the current one.
    shutil.copyfile(PLUGIN_SOURCE, root / f"{PLUGIN_NAME}.py")
    results = side_out / "results"
    results.mkdir(parents=True, exist_ok=True)
    env = side_environment(root, side_out, stubs)
    deadline = time.monotonic() + args.side_timeout
    progress = Progress(side, results)
    attempt = 0
    status = "finished"
    while True:
        remaining = deadline - time.monotonic()
        if remaining < 5:
            status = "side budget spent"
            break
        skip_file = side_out / f"skip-{attempt}.txt"
        done, hung = finished_ids(results, args.nproc)
        skip_file.write_text("".join(f"{t}\n" for t in sorted(done | hung)))
        if args.launcher == "torchrun":
            launch = [args.python, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", str(args.nproc)]
        else:  # one process, no torch.distributed launcher (debugging, the tool's own tests)
            launch = [args.python]
        cmd = [
            *launch,
            "-m", "pytest", *targets,
            # Test ids relative to the side's root, so both sides name a test alike.
            "--rootdir", str(root),
            # A file that cannot be imported here (one that needs TransformerEngine on a node
            # without it) is reported as an error; the other files still run.
            "--continue-on-collection-errors",
            "-p", "no:cacheprovider", "-p", PLUGIN_NAME,
            "-rfE", "--durations=0",
            "--junitxml", str(side_out / f"junit-attempt{attempt}-rank{{rank}}.xml"),
            "--r3-results", str(results), "--r3-side", side, "--r3-attempt", str(attempt),
            "--r3-skip", str(skip_file),
            "--r3-hard-timeout", str(args.timeout + args.grace),
        ]
        if not args.all_sizes:
            cmd += ["--r3-fit-world"]
        if has_timeout_plugin:
            cmd += ["--timeout", str(args.timeout), "--timeout-method", "signal"]
        if args.k:
            cmd += ["-k", args.k]
        cmd += args.pytest_args
        log_path = side_out / f"attempt{attempt}.log"
        log(f"{side} attempt {attempt}: {' '.join(cmd[1:])}  (log: {log_path}, "
            f"{remaining:.0f}s of the side's budget left)")
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            while proc.poll() is None:
                time.sleep(0.25)
                progress.poll()
                progress.heartbeat()
                if time.monotonic() > deadline:
                    log(f"{side}: the side's budget ({args.side_timeout:.0f}s) is spent; "
                        "stopping its ranks")
                    _kill_group(proc)
                    status = "side budget spent"
                    break
        progress.poll()
        code = proc.returncode
        if status == "side budget spent":
            break
        new_done, new_hung = finished_ids(results, args.nproc)
        ended = _session_ended(results, attempt, args.nproc)
        if ended:
            break
        if not (new_done - done) and not (new_hung - hung):
            status = f"torchrun exited with {code} before any test ran (see {log_path})"
            log(f"{side}: {status}")
            break
        where = ", ".join(sorted(new_hung)) or progress.last or "no test"
        log(f"{side}: attempt {attempt} ended with {code} in {where}; going on after it")
        attempt += 1
    (side_out / "status.txt").write_text(status + "\n")
    return status


def _session_ended(results, attempt, nproc=1):
    """Whether every one of the ``nproc`` ranks of ``attempt`` reached the end of its session (ranks that
    do not share collectives can run apart: rank 0 ending says nothing of a rank that died)."""
    ended = 0
    for records in read_records(results).values():
        current = None
        for rec in records:
            if rec.get("event") == "session":
                current = rec.get("attempt")
            elif rec.get("event") == "session_end" and current == attempt:
                ended += 1
                break
    return ended >= nproc


def _device_line(python):
    code = (
        "import torch, importlib.util\n"
        "n = torch.cuda.device_count()\n"
        "names = sorted({torch.cuda.get_device_name(i) for i in range(n)}) if n else []\n"
        "te = importlib.util.find_spec('transformer_engine') is not None\n"
        "print(f'{n} x {\", \".join(names) or \"no CUDA device\"}; torch {torch.__version__} "
        "(cuda {torch.version.cuda}); TransformerEngine {\"present\" if te else \"absent\"}')"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else f"unknown ({proc.stderr.strip()[-200:]})"


PREFLIGHT = """
import os, sys
root = os.path.realpath(os.getcwd())
import megatron.core
from megatron.core import package_info
print(os.path.realpath(megatron.core.__file__), package_info.__version__)
try:
    import tests.unit_tests.test_utilities  # pulls megatron.training, as most tests do
except Exception as err:
    print("IMPORT-FAILED", type(err).__name__, str(err)[:300])
"""


def preflight(python, root, side, stubs):
    """Import megatron.core from a side's root and say where it came from; fail if elsewhere."""
    env = side_environment(root, root / ".preflight", stubs)
    env.pop("TORCHINDUCTOR_CACHE_DIR")
    env.pop("TRITON_CACHE_DIR")
    proc = subprocess.run([python, "-c", PREFLIGHT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise ToolError(f"{side}: `import megatron.core` fails in {root}:\n{proc.stderr[-2000:]}")
    first, *rest = proc.stdout.strip().splitlines()
    core_file, version = first.rsplit(" ", 1)
    if not core_file.startswith(str(Path(root).resolve()) + os.sep):
        raise ToolError(f"{side}: megatron.core comes from {core_file}, not from {root}: another "
                        "megatron is earlier on sys.path (PYTHONPATH? an editable install?)")
    log(f"{side}: megatron.core {version} from {core_file}")
    for line in rest:
        if line.startswith("IMPORT-FAILED"):
            log(f"warning: {side}: tests.unit_tests.test_utilities does not import: {line[14:]}")


def run(args):
    bundle = Path(args.bundle).resolve()
    manifest = load_manifest(bundle)
    out = Path(args.out).resolve() if args.out else bundle / "results"
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise ToolError(f"{out} holds an earlier run; pass --force to replace it or --out DIR")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    targets = list(args.tests or [])
    if not targets:
        lists = args.lists or list(DEFAULT_LISTS)
        for name in lists:
            if name == "series":
                own = manifest.get("series_tests", [])
                if not own:
                    log("warning: the bundle holds none of the series' own tests (prepare with "
                        "--lists ... series)")
                # A file under a folder already named runs with it (no test twice).
                targets += [rel for rel in own if not any(
                    rel == t or rel.startswith(t.rstrip("/") + "/") for t in targets)]
                continue
            for entry in TEST_LISTS[name]:
                if any(f == entry or f.startswith(entry.rstrip("/") + "/")
                       for f in manifest["test_files"]):
                    targets.append(entry)
                else:
                    log(f"warning: {entry} is not in the bundle (prepare with --lists {name})")
    if not targets:
        raise ToolError("no test files to run")
    if args.launcher == "plain":
        args.nproc = 1
    if args.nproc is None:
        proc = subprocess.run([args.python, "-c", "import torch; print(torch.cuda.device_count())"],
                              capture_output=True, text=True)
        args.nproc = max(1, int(proc.stdout.strip() or 0)) if proc.returncode == 0 else 1
    device = _device_line(args.python)
    log(f"device: {device}; {args.nproc} ranks per side; per-test timeout {args.timeout}s "
        f"(+{args.grace}s hard), side budget {args.side_timeout}s")
    checks = ["torch", "pytest"] + manifest.get("third_party_modules", [])
    missing = missing_modules(args.python, sorted(set(checks)), cwd=bundle / "pristine")
    has_timeout_plugin = "pytest_timeout" not in missing_modules(
        args.python, ["pytest_timeout"], cwd=bundle)
    if not has_timeout_plugin:
        log("pytest-timeout is absent: the plugin's watchdog alone bounds each test")
    if "torch" in missing or "pytest" in missing:
        raise ToolError(f"{args.python} lacks {', '.join(m for m in ('torch', 'pytest') if m in missing)}")
    stubs, stubbed = None, []
    if missing and not args.no_stubs and (bundle / "stubs").is_dir():
        stubbed = [m for m in missing if (bundle / "stubs" / f"{m}.py").is_file()]
        if stubbed:
            stubs = out / "stubs"
            stubs.mkdir()
            for name in stubbed:
                shutil.copyfile(bundle / "stubs" / f"{name}.py", stubs / f"{name}.py")
            log(f"stand-ins for missing modules, the same on both sides: {', '.join(stubbed)} "
                "(tools/upstream_tests_stubs/README.md; --no-stubs: none)")
    missing = [m for m in missing if m not in stubbed]
    if missing:
        log(f"warning: modules the upstream tests import are missing here: {', '.join(missing)} "
            "(tests importing them fail the same way on both sides)")
    sides = [s for s in SIDES if s in args.sides]
    for side in sides:
        preflight(args.python, bundle / side, side, stubs)
    meta = {"device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "nproc": args.nproc,
            "timeout": args.timeout, "side_timeout": args.side_timeout, "targets": targets,
            "missing_modules": missing, "stubbed_modules": stubbed, "manifest": manifest,
            "sides": {}}
    for side in sides:
        root = bundle / side
        side_out = out / side
        side_out.mkdir(parents=True)
        started = time.monotonic()
        status = run_side(side, root, targets, args, side_out, has_timeout_plugin, stubs)
        meta["sides"][side] = {"status": status, "seconds": round(time.monotonic() - started, 1),
                               **manifest["sides"][side]}
        log(f"{side}: {status} in {meta['sides'][side]['seconds']}s")
    (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    table = write_comparison(out, meta)
    if args.export:
        export(out, Path(args.export))
    return 0 if table["ok"] else 1


def export(out, dest):
    """Copy the comparison and a tarball of the whole results folder to `dest` (3 files)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("comparison.md", "comparison.json"):
        shutil.copyfile(out / name, dest / name)
    with tarfile.open(dest / "upstream-tests-results.tar.gz", "w:gz") as tar:
        tar.add(out, arcname="results", filter=lambda ti: None if "/cache" in ti.name else ti)
    log(f"exported comparison.md, comparison.json and upstream-tests-results.tar.gz to {dest}")


# --------------------------------------------------------------------------------------
# compare


SIDE_PREFIX = re.compile(r"^(?:[^:]*/)?(?:pristine|patched)/(?=tests/)")


def junit_key(classname, name):
    return f"{classname}::{name}" if classname else name


def nodeid_key(nodeid):
    """The junit-style key (classname::name) of a pytest node id, as pytest's junitxml names it.

    A node id that pytest made relative to a directory above the side's root still names the
    side's folder: that prefix goes, so both sides name a test alike.
    """
    nodeid = SIDE_PREFIX.sub("", nodeid)
    parts = nodeid.split("::")
    path = parts[0]
    if path.endswith(".py"):
        path = path[:-3]
    classname = ".".join([path.replace("/", ".")] + parts[1:-1])
    return junit_key(classname, parts[-1])


def parse_junit(path):
    """{key: (outcome, seconds, message)} of one junit XML file."""
    out = {}
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        key = junit_key(case.get("classname", ""), case.get("name", ""))
        seconds = float(case.get("time") or 0.0)
        outcome, message = "passed", ""
        for child in case:
            tag = child.tag
            if tag == "failure":
                outcome, message = "failed", child.get("message", "")
            elif tag == "error":
                # An error in teardown after a failure keeps the failure.
                if outcome != "failed":
                    outcome, message = "error", child.get("message", "")
            elif tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if kind == "pytest.xfail" else "skipped"
                message = child.get("message", "")
        if key in out and OUTCOME_ORDER.index(out[key][0]) < OUTCOME_ORDER.index(outcome):
            continue
        out[key] = (outcome, seconds, message[:500])
    return out


def combine(per_rank):
    """A test's outcome over ranks: the worst any rank had; seconds: the longest."""
    outcomes = [o for o, _, _ in per_rank]
    worst = min(outcomes, key=OUTCOME_ORDER.index)
    seconds = max(s for _, s, _ in per_rank)
    message = next((m for o, _, m in per_rank if o == worst and m), "")
    if len(set(outcomes)) > 1 and worst in ("passed", "skipped", "xfailed"):
        message = "ranks differ: " + ", ".join(sorted(set(outcomes)))
    return worst, seconds, message


def load_side(side_dir):
    """{key: {"id", "outcome", "seconds", "message"}} of one side's results folder.

    The plugin's JSON lines come first (they survive a killed run and name a hung test);
    junit XML files fill in tests the JSON lines lack (or are all there is, e.g. a run made
    without the plugin). Tests collected but never finished are 'not run'.
    """
    side_dir = Path(side_dir)
    per_test = {}
    ids = {}
    results = side_dir / "results" if (side_dir / "results").is_dir() else side_dir
    for rank, records in read_records(results).items():
        for rec in records:
            if rec.get("event") == "end":
                key = nodeid_key(rec["nodeid"])
                ids[key] = rec["nodeid"]
                per_test.setdefault(key, {})[rank] = (
                    rec["outcome"], float(rec.get("seconds", 0.0)), rec.get("message", ""))
        for nodeid, terminated in open_tests(records):
            if not terminated:  # an end in a later attempt stands
                key = nodeid_key(nodeid)
                ids[key] = nodeid
                per_test.setdefault(key, {}).setdefault(
                    rank, ("crashed", 0.0, "the rank ended inside this test (killed or hung)"))
    junit_files = sorted(side_dir.glob("*.xml")) + sorted(results.glob("*.xml")) if results != side_dir \
        else sorted(side_dir.glob("*.xml"))
    for i, path in enumerate(junit_files):
        try:
            cases = parse_junit(path)
        except ET.ParseError:
            continue
        rank_match = re.search(r"rank(\d+)", path.name)
        rank = int(rank_match.group(1)) if rank_match else 1000 + i
        for key, value in cases.items():
            ranks = per_test.setdefault(key, {})
            if rank not in ranks:
                ranks[rank] = value
    for collected in sorted(results.glob("collected-*.json")):
        try:
            for nodeid in json.loads(collected.read_text()):
                key = nodeid_key(nodeid)
                ids.setdefault(key, nodeid)
                per_test.setdefault(key, {})
        except (json.JSONDecodeError, OSError):
            continue
    out = {}
    for key, ranks in per_test.items():
        if ranks:
            outcome, seconds, message = combine(list(ranks.values()))
        else:
            outcome, seconds, message = "not run", 0.0, ""
        out[key] = {"id": ids.get(key, key), "outcome": outcome, "seconds": round(seconds, 3),
                    "message": message}
    return out


def compare(pristine, patched):
    """Rows of the side-by-side table, differences first (pristine-passes-ours-not on top).

    A file that does not import on one side is one row keyed by its module there, while the other
    side, where it imports, has a row per test: that side's outcome of the module row is "collected"
    (its tests are rows of their own), not "absent"."""

    def outcome(side, key):
        if key in side:
            return side[key]["outcome"]
        tests_of_the_file = "::" not in key and any(
            k.split("::")[0] == key or k.startswith(key + ".") for k in side if "::" in k)
        return "collected" if tests_of_the_file else "absent"

    rows = []
    for key in sorted(set(pristine) | set(patched)):
        a, b = pristine.get(key), patched.get(key)
        rows.append({
            "key": key,
            "id": (b or a)["id"] if b and b["id"] != key else (a or b)["id"],
            "pristine": outcome(pristine, key),
            "patched": outcome(patched, key),
            "pristine_s": a["seconds"] if a else None,
            "patched_s": b["seconds"] if b else None,
            "pristine_message": a["message"] if a else "",
            "patched_message": b["message"] if b else "",
        })

    def rank(row):
        differs = row["pristine"] != row["patched"]
        regression = differs and row["pristine"] == "passed"
        return (0 if regression else 1 if differs else 2, row["id"])

    rows.sort(key=rank)
    return rows


# Outcomes of a series test on the patched side that count as working ("collected": a file whose
# tests are rows of their own on that side).
SERIES_OK = ("passed", "skipped", "xfailed", "collected")


def split_series(rows, series_files):
    """(upstream's rows, the series' rows): a row is the series' when its test file is one of
    the files the series' patches add or change."""
    modules = {rel[: -len(".py")].replace("/", ".") for rel in series_files}

    def is_series(row):
        head = row["key"].split("::")[0]
        return any(head == m or head.startswith(m + ".") for m in modules)

    upstream = [r for r in rows if not is_series(r)]
    own = [r for r in rows if is_series(r)]
    for row in own:
        if row["patched"] not in SERIES_OK:
            row["verdict"] = "FAILS on the patched core"
        elif row["pristine"] == row["patched"]:
            row["verdict"] = "the same without the series"
        else:
            row["verdict"] = "expected: needs the series"
    return upstream, own


def counts(side):
    out = {}
    for value in side.values():
        out[value["outcome"]] = out.get(value["outcome"], 0) + 1
    return dict(sorted(out.items(), key=lambda kv: OUTCOME_ORDER.index(kv[0])
                       if kv[0] in OUTCOME_ORDER else 99))


def _fmt_s(value):
    return "" if value is None else f"{value:.2f}"


def render_markdown(rows, pristine, patched, meta, own_rows=()):
    """The comparison of upstream's tests (`rows`), then the series' own (`own_rows`); the
    sides hold both."""
    diffs = [r for r in rows if r["pristine"] != r["patched"]]
    keys = {r["key"] for r in own_rows}
    lines = ["# Megatron-LM unit tests: pristine vs patched megatron-core", ""]
    if meta:
        man = meta.get("manifest", {})
        lines += [
            f"- device: {meta.get('device', '?')}; {meta.get('nproc', '?')} ranks per side",
            f"- date: {meta.get('date', '?')}",
            f"- tests: {man.get('source', '?')} ({man.get('base', '0.19')} base)",
            f"- project commit: {man.get('project_commit', '?')}; series digest "
            f"{man.get('series_digest', '?')}",
        ]
        for side in SIDES:
            info = meta.get("sides", {}).get(side)
            if info:
                lines.append(f"- {side}: megatron-core {info.get('version')} "
                             f"({info.get('from')}): {info.get('status')}, "
                             f"{info.get('seconds')} s")
        lines.append(f"- per-test timeout {meta.get('timeout')} s, side budget "
                     f"{meta.get('side_timeout')} s; files: {' '.join(meta.get('targets', []))}")
        if meta.get("stubbed_modules"):
            lines.append(f"- stand-ins (tools/upstream_tests_stubs): "
                         f"{', '.join(meta['stubbed_modules'])}")
        if meta.get("missing_modules"):
            lines.append(f"- modules missing on the device: {', '.join(meta['missing_modules'])}")
        lines.append("")
    lines += _counts_table({k: v for k, v in pristine.items() if k not in keys},
                           {k: v for k, v in patched.items() if k not in keys})
    lines += ["", f"{len(diffs)} tests differ.", ""]
    lines += ["| test | pristine | patched | pristine s | patched s |",
              "| --- | --- | --- | ---: | ---: |"]
    for r in rows:
        mark = "**" if r["pristine"] != r["patched"] else ""
        lines.append(f"| `{r['id']}` | {mark}{r['pristine']}{mark} | {mark}{r['patched']}{mark} "
                     f"| {_fmt_s(r['pristine_s'])} | {_fmt_s(r['patched_s'])} |")
    if diffs:
        lines += ["", "## Messages of the tests that differ", ""]
        lines += _messages(diffs)
    if own_rows:
        failing = [r for r in own_rows if r["patched"] not in SERIES_OK]
        lines += ["", "## The series' own tests", "",
                  "They test what the series adds, so they are expected to fail on pristine "
                  "(most at import); every one must pass, or skip for want of ranks or of "
                  "TransformerEngine, on the patched core.", ""]
        lines += _counts_table({k: v for k, v in pristine.items() if k in keys},
                               {k: v for k, v in patched.items() if k in keys})
        lines += ["", f"{len(failing)} of {len(own_rows)} fail on the patched core.", "",
                  "| test | pristine | patched | verdict |", "| --- | --- | --- | --- |"]
        for r in sorted(own_rows, key=lambda r: (r["patched"] in SERIES_OK, r["id"])):
            lines.append(f"| `{r['id']}` | {r['pristine']} | {r['patched']} | {r['verdict']} |")
        if failing:
            lines += ["", "### Messages of the series' tests that fail on the patched core", ""]
            lines += _messages(failing)
    return "\n".join(lines) + "\n"


def _counts_table(pristine, patched):
    lines = ["| side | " + " | ".join(OUTCOME_ORDER) + " | total | seconds |",
             "| --- |" + " --- |" * (len(OUTCOME_ORDER) + 2)]
    for name, side in (("pristine", pristine), ("patched", patched)):
        c = counts(side)
        total_s = sum(v["seconds"] for v in side.values())
        lines.append(f"| {name} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOME_ORDER)
                     + f" | {len(side)} | {total_s:.1f} |")
    return lines


def _messages(rows):
    lines = []
    for r in rows:
        lines.append(f"- `{r['id']}`")
        for side in SIDES:
            if r[f"{side}_message"]:
                lines.append(f"  - {side}: {r[f'{side}_message'][:300]}")
    return lines


def _atomic_write(path, text):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_comparison(out, meta=None):
    out = Path(out)
    if meta is None and (out / "run.json").is_file():
        meta = json.loads((out / "run.json").read_text())
    pristine = load_side(out / "pristine")
    patched = load_side(out / "patched")
    series_files = ((meta or {}).get("manifest") or {}).get("series_tests", [])
    rows, own_rows = split_series(compare(pristine, patched), series_files)
    own_keys = {r["key"] for r in own_rows}
    upstream = [{k: v for k, v in side.items() if k not in own_keys} for side in (pristine, patched)]
    c_a, c_b = counts(upstream[0]), counts(upstream[1])
    series_ok = all(r["patched"] in SERIES_OK for r in own_rows)
    counts_equal = c_a == c_b and all(r["pristine"] == r["patched"] for r in rows)
    table = {"meta": {k: v for k, v in (meta or {}).items() if k != "manifest"},
             "counts": {"pristine": c_a, "patched": c_b}, "counts_equal": counts_equal,
             "series_ok": series_ok, "ok": counts_equal and series_ok,
             "rows": rows, "series_rows": own_rows}
    _atomic_write(out / "comparison.json", json.dumps(table, indent=1) + "\n")
    _atomic_write(out / "comparison.md", render_markdown(rows, pristine, patched, meta, own_rows))
    log(f"pristine: {c_a}")
    log(f"patched:  {c_b}")
    log(f"{sum(r['pristine'] != r['patched'] for r in rows)} of upstream's tests differ; "
        f"table: {out / 'comparison.md'}")
    if own_rows:
        failing = sum(r["patched"] not in SERIES_OK for r in own_rows)
        expected = sum(r["verdict"].startswith("expected") for r in own_rows)
        log(f"the series' own tests: {len(own_rows)}, {failing} failing on the patched core, "
            f"{expected} failing or absent on pristine as expected")
    return table


def compare_cmd(args):
    out = Path(args.results)
    for side in SIDES:
        if not (out / side).is_dir():
            raise ToolError(f"{out / side}: no such folder (a results folder of `run` holds "
                            "pristine/ and patched/)")
    table = write_comparison(out)
    return 0 if table["ok"] else 1


# --------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="build the bundle (no GPU needed)")
    p.add_argument("--base", choices=BASES, default="0.19",
                   help="the series' base: 0.19 (the megatron-core 0.19.2 sdist, tests at "
                   f"{DEFAULT_REVS['0.19']}) or main (Megatron-LM main at "
                   f"{DEFAULT_REVS['main'][:10]}: its core and its tests)")
    p.add_argument("--megatron", help="a Megatron-LM checkout, or its git history (with --tag)")
    p.add_argument("--tag", help="revision of a git history to take tests from (default "
                   f"{DEFAULT_REVS['0.19']} for 0.19, where a checkout is used as it is; main "
                   "takes its pinned commit)")
    p.add_argument("--sdist", default=None, help="the pristine megatron-core sdist of the 0.19 "
                   "base (default: build/megatron_core-0.19.2.tar.gz)")
    p.add_argument("--patched", help="a patched tree to use instead of building one from the "
                   "base and patches/ (with the series' tests in it)")
    p.add_argument("--pull-requests", nargs="+", dest="pull_requests", metavar="PR",
                   help="main base: the patched side gets only these pull requests of patches/series "
                   "and their prerequisites (one pull request's share of the series' cost, "
                   "bench/series_cost.py); default: all")
    p.add_argument("--out", help="the bundle (default: build/upstream-tests for 0.19, "
                   "build/upstream-tests-main for main, build/upstream-tests-main-<PR> with "
                   "--pull-requests)")
    p.add_argument("--lists", nargs="*", choices=sorted(TEST_LISTS),
                   help=f"named test lists (default: {' '.join(DEFAULT_LISTS)})")
    p.add_argument("--files", nargs="*", help="test files or folders (repository paths)")
    p.add_argument("--max-mb", type=float, default=40.0, dest="max_mb")
    p.add_argument("--force", action="store_true", help="replace an existing bundle")

    r = sub.add_parser("run", help="run both sides under torchrun and compare (GPU machine)")
    r.add_argument("--base", choices=BASES, default="0.19",
                   help="picks the default bundle: build/upstream-tests(-main)")
    r.add_argument("--bundle", help="the bundle to run (default: the --base's)")
    r.add_argument("--out", help="results folder (default: BUNDLE/results)")
    r.add_argument("--export", help="copy comparison.md/.json and a results tarball here")
    r.add_argument("--lists", nargs="*", choices=sorted(TEST_LISTS),
                   help=f"which lists of the bundle to run (default: {' '.join(DEFAULT_LISTS)})")
    r.add_argument("--tests", nargs="*", help="test files, folders or node ids (instead of lists)")
    r.add_argument("-k", help="pytest -k expression")
    r.add_argument("--nproc", type=int, help="ranks per side (default: the GPUs visible)")
    r.add_argument("--timeout", type=float, default=90.0, help="per-test timeout, seconds")
    r.add_argument("--grace", type=float, default=30.0,
                   help="seconds after --timeout at which the watchdog ends a hung rank")
    r.add_argument("--side-timeout", type=float, default=270.0, dest="side_timeout",
                   help="overall budget of each side, seconds")
    r.add_argument("--sides", nargs="*", default=list(SIDES), choices=SIDES)
    r.add_argument("--all-sizes", action="store_true", dest="all_sizes",
                   help="also run tests whose parallel sizes the ranks cannot hold (they fail "
                        "in setup, and upstream's MoE container can then deadlock the ranks)")
    r.add_argument("--python", default=sys.executable)
    r.add_argument("--launcher", choices=("torchrun", "plain"), default="torchrun",
                   help="plain: one `python -m pytest` process per side, no torchrun")
    r.add_argument("--force", action="store_true", help="replace an earlier results folder")
    r.add_argument("--no-stubs", action="store_true", dest="no_stubs",
                   help="no stand-ins for missing third-party modules (click, requests, mock, "
                   "pytest_mock)")
    r.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")

    c = sub.add_parser("compare", help="rebuild the comparison of a results folder")
    c.add_argument("results", help="a results folder of `run` (holding pristine/ and patched/)")

    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            if args.sdist is None:
                args.sdist = str(ROOT / "build" / patch_series.SDIST_NAME)
            if args.pull_requests and (args.base != "main" or args.patched):
                raise ToolError("--pull-requests builds the patched side of the main base from "
                                "patches/: give --base main and no --patched")
            if args.pull_requests:
                try:
                    patch_series.with_prerequisites(args.pull_requests)
                except patch_series.SeriesError as err:
                    raise ToolError(str(err)) from err
            if args.out is None:
                args.out = str(DEFAULT_BUNDLES[args.base]) + (
                    "-" + "+".join(args.pull_requests) if args.pull_requests else "")
            args.max_bytes = int(args.max_mb * 2**20)
            return prepare(args)
        if args.command == "run":
            if args.bundle is None:
                args.bundle = str(DEFAULT_BUNDLES[args.base])
            return run(args)
        return compare_cmd(args)
    except ToolError as err:
        print(f"upstream_tests: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
