#!/usr/bin/env python3
"""The pinned packages `make install` adds on a CUDA machine, for one CUDA major.

    gpu_requirements.py fa4 CUDA_MAJOR        requirements-fa4.txt's lines for that CUDA major
    gpu_requirements.py fa4-imports           exit 0 where flash-attn-4 is installed at its pin and imports
    gpu_requirements.py te-version            TransformerEngine's pinned version (tools/install.sh's TE_VERSION)

A line of requirements-fa4.txt tagged ``# cuNN`` is for CUDA major NN only (the CuTe DSL's
libraries come per CUDA major); untagged lines are for every one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FA4_REQUIREMENTS = ROOT / "requirements-fa4.txt"
INSTALL_SCRIPT = ROOT / "tools" / "install.sh"


def fa4_requirements(cuda_major: str) -> list[str]:
    """The pins of requirements-fa4.txt for ``cuda_major`` (e.g. ``"13"``)."""
    pins = []
    for line in FA4_REQUIREMENTS.read_text().splitlines():
        requirement, _, comment = line.partition("#")
        requirement = requirement.strip()
        if not requirement:
            continue
        tag = comment.strip()
        if tag and tag != f"cu{cuda_major}":
            continue
        pins.append(requirement)
    return pins


def fa4_pinned_version() -> str:
    """flash-attn-4's pinned version."""
    for pin in fa4_requirements(""):
        name, _, version = pin.partition("==")
        if name == "flash-attn-4":
            return version
    raise SystemExit(f"{FA4_REQUIREMENTS} pins no flash-attn-4")


def fa4_imports() -> bool:
    """Whether flash-attn-4 is installed at its pin and the kernels Megatron-Core imports load."""
    try:
        if importlib.metadata.version("flash-attn-4") != fa4_pinned_version():
            return False
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401  (what Megatron-Core imports)
    except (importlib.metadata.PackageNotFoundError, ImportError) as error:
        print(f"flash-attn-4 does not import: {error}", file=sys.stderr)
        return False
    return True


def te_version() -> str:
    """TE_VERSION of tools/install.sh (the one place TransformerEngine is pinned)."""
    match = re.search(r"^TE_VERSION=(\S+)$", INSTALL_SCRIPT.read_text(), re.MULTILINE)
    if match is None:
        raise SystemExit(f"{INSTALL_SCRIPT} sets no TE_VERSION")
    return match.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fa4").add_argument("cuda_major")
    sub.add_parser("fa4-imports")
    sub.add_parser("te-version")
    args = parser.parse_args()
    if args.command == "fa4":
        print("\n".join(fa4_requirements(args.cuda_major)))
    elif args.command == "fa4-imports":
        sys.exit(0 if fa4_imports() else 1)
    else:
        print(te_version())


if __name__ == "__main__":
    main()
