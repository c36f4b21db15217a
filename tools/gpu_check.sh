#!/usr/bin/env bash
# Everything a GPU node should verify, in one go, logs under OUTDIR:
#   WHEELHOUSE=wheels bash tools/gpu_check.sh OUTDIR
# 1. make install (CUDA kernels built? TransformerEngine installed?)  2. the gpu-marked tests  3. the launcher on a
# synthetic dump, one rank per GPU, and its embedded R3 loop (metrics in OUTDIR/embedded.jsonl)  4. the packing
# benchmark, the update-pass (loop) benchmark with TE's grouped experts and with torch's, a host profile of one pass,
# the training-stack benchmark and the rollout engines' generation benchmark  5. `make test`, the whole suite, with per-test timings (stopped after
# SUITE_LIMIT seconds, default 480).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
make install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
.venv/bin/python -c 'import megatron_r3; print("kernels:", megatron_r3.kernel_info())' | tee "$out/kernels.log"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpus.log"
.venv/bin/python -m pip show transformer_engine transformer_engine_torch 2>/dev/null | grep -E "^(Name|Version)" \
  | tee "$out/transformer_engine.log"
# NCCL workers fork from the preloaded forkserver; if this platform's CUDA does not survive that, spawn them.
if ! .venv/bin/python -m pytest -p no:cacheprovider -q -x tests/test_launcher.py > "$out/nccl_smoke.log" 2>&1; then
  tail -30 "$out/nccl_smoke.log"
  echo "NCCL workers from the forkserver failed: falling back to R3_NCCL_WORKERS=spawn" | tee -a "$out/nccl_smoke.log"
  export R3_NCCL_WORKERS=spawn
fi
.venv/bin/python -m pytest -p no:cacheprovider -q -rfE -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | tail -3
ngpu=$(nvidia-smi -L | wc -l)
# OUTDIR is this check's own: a second check into it replaces the first one's dump and metrics.
.venv/bin/python tools/synthetic_rollout_dump.py --out "$out/synthetic.r3dump" --overwrite --num-samples 64 --num-layers 4 \
  --moe-layer-freq 0,1,1,1 --num-experts 8 --moe-router-topk 2 --vocab-size 1024
.venv/bin/python -m torch.distributed.run --nproc-per-node "$ngpu" launch/pretrain_gpt_r3.py \
  --rollout-dump "$out/synthetic.r3dump" --num-layers 4 --moe-layer-freq 0,1,1,1 --hidden-size 256 \
  --ffn-hidden-size 512 --num-attention-heads 8 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 \
  --vocab-size 1024 --seq-length 256 --micro-batch-size 4 --global-batch-size $((8 * ngpu)) \
  --expert-model-parallel-size "$ngpu" --train-iters 10 --lr 1e-3 --bf16 --moe-enable-routing-replay \
  > "$out/launch.log" 2>&1
echo "launcher exit status: $?" | tee -a "$out/launch.log"
grep " iteration " "$out/launch.log" | tail -3
.venv/bin/python -m torch.distributed.run --nproc-per-node "$ngpu" launch/pretrain_gpt_r3.py \
  --moe-enable-routing-replay --global-batch-size $((8 * ngpu)) --metrics-file "$out/embedded.jsonl" --overwrite-metrics-file \
  > "$out/embedded.log" 2>&1
echo "embedded run exit status: $?" | tee -a "$out/embedded.log"
grep " iteration " "$out/embedded.log" | tail -3
.venv/bin/python -m bench --out "$out/benchmarks.md" 2>&1 | tee "$out/bench.log" | tail -20
.venv/bin/python -m bench.step --data rollout --out "$out/loop-ep1.md" > "$out/loop-ep1.log" 2>&1
grep "^|" "$out/loop-ep1.log"
# TE's layers with torch's grouped experts (device offsets, no host sync on one expert rank), and where a pass's
# host time goes (own time per function, one pass per variant).
.venv/bin/python -m bench.step --data rollout --moe-grouped-gemm-impl torch --out "$out/loop-ep1-torch-experts.md" \
  > "$out/loop-ep1-torch-experts.log" 2>&1
grep "^|" "$out/loop-ep1-torch-experts.log"
.venv/bin/python -m bench.step --data rollout --rounds 1 --steps 1 --variants replay+host-splits --profile-host 30 \
  > "$out/host-profile.log" 2>&1
.venv/bin/python -m bench.training_stack --out "$out/training-stack.md" > "$out/training-stack.log" 2>&1
grep "^|" "$out/training-stack.log"
.venv/bin/python -m bench.generation --out "$out/generation.md" > "$out/generation.log" 2>&1
grep "^|" "$out/generation.log"
if [ "$ngpu" -ge 2 ]; then
  .venv/bin/python -m torch.distributed.run --nproc-per-node 2 -m bench.step --ep 2 --data rollout \
    --out "$out/loop-ep2.md" > "$out/loop-ep2.log" 2>&1; grep "^|" "$out/loop-ep2.log"
fi
timeout "${SUITE_LIMIT:-480}" make test PYTEST_ARGS="-p no:cacheprovider -v -rfE --durations=30 --junitxml=$out/junit.xml" \
  > "$out/test.log" 2>&1
echo "make test exit status: $?" | tee -a "$out/test.log"
tail -40 "$out/test.log"
