"""make install: a bytecode cache for a host torch whose bytecode Python will not keep.

Python keeps a module's compiled bytecode beside its source, in ``__pycache__``, and
writes it on first import, unless ``PYTHONDONTWRITEBYTECODE`` is set (container images
often set it) or the folder is not writable. A GPU node's torch installed without
bytecode (uv's default) is then compiled again by every interpreter, on every start.
On a lent H100 host (``PYTHONDONTWRITEBYTECODE=1``) that was 6.2 s of the launcher's
start-up (``builtins.compile``, 1,695 modules), and again in ``torchrun`` itself.

``enable`` writes a ``.pth`` file into the venv that points the venv's interpreter at
a cache folder of its own (``sys.pycache_prefix``, what ``PYTHONPYCACHEPREFIX`` sets;
a prefix the user set wins); nothing is written beside the host's sources.
``make install`` then fills it with writing allowed: the launcher's, torchrun's and the
tests' imports, and the modules the launcher imports only once it runs (a model build, a
forward and backward, Megatron's optimizer pull in ``torch._dynamo``, ``sympy``,
``torch.distributed.checkpoint``, ...: 186 modules compiled from source, 1.0 s, in each start of the
default command on a lent H100 host when only the imports were cached; cProfile's
``source_to_code``), by running two
iterations of a small default loop. Later processes read it, whatever
``PYTHONDONTWRITEBYTECODE`` says.

    python tools/bytecode_cache.py needed MODULE        exit 0 when MODULE's bytecode is missing and not kept
    python tools/bytecode_cache.py enable SITE CACHE    write SITE/_megatron_r3_bytecode.pth
    python tools/bytecode_cache.py fill                 fill the cache (run by the venv's python, after install)
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import socket
import sys
from pathlib import Path
from typing import Callable

PTH_NAME = "_megatron_r3_bytecode.pth"


def bytecode_not_kept(source: str, dont_write: bool,
                      writable: Callable[[str], bool] = lambda p: os.access(p, os.W_OK)) -> bool:
    """Whether the module at ``source`` has no bytecode beside it and importing it will not write any."""
    cached = Path(importlib.util.cache_from_source(source))
    if cached.exists():
        return False
    folder = cached.parent if cached.parent.exists() else cached.parent.parent
    return dont_write or not writable(str(folder))


def pth_line(cache: str) -> str:
    """The ``.pth`` line (site runs lines that start with ``import``) that sets the cache folder."""
    return f"import sys; sys.pycache_prefix = sys.pycache_prefix or {str(Path(cache).resolve())!r}\n"


def enable(site: str, cache: str) -> Path:
    """Writes the ``.pth`` file into ``site`` and makes ``cache``; returns the file.

    Written under a temporary name and renamed: every interpreter of the venv runs the
    file at start, so none may see half of it. (This script runs before megatron_r3 is
    installed, so it cannot use ``megatron_r3.dataplane.formats.output_files``.)
    """
    Path(cache).mkdir(parents=True, exist_ok=True)
    pth = Path(site) / PTH_NAME
    temporary = pth.with_name(pth.name + ".tmp")
    temporary.write_text(pth_line(cache))
    os.replace(temporary, pth)
    return pth


# Two iterations of the default loop (the second replays the captured graphs), small and fast.
FILL_RUN = ["--moe-enable-routing-replay", "--train-iters", "2", "--log-interval", "1"]


def fill() -> int:
    """Imports, then runs the launcher in this process with bytecode writing allowed."""
    sys.dont_write_bytecode = False
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: launch/
    import launch.pretrain_gpt_r3 as launcher
    import pytest  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import xdist  # noqa: F401

    with socket.socket() as probe:  # a free port for the world of one rank
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            launcher.main(FILL_RUN)
    except BaseException as error:  # the imports are cached already; say why the rest is not
        print(output.getvalue()[-2000:], file=sys.stderr)
        print(f"bytecode_cache: the launcher's run failed ({error!r}): only the imports are cached", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "needed":
        spec = importlib.util.find_spec(argv[1])
        if spec is None or not spec.origin:
            print(f"bytecode_cache: no module {argv[1]}", file=sys.stderr)
            return 2
        return 0 if bytecode_not_kept(spec.origin, sys.dont_write_bytecode) else 1
    if len(argv) == 3 and argv[0] == "enable":
        print(f"bytecode cache: {enable(argv[1], argv[2])} -> {argv[2]}")
        return 0
    if argv == ["fill"]:
        return fill()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
