"""tools/bytecode_cache.py: a venv that reuses a host torch whose bytecode Python will not keep (the
image sets PYTHONDONTWRITEBYTECODE, or its folder is read-only) reads bytecode from a cache of its own."""

import os
import py_compile
import subprocess
import sys
from pathlib import Path

from tools.bytecode_cache import PTH_NAME, bytecode_not_kept, enable


def test_needed_only_without_bytecode_beside_the_source_and_no_way_to_write_it(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("X = 1\n")
    assert bytecode_not_kept(str(source), dont_write=True, writable=lambda p: True)
    assert bytecode_not_kept(str(source), dont_write=False, writable=lambda p: False)
    assert not bytecode_not_kept(str(source), dont_write=False, writable=lambda p: True)
    py_compile.compile(str(source))  # bytecode beside it: nothing to do
    assert not bytecode_not_kept(str(source), dont_write=True, writable=lambda p: False)


def python(code: str, site: Path, host: Path, **env_extra: str) -> list[str]:
    """A fresh interpreter that processes ``site``'s .pth files, puts ``host`` on the path and runs ``code``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    setup = f"import site, sys; site.addsitedir({str(site)!r}); sys.path.insert(0, {str(host)!r})\n"
    return subprocess.run([sys.executable, "-c", setup + code], env={**env, **env_extra},
                          capture_output=True, text=True, check=True).stdout.split()


def test_install_warms_the_cache_and_later_processes_read_it_without_writing(tmp_path):
    site, host, cache = tmp_path / "site", tmp_path / "host", tmp_path / "venv" / "pycache"
    site.mkdir()
    host.mkdir()
    source = host / "hostmod.py"
    source.write_text("VALUE = 42\n")
    read = "import hostmod; print(hostmod.VALUE, sys.pycache_prefix)"
    no_write = {"PYTHONDONTWRITEBYTECODE": "1"}

    assert enable(str(site), str(cache)) == site / PTH_NAME
    # make install's warm-up: writing allowed for this one import, whatever the environment says.
    python("sys.dont_write_bytecode = False; import hostmod", site, host, **no_write)
    pycs = list(cache.rglob("hostmod.*.pyc"))
    assert len(pycs) == 1 and not (host / "__pycache__").exists()

    # Same size and mtime, other value: a process that prints 42 read the cached bytecode.
    stat = source.stat()
    source.write_text("VALUE = 43\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert python(read, site, host, **no_write) == ["42", str(cache.resolve())]
    # Negative control: without the .pth file the same process compiles the source.
    (site / PTH_NAME).unlink()
    assert python(read, site, host, **no_write) == ["43", "None"]


def test_a_prefix_the_user_set_wins(tmp_path):
    site, host = tmp_path / "site", tmp_path / "host"
    site.mkdir()
    host.mkdir()
    enable(str(site), str(tmp_path / "ours"))
    assert python("print(sys.pycache_prefix)", site, host, PYTHONPYCACHEPREFIX=str(tmp_path / "theirs")) == [
        str(tmp_path / "theirs")]


def _cached(cache: Path, module: str) -> bool:
    return any(cache.rglob(module.replace(".", "/") + ".*.pyc"))


def test_fill_caches_what_the_launcher_imports_only_once_it_runs(tmp_path):
    """make install's fill runs the launcher: modules a model build, a pass and a step import lazily are cached too."""
    lazy = "torch._dynamo.codegen"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path / "cache"))
    root = Path(__file__).resolve().parent.parent
    imported = subprocess.run([sys.executable, "-W", "ignore", "-c", "import sys, launch.pretrain_gpt_r3; "
                               f"print({lazy!r} in sys.modules)"], cwd=root, env=env, capture_output=True,
                              text=True, check=True).stdout.split()
    assert imported == ["False"]  # not an import of the launcher's: only a run pulls it in
    assert not _cached(tmp_path / "cache", lazy)  # and nothing was written (PYTHONDONTWRITEBYTECODE)

    subprocess.run([sys.executable, "-W", "ignore", "tools/bytecode_cache.py", "fill"], cwd=root, env=env, check=True,
                   capture_output=True, text=True)
    assert _cached(tmp_path / "cache", lazy) and _cached(tmp_path / "cache", "launch.pretrain_gpt_r3")
