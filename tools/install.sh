#!/usr/bin/env bash
# make install: a .venv with pinned dependencies, the patched megatron-core
# 0.19.2+r3, and megatron_r3 with its compiled extension.
#
# megatron-core 0.17 and later declare requires-python >= 3.12, but their
# sources build and run on Python 3.11 (the patch series imports Triton lazily,
# so no Triton is needed either). The sdist is therefore downloaded and
# installed with pip's --ignore-requires-python; it is pinned by sha256.
#
#   PYTHON        interpreter to build the venv from (default: python3)
#   WHEELHOUSE    folder of wheels and the sdists (megatron-core, transformer_engine_torch):
#                 install offline
#   R3_WITHOUT_TE 1: on a CUDA machine, install without TransformerEngine (the local layers)
#   R3_WITHOUT_FA4 1: on a CUDA machine, install without FlashAttention-4 (then Megatron's
#                 inference engine, the GPU rollout engine, needs another flash-attn installed)
#
# Where torch has CUDA, TransformerEngine TE_VERSION is installed too: the core wheel for
# torch's CUDA major, the meta wheel, requirements-te.txt, and the torch extension built from
# its sdist against this torch (it is published only as an sdist).
#
# Where torch has CUDA, FlashAttention-4 (requirements-fa4.txt, its CuTe DSL for torch's CUDA major)
# is installed too: the attention Megatron's dynamic inference engine runs on, the launcher's
# rollout engine on GPUs.
#
# The venv gets its own `torchrun` (where torch comes from the host, the host's `torchrun`
# belongs to another Python), so `source .venv/bin/activate` makes the README's commands work.
#
# Where torch has no CUDA, requirements-megatron-rl.txt is installed too (the CPU tests of the
# train_rl.py example use it); a CUDA machine gets it from `make megatron-rl-deps`.
#
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
TORCH_CPU=torch==2.13.0
TE_VERSION=2.20.2

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'make install: error: %s\n' "$*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || die "'$PYTHON' not found; set PYTHON=/path/to/python3 (3.10 or newer)"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null \
  || die "$PYTHON is $("$PYTHON" -V 2>&1); Python 3.10 or newer is required"
command -v patch >/dev/null || die "GNU patch is needed to apply patches/ (apt-get install patch)"
"$PYTHON" -m venv --help >/dev/null 2>&1 || die "$PYTHON has no venv module (apt-get install python3-venv)"

PIP_ARGS=(--disable-pip-version-check)
if [ -n "${WHEELHOUSE:-}" ]; then
  [ -d "$WHEELHOUSE" ] || die "WHEELHOUSE=$WHEELHOUSE is not a folder"
  WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
  PIP_ARGS+=(--no-index --find-links "$WHEELHOUSE")
fi

# A CUDA torch already on the host (a GPU node's image) is reused, never replaced.
host_torch_site=$("$PYTHON" - <<'EOF' 2>/dev/null || true
import os, torch
if torch.version.cuda:
    print(os.path.dirname(os.path.dirname(torch.__file__)))
EOF
)

step "virtual environment ($VENV)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
VPY=$PWD/$VENV/bin/python
export PATH=$PWD/$VENV/bin:$PATH
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -n "$host_torch_site" ]; then
  # A .pth file, not --system-site-packages: the host python may itself be a venv.
  echo "$host_torch_site" > "$site/_megatron_r3_host_torch.pth"
  echo "reusing the host's CUDA torch from $host_torch_site"
fi

step "torch"
if "$VPY" -c 'import torch' 2>/dev/null; then
  "$VPY" -c 'import torch; print("torch", torch.__version__, "(cuda " + str(torch.version.cuda) + ")")'
else
  "$VPY" -m pip install "${PIP_ARGS[@]}" "$TORCH_CPU" \
    || die "could not install $TORCH_CPU (offline? put its wheel in WHEELHOUSE)"
fi

step "pinned dependencies (requirements.txt)"
"$VPY" -m pip install -q "${PIP_ARGS[@]}" -r requirements.txt \
  || die "could not install requirements.txt (offline? put the wheels in WHEELHOUSE)"

