#!/usr/bin/env bash
# The train_rl example's model, trained on countdown solved (supervised) before RL, offline, on 1 or 2 GPUs.
#
#   MEGATRON=/path/to/Megatron-LM launch/countdown_sft_r3.sh [OUT]
#   INIT=OUT/checkpoints MEGATRON=... launch/train_rl_r3.sh RUN      # RL from these weights
#
# RL starts from a trained model: a random-init MoE's experts barely differ, so the part of the
# train/inference mismatch that routing replay removes is small there (docs/megatron_rl.md). This runs
# Megatron-LM's pretrain_gpt.py on the example's model (launch/train_rl_common.sh) over answered countdown
# chats (launch/countdown_sft_data.py, rendered as the RL loop renders its prompts) and saves the weights
# to OUT/checkpoints (no optimizer state).
# OUT (default runs/countdown_sft): assets, the corpus (OUT/assets/sft), checkpoints, log.
# Environment: MEGATRON and PYTHON as for launch/train_rl_r3.sh, NPROC (GPUs, default 1), SFT_ITERS
# (default 300), SFT_DOCUMENTS (answered tasks in the corpus, default 20000), SEQ_LEN (default 512),
# EXTRA_ARGS (more pretrain_gpt.py flags).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/train_rl_common.sh"
SFT_ITERS=${SFT_ITERS:-300}
SFT_DOCUMENTS=${SFT_DOCUMENTS:-20000}
[[ "$SFT_ITERS" =~ ^[1-9][0-9]*$ ]] || refuse "SFT_ITERS=$SFT_ITERS: give a positive number of iterations"
[[ "$SFT_DOCUMENTS" =~ ^[1-9][0-9]*$ ]] || refuse "SFT_DOCUMENTS=$SFT_DOCUMENTS: give a positive number of tasks"
NPROC=${NPROC:-1}
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] && (( 64 % NPROC == 0 )) || refuse "NPROC=$NPROC: give a number of GPUs that divides 64"
OUT=$(mkdir -p "${1:-runs/countdown_sft}" && cd "${1:-runs/countdown_sft}" && pwd)

offline_env "$OUT"
[ -f "$OUT/assets/countdown.yaml" ] || "$PYTHON" "$HERE/megatron_rl_assets.py" "$OUT/assets"
CORPUS="$OUT/assets/sft/countdown"
# In the checkout: its megatron package (Megatron-LM main's) writes the data set and loads the agent.
[ -f "$CORPUS.idx" ] || (cd "$MEGATRON" && PYTHONPATH="$MEGATRON" "$PYTHON" "$HERE/countdown_sft_data.py" \
  "$OUT/assets" "$CORPUS" --documents "$SFT_DOCUMENTS" --overwrite)  # no index: no whole corpus there

model_args "$OUT/assets/tokenizer"
DATA_ARGS=(
  --data-path "$CORPUS" --split 100,0,0 --data-cache-path "$OUT/data-cache" --seq-length "$SEQ_LEN"
)
TRAIN_ARGS=(
  # One microbatch per rank and iteration: the step of this small model is bound by the host's issue time.
  --train-iters "$SFT_ITERS" --micro-batch-size $((64 / NPROC)) --global-batch-size 64
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --clip-grad 1.0 --weight-decay 0.01
  --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --seed 1234
  --log-interval 10 --eval-interval 1000000 --eval-iters 0
  --save "$OUT/checkpoints" --save-interval "$SFT_ITERS" --no-save-optim --no-save-rng
  --tensorboard-dir "$OUT/tensorboard" --distributed-timeout-minutes 30
)

cd "$MEGATRON"
run_logged "$OUT/countdown_sft-np$NPROC.log" \
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" ${EXTRA_ARGS:-}
