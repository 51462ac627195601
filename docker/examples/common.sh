#!/usr/bin/env bash
# Shared by the model examples: runs Megatron-LM's patched pretrain_gpt.py through the launcher.
# Usage (from an example): run_pretrain <launcher> <model flags...>
set -euo pipefail

run_pretrain() {
  local launcher=$1
  shift
  local data=${DATA_PATH:?set DATA_PATH to a Megatron indexed dataset prefix}
  local ckpt=${CHECKPOINT_DIR:?set CHECKPOINT_DIR (saved to and resumed from)}
  "$launcher" "${MEGATRON_LM_DIR:-/opt/Megatron-LM}/pretrain_gpt.py" \
    "$@" \
    --data-path "$data" --split 99,1,0 \
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --lr "${LR:-2e-5}" --min-lr "${MIN_LR:-2e-6}" --lr-decay-style cosine --lr-warmup-iters 100 \
    --train-iters "${TRAIN_ITERS:-2000}" --bf16 --use-distributed-optimizer \
    --save "$ckpt" --load "$ckpt" --save-interval 200 \
    --log-interval 10 --eval-interval 200 --eval-iters 10 \
    --numerical-loss del --del-alpha "${DEL_ALPHA:-0.1}" --del-reduction "${DEL_REDUCTION:-token}"
}
