#!/usr/bin/env bash
# DEL continued pretraining of a Llama-2-7B-class model (TP 4, PP 1 on 8-GPU nodes).
# Tokenizer: Llama-2's SentencePiece model (splits digits); alpha 0.1 as in the DEL paper's
# CodeLlama runs.
set -euo pipefail
# shellcheck source=docker/examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_pretrain "${1:?launcher}" \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel \
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \
  --seq-length 4096 --max-position-embeddings 4096 \
  --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-5 \
  --swiglu \
  --untie-embeddings-and-output-weights --disable-bias-linear \
  --tokenizer-type Llama2Tokenizer --tokenizer-model "${TOKENIZER_MODEL:?Llama-2 tokenizer.model}"
