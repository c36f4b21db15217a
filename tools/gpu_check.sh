#!/usr/bin/env bash
# Everything a GPU node should verify, in one go, logs under OUTDIR:
#   WHEELHOUSE=wheels bash tools/gpu_check.sh OUTDIR
# 1. make install (CUDA kernels built?)  2. the gpu-marked tests
# 3. the whole suite with per-test timings  4. the packing benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
make install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
.venv/bin/python -c 'import megatron_r3; print("kernels:", megatron_r3.kernel_info())' | tee "$out/kernels.log"
pytest=(.venv/bin/python -m pytest -p no:cacheprovider -q)
"${pytest[@]}" -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | tail -3
"${pytest[@]}" tests --durations=25 ${SUITE_TIMEOUT:+--timeout=$SUITE_TIMEOUT} 2>&1 | tee "$out/test.log" | tail -30
.venv/bin/python -m bench --out "$out/benchmarks.md" 2>&1 | tail -20
