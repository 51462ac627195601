#!/usr/bin/env bash
# DEL continued pretraining of a Mistral-7B-class model (TP 4, PP 2). Tokenizer: Mistral's
# SentencePiece v1 model (digits split; mistral-common ships it as tokenizer.model.v1).
set -euo pipefail
# shellcheck source=docker/examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_pretrain "${1:?launcher}" \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --sequence-parallel \
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
  --group-query-attention --num-query-groups 8 \
  --seq-length 4096 --max-position-embeddings 32768 \
  --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-5 \
  --swiglu \
  --untie-embeddings-and-output-weights --disable-bias-linear \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?tokenizer.model.v1}"
