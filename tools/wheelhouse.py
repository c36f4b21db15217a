#!/usr/bin/env python3
"""Download everything `make install` needs on an offline CUDA machine into one folder.

    python tools/wheelhouse.py OUT [--python-version 3.12] [--cuda-major 13] [--platform manylinux_2_28_x86_64]
                                   [--megatron-rl] [--parts MIB]
    WHEELHOUSE=OUT make install            # then, on the GPU node

The folder gets, for the node's Python and CUDA major: the wheels of requirements.txt,
requirements-te.txt and requirements-fa4.txt (FlashAttention-4 and its CuTe DSL), TransformerEngine's
core and meta wheels, and the two sdists `make install` builds there (megatron-core, which it
patches, and transformer_engine_torch, built against the node's torch). Every pin comes from those
files, tools/install.sh and tools/patch_series.py; nothing else is resolved. The node's own torch is
reused, so no torch is downloaded. Files already in OUT are kept. With --megatron-rl, also the
wheels of requirements-megatron-rl.txt (Megatron-LM's train_rl.py example: `make megatron-rl-deps`).
With --parts MIB, the files are also laid out in OUT/part-1, OUT/part-2, ... of at most MIB each
(hard links; a larger file cut into NAME.chunk-NNN), for a node reached by transfers of limited
size: copy every part into one folder there and run the line this prints to join the chunks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_requirements import fa4_requirements, te_version  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIMPLE_INDEX = "https://pypi.org/simple"


def pins(path: Path) -> list[str]:
    """The ``name==version`` lines of a requirements file."""
    lines = (line.partition("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def download_wheels(requirements: list[str], out: Path, python_version: str, platform: str) -> None:
    """pip's binary download of exactly these pins for the target interpreter and platform."""
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
               "--platform", platform, "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_24_x86_64",
               "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
               "--platform", "any", "-d", str(out), *requirements]
    subprocess.run(command, check=True)


def download_sdist(name: str, version: str, out: Path) -> Path:
    """The sdist of ``name==version`` from the package index, checked against the index's sha256.

    pip cannot download these two without building their metadata, which needs a CUDA torch."""
    request = urllib.request.Request(f"{SIMPLE_INDEX}/{name}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    stem = f"{name.replace('-', '_')}-{version}.tar.gz"
    found = [f for f in files if f["filename"].lower() == stem.lower()]
    if not found:
        raise SystemExit(f"wheelhouse: the index has no sdist {stem}")
    target = out / found[0]["filename"]
    if not target.exists():
        with urllib.request.urlopen(found[0]["url"], timeout=300) as response:
            data = response.read()
        if hashlib.sha256(data).hexdigest() != found[0]["hashes"]["sha256"]:
            raise SystemExit(f"wheelhouse: {stem} does not match the index's sha256")
        partial = target.with_name(target.name + ".part")
        partial.write_bytes(data)
        partial.replace(target)
    return target


def megatron_core_base() -> tuple[str, str]:
    """megatron-core's base version and sdist name (tools/patch_series.py base)."""
    output = subprocess.run([sys.executable, str(ROOT / "tools" / "patch_series.py"), "base"], check=True,
                            capture_output=True, text=True).stdout.split()
    return output[0], output[1]


def wheel_pins(cuda_major: str, megatron_rl: bool) -> list[str]:
    """Every wheel's ``name==version`` for a node whose torch has CUDA ``cuda_major``."""
    te = te_version()
    wheels = (pins(ROOT / "requirements.txt") + pins(ROOT / "requirements-te.txt")
              + fa4_requirements(cuda_major)
              + [f"transformer_engine_cu{cuda_major}=={te}", f"transformer_engine=={te}"])
    if megatron_rl:
        wheels += pins(ROOT / "requirements-megatron-rl.txt")
    # A package two files pin (pydantic: TE's and train_rl.py's) is downloaded once; they must agree.
    versions = {}
    for pin in wheels:
        name, version = pin.split("==")
        key = re.sub(r"[-_.]+", "-", name).lower()
        if versions.setdefault(key, (pin, version))[1] != version:
            raise SystemExit(f"wheelhouse: {versions[key][0]} and {pin} are pinned in two requirements files")
    return [pin for pin, _ in versions.values()]


def split_parts(out: Path, limit: int) -> list[Path]:
    """The files of ``out`` laid out in ``out/part-N`` folders of at most ``limit`` bytes each (first
    fit, largest first): hard links, and a file larger than ``limit`` cut into ``NAME.chunk-000``,
    ``NAME.chunk-001``, ... (JOIN_CHUNKS puts it together again on the node)."""
    for old in out.glob("part-*"):
        shutil.rmtree(old)
    pieces = []  # (size, source, offset, name)
    for path in (f for f in out.iterdir() if f.is_file()):
        size = path.stat().st_size
        if size <= limit:
            pieces.append((size, path, None, path.name))
        else:
            pieces += [(min(limit, size - offset), path, offset, f"{path.name}.chunk-{offset // limit:03d}")
                       for offset in range(0, size, limit)]
    parts: list[list] = []  # [used, pieces]
    for piece in sorted(pieces, key=lambda p: (-p[0], p[3])):
        part = next((p for p in parts if p[0] + piece[0] <= limit), None)
        if part is None:
            part = [0, []]
            parts.append(part)
        part[0] += piece[0]
        part[1].append(piece)
    folders = []
    for number, (_, held) in enumerate(parts, start=1):
        folder = out / f"part-{number}"
        folder.mkdir()
        for size, source, offset, name in held:
            if offset is None:
                os.link(source, folder / name)
            else:
                with open(source, "rb") as src:
                    src.seek(offset)
                    (folder / name).write_bytes(src.read(size))
        folders.append(folder)
    return folders


# On the node, after copying every part into one folder: each cut file made whole again.
JOIN_CHUNKS = ('for c in *.chunk-000; do [ -e "$c" ] || continue; f=${c%.chunk-000}; '
               'cat "$f".chunk-* > "$f" && rm "$f".chunk-*; done')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--python-version", default="3.12", help="the GPU node's Python (default 3.12)")
    parser.add_argument("--cuda-major", default="13", help="the CUDA major of the node's torch (default 13)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64")
    parser.add_argument("--megatron-rl", action="store_true",
                        help="also requirements-megatron-rl.txt (make megatron-rl-deps)")
    parser.add_argument("--parts", type=int, metavar="MIB",
                        help="also lay the files out in OUT/part-N folders of at most MIB each")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    te = te_version()
    wheels = wheel_pins(args.cuda_major, args.megatron_rl)
    print(f"wheelhouse: {len(wheels)} wheels for Python {args.python_version}, CUDA {args.cuda_major}", flush=True)
    download_wheels(wheels, args.out, args.python_version, args.platform)
    base, _ = megatron_core_base()
    for name, version in (("megatron-core", base), ("transformer-engine-torch", te)):
        print(f"wheelhouse: sdist {download_sdist(name, version, args.out).name}", flush=True)
    total = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"wheelhouse: {args.out} holds {total / 2**20:.0f} MiB; on the node: WHEELHOUSE={args.out} make install")
    if args.parts:
        for folder in split_parts(args.out, args.parts * 2**20):
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"wheelhouse: {folder} {len(list(folder.iterdir()))} files, {size / 2**20:.0f} MiB")
        print(f"wheelhouse: on the node, in the folder the parts were copied into: {JOIN_CHUNKS}")


if __name__ == "__main__":
    main()
