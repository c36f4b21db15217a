#!/usr/bin/env bash
# Compile-check csrc/*.cu with nvcc on a machine whose torch is a CPU build (no GPU needed).
#
# A CPU torch wheel ships the c10/cuda headers but not the one header CMake generates for a
# CUDA build (c10/cuda/impl/cuda_cmake_macros.h); a one-line stand-in in a temp dir fills it.
# The objects are discarded: this checks that the kernels compile, it does not link them.
#   usage: tools/check_cuda_compile.sh [ARCH ...]   (default: 90)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCH_INC=$($PY -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
PY_INC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/c10/cuda/impl"
if [ ! -f "$TORCH_INC/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$SHIM/c10/cuda/impl/cuda_cmake_macros.h"
fi
ARCHS=${*:-90}
for src in csrc/*.cu; do
  for arch in $ARCHS; do
    nvcc -c -o "$SHIM/out.o" -std=c++20 -O3 -DR3_WITH_CUDA -DTORCH_EXTENSION_NAME=_C \
      -D_GLIBCXX_USE_CXX11_ABI=1 -gencode "arch=compute_${arch},code=sm_${arch}" \
      -I"$SHIM" -I"$TORCH_INC" -I"$TORCH_INC/torch/csrc/api/include" -I"$PY_INC" -Icsrc "$src"
    echo "ok: $src (sm_${arch})"
  done
done
