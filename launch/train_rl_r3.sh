#!/usr/bin/env bash
# Megatron-LM's own GRPO loop (train_rl.py) with rollout routing replay, offline, on 1 or 2 GPUs.
#
#   MEGATRON=/path/to/Megatron-LM launch/train_rl_r3.sh [OUT]
#
# MEGATRON: a Megatron-LM main checkout with both series (make patch MEGATRON=...).
# OUT (default runs/train_rl_r3): assets (launch/megatron_rl_assets.py), checkpoints, logs.
# Environment: NPROC (GPUs, default 1), ITERS (train iterations, default 50), REPLAY (1: replay,
# 0: route live; default 1), SEQ_LEN (context of a rollout, prompt included, and of a packed bin;
# default 512, at least 384: a countdown prompt is up to ~300 characters of the character-level
# tokenizer, and the random-init model generates to the end of the context), METRICS (1: --rl-routing-replay-metrics, default 1 with REPLAY=1),
# EXTRA_ARGS (more train_rl.py flags), PYTHON (Python >= 3.12, which Megatron-LM main needs;
# default: this repository's .venv/bin/python, else python3; train_rl.py's dependencies: make
# megatron-rl-deps). The model: qwen3_30b_a3b_moe.sh's architecture (RMSNorm, SwiGLU, QK-norm,
# GQA, RoPE, aux-loss router, alltoall dispatcher, every layer MoE), shrunk to 4 layers, hidden
# 512, 32 experts top-4, random init. docs/megatron_rl.md.
set -euo pipefail

: "${MEGATRON:?set MEGATRON to a Megatron-LM main checkout with both series (make patch MEGATRON=...)}"
refuse() { echo "train_rl_r3.sh: $*" >&2; exit 2; }
[ -d "$MEGATRON" ] || refuse "MEGATRON=$MEGATRON is not a folder"
MEGATRON=$(cd "$MEGATRON" && pwd)
[ -f "$MEGATRON/train_rl.py" ] || refuse "$MEGATRON has no train_rl.py: not a Megatron-LM main checkout"
[ -f "$MEGATRON/megatron/rl/routing_replay.py" ] \
  || refuse "$MEGATRON lacks the Megatron-LM series: make patch MEGATRON=$MEGATRON (or make megatron-lm-checkout)"
# Megatron-LM's RL loop serves its rollouts on port 8294 (fixed in rl_utils.py) with SO_REUSEPORT: a second run
# on the node binds it too and the kernel shares the requests between the two runs' engines, so a run gets
# completions its own engine never recorded (KeyError in compute_group_stats; seen on 2 x H200).
(exec 3<>/dev/tcp/127.0.0.1/8294) 2>/dev/null \
  && refuse "port 8294 is in use: another train_rl.py (or another server) runs on this node; one run at a time"
HERE=$(cd "$(dirname "$0")" && pwd)
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
OUT=$(mkdir -p "${1:-runs/train_rl_r3}" && cd "${1:-runs/train_rl_r3}" && pwd)
NPROC=${NPROC:-1}
ITERS=${ITERS:-50}
REPLAY=${REPLAY:-1}
METRICS=${METRICS:-$REPLAY}

# Nothing is downloaded: the tokenizer and the tasks are made here, HuggingFace stays offline.
export HF_HOME="$OUT/hf" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export CUDA_DEVICE_MAX_CONNECTIONS=1
[ -f "$OUT/assets/countdown.yaml" ] || "$PYTHON" "$HERE/megatron_rl_assets.py" "$OUT/assets"

REPLAY_ARGS=()
[ "$REPLAY" = 1 ] && REPLAY_ARGS+=(--moe-enable-routing-replay)
[ "$METRICS" = 1 ] && REPLAY_ARGS+=(--rl-routing-replay-metrics)

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
  # engine's pin) reads as a local window of -1 tokens to the left. With `flash` the trainer's and the
  # engine's log-probs looked unrelated (k3 0.19 on 1 x H200). The engine calls FA4 itself. docs/megatron_rl.md.
  # Apex is not installed: its fused weight-gradient accumulation (Megatron's default) is off. fp32
  # routing, as Megatron recommends from 32 experts on.
  --no-gradient-accumulation-fusion --moe-router-dtype fp32
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/assets/tokenizer"
)
RL_ARGS=(
  --perform-rl-step --langrl-env-config "$OUT/assets/countdown.yaml"
  --seq-length "$SEQ_LEN" --inference-max-seq-length "$SEQ_LEN" --inference-max-requests 32
  --micro-batch-size 1 --global-batch-size 32 --grpo-group-size 4 --grpo-prompts-per-step 8
  --grpo-iterations 1 --grpo-kl-beta 0.0 --grpo-clamp-eps-lower 0.2 --grpo-clamp-eps-upper 0.2
  --rl-use-sequence-packing --rl-skip-bos-token
  # No inference CUDA graphs: without --moe-grouped-gemm Megatron's experts (SequentialMLP) split
  # tokens by a host copy of their counts, which graph capture refuses.
  --inference-dynamic-batching-buffer-size-gb 4
)
TRAIN_ARGS=(
  --train-iters "$ITERS" --lr 1e-6 --min-lr 1e-7 --lr-warmup-samples 0 --clip-grad 1.0 --weight-decay 0.01
  --optimizer adam --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --seed 1234
  --mock-data --log-interval 1 --eval-interval 100000 --eval-iters 0 --save-interval 100000
  --save "$OUT/checkpoints" --tensorboard-dir "$OUT/tensorboard" --distributed-timeout-minutes 30
)

cd "$MEGATRON"
LOG="$OUT/train_rl-replay$REPLAY-np$NPROC.log"
# The run writes its log itself and this script follows it, rather than `| tee`: a pipe stays open while any
# process the run leaves behind holds it, and a run on 1 x H200 logged its whole shutdown and still never
# returned through `| tee`. A background job ignores SIGINT, so INT and TERM reach torchrun as TERM (waits stay interruptible).
# --standalone: one node, a free rendezvous port (another run on the node keeps its own).
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" train_rl.py \
  "${MODEL_ARGS[@]}" "${RL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${REPLAY_ARGS[@]}" ${EXTRA_ARGS:-} > "$LOG" 2>&1 &
RUN=$!
trap 'kill -TERM "$RUN" 2>/dev/null' INT TERM
tail -n +1 -f --pid="$RUN" "$LOG" &
TAIL=$!
status=0
wait "$RUN" || status=$?
wait "$TAIL" || true
exit "$status"