cuda_major=$("$VPY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')

step "Megatron-LM's train_rl.py dependencies (requirements-megatron-rl.txt)"
if [ -z "$cuda_major" ]; then
  # The CPU tests of the train_rl.py example (its assets, the RL loop's env loader) import them.
  "$VPY" -m pip install -q "${PIP_ARGS[@]}" -r requirements-megatron-rl.txt \
    || die "could not install requirements-megatron-rl.txt (offline? put the wheels in WHEELHOUSE)"
else
  echo "a CUDA machine: 'make megatron-rl-deps' installs them where the train_rl.py example runs"
fi

step "TransformerEngine"
if [ -z "$cuda_major" ]; then
  echo "torch has no CUDA: no TransformerEngine (the launcher runs the local layers)"
elif [ "${R3_WITHOUT_TE:-}" = 1 ]; then
  echo "R3_WITHOUT_TE=1: no TransformerEngine (the launcher runs the local layers)"
elif [ "$("$VPY" -c 'import importlib.metadata as m; print(m.version("transformer_engine_torch"))' 2>/dev/null)" = "$TE_VERSION" ] \
    && "$VPY" -c 'import transformer_engine.pytorch' 2>/dev/null; then
  echo "transformer-engine $TE_VERSION is installed (CUDA $cuda_major)"
else
  te_missing() {
    die "TransformerEngine $TE_VERSION for CUDA $cuda_major could not be installed: $1.
Offline, WHEELHOUSE needs transformer_engine_cu$cuda_major-$TE_VERSION-*.whl, transformer_engine-$TE_VERSION-*.whl,
transformer_engine_torch-$TE_VERSION.tar.gz and the wheels of requirements-te.txt.
Set R3_WITHOUT_TE=1 to install without it (the local layers)."
  }
  "$VPY" -m pip install -q "${PIP_ARGS[@]}" --no-deps -r requirements-te.txt \
    || te_missing "its dependencies (requirements-te.txt)"
  "$VPY" -m pip install -q "${PIP_ARGS[@]}" --no-deps \
    "transformer_engine_cu$cuda_major==$TE_VERSION" "transformer_engine==$TE_VERSION" \
    || te_missing "the core wheel transformer_engine_cu$cuda_major or the meta wheel"
  echo "building transformer_engine_torch $TE_VERSION against torch $("$VPY" -c 'import torch; print(torch.__version__)') (a few minutes)"
  NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VPY" -m pip install -q "${PIP_ARGS[@]}" \
    --no-build-isolation --no-deps "transformer_engine_torch==$TE_VERSION" \
    || te_missing "the torch extension transformer_engine_torch (built from its sdist; see the compiler output above)"
  "$VPY" -c 'import transformer_engine.pytorch' || te_missing "'import transformer_engine.pytorch' fails (above)"
  echo "transformer-engine $TE_VERSION installed (CUDA $cuda_major)"
fi

step "FlashAttention-4 (Megatron's inference engine)"
if [ -z "$cuda_major" ]; then
  echo "torch has no CUDA: no FlashAttention-4 (rollouts from the built-in engine)"
elif [ "${R3_WITHOUT_FA4:-}" = 1 ]; then
  echo "R3_WITHOUT_FA4=1: no FlashAttention-4 (Megatron's inference engine needs another flash-attn)"
elif "$VPY" tools/gpu_requirements.py fa4-imports 2>/dev/null; then
  echo "flash-attn-4 is installed (CUDA $cuda_major)"
else
  "$VPY" -m pip install -q "${PIP_ARGS[@]}" --no-deps -r <("$VPY" tools/gpu_requirements.py fa4 "$cuda_major") \
    || die "FlashAttention-4 for CUDA $cuda_major could not be installed (offline: WHEELHOUSE needs the wheels of
requirements-fa4.txt for CUDA $cuda_major; 'make wheelhouse' downloads them). R3_WITHOUT_FA4=1 installs without it."
  "$VPY" tools/gpu_requirements.py fa4-imports \
    || die "flash-attn-4 was installed but does not import (above); R3_WITHOUT_FA4=1 installs without it"
  echo "flash-attn-4 installed (CUDA $cuda_major)"
fi

read -r BASE SDIST_NAME SDIST_SHA256 < <("$VPY" tools/patch_series.py base)
step "megatron-core $BASE + patches/"
digest=$("$VPY" tools/patch_series.py digest)
stamp=$VENV/.megatron-r3-series
installed=$("$VPY" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)
if [ "$installed" = "$BASE+r3" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$digest" ]; then
  echo "megatron-core $BASE+r3 is up to date (series $digest)"
else
  mkdir -p build
  sdist=build/$SDIST_NAME
  if [ -n "${WHEELHOUSE:-}" ] && [ -f "$WHEELHOUSE/$SDIST_NAME" ]; then
    cp "$WHEELHOUSE/$SDIST_NAME" "$sdist"
  elif [ ! -f "$sdist" ]; then
    [ -z "${WHEELHOUSE:-}" ] || die "$SDIST_NAME is not in WHEELHOUSE=$WHEELHOUSE"
    "$VPY" -m pip download -q --no-deps --no-binary :all: --ignore-requires-python \
      "megatron-core==$BASE" -d build \
      || die "could not download the megatron-core $BASE sdist from PyPI"
  fi
  echo "$SDIST_SHA256  $sdist" | sha256sum -c --quiet - \
    || die "$sdist does not match the pinned sha256 of megatron-core $BASE"
  "$VPY" tools/patch_series.py build "$sdist" build/megatron-core
  # NO_VCS_VERSION: package_info would append the enclosing git checkout's commit (ours).
  NO_VCS_VERSION=1 "$VPY" -m pip install -q "${PIP_ARGS[@]}" --no-build-isolation --no-deps \
    --ignore-requires-python ./build/megatron-core \
    || die "pip could not install the patched megatron-core from build/megatron-core"
  echo "$digest" > "$stamp"
fi

step "megatron_r3 and its csrc/ extension"
"$VPY" -m pip install -q "${PIP_ARGS[@]}" --no-build-isolation --no-deps -e . \
  || die "building megatron_r3 failed (see the compiler output above)"
"$VPY" - <<'EOF'
import importlib.metadata as m
import megatron_r3
print("megatron-core", m.version("megatron-core"), "| megatron_r3", megatron_r3.__version__,
      "| kernels:", megatron_r3.kernel_info())
EOF
# torch from the host has no console script in the venv; the host's `torchrun` runs another Python.
if [ ! -x "$VENV/bin/torchrun" ]; then
  printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' "$VPY" > "$VENV/bin/torchrun"
  chmod +x "$VENV/bin/torchrun"
fi

echo
echo "make install: done. Run 'make test'; 'source .venv/bin/activate' puts the venv's python and torchrun first."
