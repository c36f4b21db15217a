#!/usr/bin/env bash
# Megatron-LM's own GRPO loop (train_rl.py) with rollout routing replay, offline, on 1 or 2 GPUs.
#
#   MEGATRON=/path/to/Megatron-LM launch/train_rl_r3.sh [OUT]
#
# MEGATRON: a Megatron-LM main checkout with both series (make patch MEGATRON=...).
# OUT (default runs/train_rl_r3): assets (launch/megatron_rl_assets.py), checkpoints, logs. A run resumes
# from OUT/checkpoints where it holds one (Megatron's --load), so ITERS counts from the first run.
# Environment: NPROC (GPUs, default 1), ITERS (train iterations, default 50), REPLAY (1: replay,
# 0: route live; default 1), SEQ_LEN (context of a rollout, prompt included, and of a packed bin;
# default 512, at least 384: a countdown prompt is up to ~300 characters of the character-level
# tokenizer, and a random-init model generates to the end of the context), METRICS (1:
# --rl-routing-replay-metrics, default 1 with REPLAY=1), INIT (a checkpoint folder to start from,
# Megatron's --pretrained-checkpoint: launch/countdown_sft_r3.sh trains one; default: random init),
# EXTRA_ARGS (more train_rl.py flags), MEGATRON_RL_INFERENCE_SERVER_PORT (the port the run serves its rollouts
# on, default 8294: another run on the node needs another), PYTHON (Python >= 3.12, which Megatron-LM main needs;
# default: this repository's .venv/bin/python, else python3; train_rl.py's dependencies: make
# megatron-rl-deps), GRAPHS (1: the engine decodes under its CUDA graphs, with the flags of Megatron-LM's own
# MoE RL config examples/rl/model_configs/nemotron6_3b_moe.sh; default 0: eager). The model
# (launch/train_rl_common.sh): qwen3_30b_a3b_moe.sh's architecture (RMSNorm, SwiGLU, QK-norm, GQA, RoPE,
# aux-loss router, alltoall dispatcher, every layer MoE), shrunk to 4 layers, hidden 512, 32 experts top-4.
# docs/megatron_rl.md.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/train_rl_common.sh"
# Megatron-LM's RL loop serves its rollouts on MEGATRON_RL_INFERENCE_SERVER_PORT (default 8294; the series'
# 0004) with SO_REUSEPORT: a second run on the same port binds it too and the kernel shares the requests between
# the two runs' engines, so a run gets completions its own engine never recorded (KeyError in
# compute_group_stats; seen on 2 x H200).
PORT=${MEGATRON_RL_INFERENCE_SERVER_PORT:-8294}
if [ -n "${MEGATRON_RL_INFERENCE_SERVER_PORT:-}" ]; then
  [[ "$PORT" =~ ^[0-9]+$ ]] || refuse "MEGATRON_RL_INFERENCE_SERVER_PORT=$PORT is not a port number"
  grep -q MEGATRON_RL_INFERENCE_SERVER_PORT "$MEGATRON/megatron/rl/rl_utils.py" 2>/dev/null \
    || refuse "$MEGATRON's RL loop serves on port 8294 whatever MEGATRON_RL_INFERENCE_SERVER_PORT says: it lacks the Megatron-LM series' 0004 (make patch MEGATRON=...)"
fi
(exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null \
  && refuse "port $PORT is in use: another train_rl.py (or another server) runs on this node; a second run needs its own MEGATRON_RL_INFERENCE_SERVER_PORT"
if [ -n "${INIT:-}" ]; then
  [ -f "$INIT/latest_checkpointed_iteration.txt" ] \
    || refuse "INIT=$INIT holds no Megatron checkpoint (latest_checkpointed_iteration.txt): launch/countdown_sft_r3.sh makes one"
  INIT=$(cd "$INIT" && pwd)
fi
GRAPHS=${GRAPHS:-0}
[[ "$GRAPHS" = 0 || "$GRAPHS" = 1 ]] || refuse "GRAPHS=$GRAPHS: give 1 (the engine decodes under CUDA graphs) or 0"
OUT=$(mkdir -p "${1:-runs/train_rl_r3}" && cd "${1:-runs/train_rl_r3}" && pwd)
NPROC=${NPROC:-1}
ITERS=${ITERS:-50}
REPLAY=${REPLAY:-1}
METRICS=${METRICS:-$REPLAY}

offline_env "$OUT"
[ -f "$OUT/assets/countdown.yaml" ] || "$PYTHON" "$HERE/megatron_rl_assets.py" "$OUT/assets"

REPLAY_ARGS=()
[ "$REPLAY" = 1 ] && REPLAY_ARGS+=(--moe-enable-routing-replay)
[ "$METRICS" = 1 ] && REPLAY_ARGS+=(--rl-routing-replay-metrics)
# GRAPHS=1: nemotron6_3b_moe.sh's flags for the engine's graphs (and common.sh's persistence): graphs of
# decode-only steps, kept across suspends; on a graphed step each expert takes the most tokens it could get
# (Megatron's drop-and-pad at a capacity that drops none), so no MoE layer copies its token counts to the
# host, which capture refuses. The engine records the routes under its graphs into static buffers; the RL
# loop removes the graphs for training, where the routes replay.
GRAPH_ARGS=()
[ "$GRAPHS" = 1 ] && GRAPH_ARGS+=(--cuda-graph-impl local --decode-only-cuda-graphs --rl-persist-cuda-graphs
                                  --moe-pad-experts-for-cuda-graph-inference)

model_args "$OUT/assets/tokenizer"
RL_ARGS=(
  --perform-rl-step --langrl-env-config "$OUT/assets/countdown.yaml"
  --seq-length "$SEQ_LEN" --inference-max-seq-length "$SEQ_LEN" --inference-max-requests 32
  --micro-batch-size 1 --global-batch-size 32 --grpo-group-size 4 --grpo-prompts-per-step 8
  --grpo-iterations 1 --grpo-kl-beta 0.0 --grpo-clamp-eps-lower 0.2 --grpo-clamp-eps-upper 0.2
  --rl-use-sequence-packing --rl-skip-bos-token
  # Eager unless GRAPHS=1: without Megatron's padding of experts on graphed steps (below) its experts
  # (SequentialMLP) split tokens by a host copy of their counts, which graph capture refuses.
  --inference-dynamic-batching-buffer-size-gb 4
)
TRAIN_ARGS=(
  --train-iters "$ITERS" --lr 1e-6 --min-lr 1e-7 --lr-warmup-samples 0 --clip-grad 1.0 --weight-decay 0.01
  --optimizer adam --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --seed 1234
  --mock-data --log-interval 1 --eval-interval 100000 --eval-iters 0 --save-interval 100000
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" ${INIT:+--pretrained-checkpoint "$INIT"}
  --tensorboard-dir "$OUT/tensorboard" --distributed-timeout-minutes 30
)

cd "$MEGATRON"
# --standalone: one node, a free rendezvous port (another run on the node keeps its own).
run_logged "$OUT/train_rl-replay$REPLAY-np$NPROC.log" \
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" train_rl.py \
  "${MODEL_ARGS[@]}" "${RL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${REPLAY_ARGS[@]}" "${GRAPH_ARGS[@]}" ${EXTRA_ARGS:-}
