#!/usr/bin/env bash
# Shared by the model examples: runs Megatron-LM's patched pretrain_gpt.py through the launcher,
# or with PRETRAIN_MODULE set the drop-in module it names (the hybrid models' pretrain_hybrid_del).
# Usage (from an example): run_pretrain <launcher> <model flags...>
#
# Where the weights come from (docs/continued-pretraining.md):
#   CHECKPOINT_DIR holds a checkpoint         resume it (--load)
#   else PRETRAINED_CHECKPOINT is set         start from those converted weights: Megatron-LM
#                                             loads the model only (no optimizer, iteration 0)
#                                             and saves to CHECKPOINT_DIR (--pretrained-checkpoint)
#   else FROM_SCRATCH=1                       random weights, on purpose
#   else                                      refused: an empty folder would silently mean a
#                                             randomly initialised model
#
# NUMERICAL_LOSS=ce runs an A/B's control arm (the same command line but that one flag);
# TENSORBOARD_DIR adds --tensorboard-dir, where both arms log the same tags.
set -euo pipefail

has_checkpoint() {  # a Megatron checkpoint folder has its tracker file
  [ -f "$1/latest_checkpointed_iteration.txt" ]
}

choose_start() {  # sets START to the flags that choose the starting weights, or refuses
  local ckpt=$1 pretrained=${PRETRAINED_CHECKPOINT:-}
  if [ -n "$pretrained" ] && ! has_checkpoint "$pretrained"; then
    echo "PRETRAINED_CHECKPOINT=$pretrained holds no Megatron checkpoint (no" \
      "latest_checkpointed_iteration.txt): convert the Hugging Face model first" \
      "(docs/continued-pretraining.md)" >&2
    return 1
  fi
  if has_checkpoint "$ckpt"; then
    START=(--load "$ckpt")
  elif [ -n "$pretrained" ]; then
    START=(--load "$ckpt" --pretrained-checkpoint "$pretrained")
  elif [ "${FROM_SCRATCH:-0}" = 1 ]; then
    START=(--load "$ckpt")
  else
    echo "CHECKPOINT_DIR=$ckpt holds no checkpoint and PRETRAINED_CHECKPOINT is not set: this" \
      "would train from random weights. Set PRETRAINED_CHECKPOINT to the converted model" \
      "(docs/continued-pretraining.md), or FROM_SCRATCH=1 if training from scratch is meant" >&2
    return 1
  fi
}

run_pretrain() {
  local launcher=$1
  shift
  local data=${DATA_PATH:?set DATA_PATH to a Megatron indexed dataset prefix}
  local ckpt=${CHECKPOINT_DIR:?set CHECKPOINT_DIR (saved to and resumed from)}
  choose_start "$ckpt"
  local megatron_lm=${MEGATRON_LM_DIR:-/opt/Megatron-LM} script
  script=("$megatron_lm/pretrain_gpt.py")
  if [ -n "${PRETRAIN_MODULE:-}" ]; then  # a drop-in finds the checkout by MEGATRON_LM_DIR
    export MEGATRON_LM_DIR=$megatron_lm
    script=(-m "$PRETRAIN_MODULE")
  fi
  "$launcher" "${script[@]}" \
    "$@" \
    --data-path "$data" --split 99,1,0 \
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH_SIZE:-256}" \
    --lr "${LR:-2e-5}" --min-lr "${MIN_LR:-2e-6}" --lr-decay-style cosine --lr-warmup-iters 100 \
    --train-iters "${TRAIN_ITERS:-2000}" --bf16 --use-distributed-optimizer \
    --save "$ckpt" "${START[@]}" --save-interval 200 \
    --log-interval 10 --eval-interval 200 --eval-iters 10 \
    ${TENSORBOARD_DIR:+--tensorboard-dir "$TENSORBOARD_DIR"} \
    --numerical-loss "${NUMERICAL_LOSS:-del}" \
    --del-alpha "${DEL_ALPHA:-0.1}" --del-reduction "${DEL_REDUCTION:-digit}" \
    ${DEL_DIGIT_SHARE:+--del-digit-share "$DEL_DIGIT_SHARE"}
}
