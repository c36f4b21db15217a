# Sourced by launch/train_rl_r3.sh and launch/countdown_sft_r3.sh: the checks of MEGATRON and PYTHON, SEQ_LEN,
# and the example's model, which both scripts must build alike (the RL run loads the SFT run's weights).
# Needs HERE (the launch folder). Sets MEGATRON (absolute), PYTHON, SEQ_LEN; defines refuse and model_args.
refuse() { echo "$(basename "$0"): $*" >&2; exit 2; }
: "${MEGATRON:?set MEGATRON to a Megatron-LM main checkout with both series (make patch MEGATRON=...)}"
[ -d "$MEGATRON" ] || refuse "MEGATRON=$MEGATRON is not a folder"
MEGATRON=$(cd "$MEGATRON" && pwd)
[ -f "$MEGATRON/train_rl.py" ] || refuse "$MEGATRON has no train_rl.py: not a Megatron-LM main checkout"
[ -f "$MEGATRON/megatron/rl/routing_replay.py" ] \
  || refuse "$MEGATRON lacks the Megatron-LM series: make patch MEGATRON=$MEGATRON (or make megatron-lm-checkout)"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "$HERE/../.venv/bin/python" ] && PYTHON=$HERE/../.venv/bin/python
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
  || refuse "$PYTHON is not Python >= 3.12 (Megatron-LM main imports typing.override): set PYTHON"
SEQ_LEN=${SEQ_LEN:-512}
[[ "$SEQ_LEN" =~ ^[0-9]+$ && "$SEQ_LEN" -ge 384 && "$SEQ_LEN" -le 1024 ]] \
  || refuse "SEQ_LEN=$SEQ_LEN: give 384..1024 (countdown prompts take up to ~300 tokens; positions end at 1024)"
[[ " ${EXTRA_ARGS:-} " =~ [[:space:]]--attention-backend[[:space:]=]+flash[[:space:]] ]] \
  && refuse "EXTRA_ARGS --attention-backend flash: TE 2.20.2 would train on FlashAttention-4, whose pinned 4.0.0b36 \
reads TE's causal window (-1, 0) as a local one (not causal attention); the example trains with fused"

# Nothing is downloaded: the tokenizer and the tasks are made under OUT/assets, HuggingFace stays offline.
offline_env() {
  export HF_HOME="$1/hf" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
  export CUDA_DEVICE_MAX_CONNECTIONS=1
}

# model_args TOKENIZER_DIR: the example's model, qwen3_30b_a3b_moe.sh's architecture shrunk (docs/megatron_rl.md).
model_args() {
  MODEL_ARGS=(
    --num-layers 4 --hidden-size 512 --ffn-hidden-size 1536 --num-attention-heads 8 --kv-channels 64
    --group-query-attention --num-query-groups 2 --normalization RMSNorm --norm-epsilon 1e-6
    --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000 --use-rotary-position-embeddings
    --swiglu --disable-bias-linear --qk-layernorm --untie-embeddings-and-output-weights
    --max-position-embeddings 1024 --make-vocab-size-divisible-by 128
    --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 128 --moe-layer-freq 1
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001 --moe-token-dispatcher-type alltoall
    --attention-dropout 0.0 --hidden-dropout 0.0 --attention-softmax-in-fp32 --no-masked-softmax-fusion
    --bf16 --transformer-impl transformer_engine --attention-backend fused --te-rng-tracker
    # Training attention: cuDNN's (TE's own choice on Hopper and later), not `flash`: TE 2.20.2 hands
    # FlashAttention-4 the causal window (-1, 0), which FA4 4.0.0b24 read as causal and 4.0.0b36 (the
    # engine's pin) reads as a local window of -1 tokens to the left (on 1 x H200: all-zero output, and
    # the trainer's and the engine's log-probs unrelated, k3 0.19). The engine calls FA4 itself.
    # Apex is not installed: its fused weight-gradient accumulation (Megatron's default) is off. fp32
    # routing, as Megatron recommends from 32 experts on.
    --no-gradient-accumulation-fusion --moe-router-dtype fp32
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$1"
  )
}

# run_logged LOG COMMAND...: run COMMAND writing LOG, follow LOG here, exit with COMMAND's status.
# Not `| tee`: a pipe stays open while any process the run leaves behind holds it, and a train_rl.py run on
# 1 x H200 logged its whole shutdown and still never returned through `| tee`. A background job ignores
# SIGINT, so INT and TERM reach the command (torchrun) as TERM; the waits stay interruptible.
run_logged() {
  local log=$1; shift
  : > "$log"  # before tail starts: the job opens it only once scheduled, and tail gives up on a missing file
  "$@" > "$log" 2>&1 &
  local run=$!
  trap 'kill -TERM '"$run"' 2>/dev/null' INT TERM
  tail -n +1 -f --pid="$run" "$log" &
  local follow=$! status=0
  wait "$run" || status=$?
  wait "$follow" || true
  exit "$status"
}
