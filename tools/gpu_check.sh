#!/usr/bin/env bash
# What a GPU node should verify, in stages, logs under OUTDIR:
#   WHEELHOUSE=wheels bash tools/gpu_check.sh OUTDIR [STAGE ...]
# Stages (default: all, in this order; each also fits a command limited to 10 minutes on 2 GPUs):
#   install  make install (CUDA kernels built? TransformerEngine installed?)
#   tests    the gpu-marked tests, one line per test (-v), the 30 slowest at the end
#   launch   the launcher on a synthetic dump, one rank per GPU, and its embedded R3 loop
#            (metrics in OUTDIR/embedded.jsonl)
#   bench    the packing benchmark, the update pass on TE's grouped experts and on torch's, a host
#            profile of one pass, EP=2 with two GPUs, the training stack, generation tokens/s
#   suite    `make test`, the whole suite (stopped after SUITE_LIMIT seconds, default 480)
# A stage's time limit: STAGE_LIMIT seconds (default 540); a stage cut there says so in its log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUTDIR [install|tests|launch|bench|suite ...]}
shift
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(install tests launch bench suite)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
limit=${STAGE_LIMIT:-540}
ngpu=$(nvidia-smi -L | wc -l)

install() {
  make install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; return 1; }
  .venv/bin/python -c 'import megatron_r3; print("kernels:", megatron_r3.kernel_info())' | tee "$out/kernels.log"
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpus.log"
  .venv/bin/python -m pip show transformer_engine transformer_engine_torch 2>/dev/null | grep -E "^(Name|Version)" \
    | tee "$out/transformer_engine.log"
}

tests() {
  # NCCL workers fork from the preloaded forkserver; if this platform's CUDA does not survive that, spawn them.
  if ! .venv/bin/python -m pytest -p no:cacheprovider -q -x tests/test_launcher.py > "$out/nccl_smoke.log" 2>&1; then
    tail -30 "$out/nccl_smoke.log"
    echo "NCCL workers from the forkserver failed: falling back to R3_NCCL_WORKERS=spawn" | tee -a "$out/nccl_smoke.log"
    export R3_NCCL_WORKERS=spawn
  fi
  # SIGINT at the limit: pytest stops and still prints the failures it has (SIGTERM loses them)
  timeout -s INT -k 30 "$limit" .venv/bin/python -m pytest -p no:cacheprovider -v -rfE -m gpu tests --durations=30 \
    > "$out/gpu_tests.log" 2>&1
  echo "gpu tests exit status: $? (124: cut after $limit s)" | tee -a "$out/gpu_tests.log"
  grep -E "::.* (PASSED|FAILED|ERROR|XFAIL|XPASS)" "$out/gpu_tests.log" | grep -vc PASSED | xargs echo "not passed:"
  grep -E "^(FAILED|ERROR) " "$out/gpu_tests.log"
}

launch() {
  .venv/bin/python tools/synthetic_rollout_dump.py --out "$out/synthetic.r3dump" --overwrite --num-samples 64 \
    --num-layers 4 --moe-layer-freq 0,1,1,1 --num-experts 8 --moe-router-topk 2 --vocab-size 1024
  .venv/bin/python -m torch.distributed.run --nproc-per-node "$ngpu" launch/pretrain_gpt_r3.py \
    --rollout-dump "$out/synthetic.r3dump" --num-layers 4 --moe-layer-freq 0,1,1,1 --hidden-size 256 \
    --ffn-hidden-size 512 --num-attention-heads 8 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 \
    --vocab-size 1024 --seq-length 256 --micro-batch-size 4 --global-batch-size $((8 * ngpu)) \
    --expert-model-parallel-size "$ngpu" --train-iters 10 --lr 1e-3 --bf16 --moe-enable-routing-replay \
    > "$out/launch.log" 2>&1
  echo "launcher exit status: $?" | tee -a "$out/launch.log"
  grep " iteration " "$out/launch.log" | tail -3
  .venv/bin/python -m torch.distributed.run --nproc-per-node "$ngpu" launch/pretrain_gpt_r3.py \
    --moe-enable-routing-replay --global-batch-size $((8 * ngpu)) --metrics-file "$out/embedded.jsonl" \
    --overwrite-metrics-file > "$out/embedded.log" 2>&1
  echo "embedded run exit status: $?" | tee -a "$out/embedded.log"
  grep " iteration " "$out/embedded.log" | tail -3
}

bench() {
  local step=(--data rollout --rounds 3 --steps 2 --warmup 2)
  .venv/bin/python -m bench --out "$out/benchmarks.md" > "$out/bench.log" 2>&1; tail -5 "$out/bench.log"
  .venv/bin/python -m bench.step "${step[@]}" --out "$out/loop-ep1.md" > "$out/loop-ep1.log" 2>&1
  grep "^| " "$out/loop-ep1.log"
  .venv/bin/python -m bench.step "${step[@]}" --moe-grouped-gemm-impl torch --out "$out/loop-ep1-torch-experts.md" \
    > "$out/loop-ep1-torch-experts.log" 2>&1
  grep "^| " "$out/loop-ep1-torch-experts.log"
  .venv/bin/python -m bench.step --data rollout --rounds 1 --steps 1 --warmup 1 --variants replay+host-splits \
    --moe-grouped-gemm-impl torch --profile-host 40 > "$out/host-profile.log" 2>&1
  if [ "$ngpu" -ge 2 ]; then
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 -m bench.step --ep 2 "${step[@]}" \
      --moe-grouped-gemm-impl torch --out "$out/loop-ep2.md" > "$out/loop-ep2.log" 2>&1
    grep "^| " "$out/loop-ep2.log"
  fi
  .venv/bin/python -m bench.training_stack --out "$out/training-stack.md" > "$out/training-stack.log" 2>&1
  grep "^| " "$out/training-stack.log"
  .venv/bin/python -m bench.generation --out "$out/generation.md" > "$out/generation.log" 2>&1
  grep "^| " "$out/generation.log"
}

suite() {
  timeout -s INT -k 30 "${SUITE_LIMIT:-480}" make test PYTEST_ARGS="-p no:cacheprovider -v -rfE --durations=30 --junitxml=$out/junit.xml" \
    > "$out/test.log" 2>&1
  echo "make test exit status: $?" | tee -a "$out/test.log"
  tail -40 "$out/test.log"
}

for stage in "${stages[@]}"; do
  case "$stage" in
    install|tests|launch|bench|suite) ;;
    *) echo "tools/gpu_check.sh: unknown stage '$stage' (install, tests, launch, bench, suite)" >&2; exit 2 ;;
  esac
done
for stage in "${stages[@]}"; do
  echo "== $stage ($(date -u +%H:%M:%S))"
  if [ "$stage" = bench ] || [ "$stage" = launch ]; then
    # the stage's commands run one after another; the whole stage is bounded like the tests
    export -f "$stage"; export out ngpu limit
    timeout "$limit" bash -c "$stage" || echo "stage $stage: exit status $? (124: cut after $limit s)"
  else
    "$stage" || { echo "stage $stage failed"; [ "$stage" = install ] && exit 1; }
  fi
done
