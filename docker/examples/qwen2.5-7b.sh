#!/usr/bin/env bash
# DEL continued pretraining of a Qwen2.5-7B-class model (TP 4, PP 1). Tokenizer: Qwen2.5's
# Hugging Face tokenizer (one digit per token); alpha 1.28, the weight the DEL paper's Qwen2.5
# run applied (its script wrote 0.01: docs/DEL.md).
set -euo pipefail
# shellcheck source=docker/examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
DEL_ALPHA=${DEL_ALPHA:-1.28} run_pretrain "${1:?launcher}" \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel \
  --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 \
  --group-query-attention --num-query-groups 4 --add-qkv-bias \
  --seq-length 4096 --max-position-embeddings 32768 \
  --position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-6 \
  --swiglu \
  --untie-embeddings-and-output-weights --disable-bias-linear \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?Qwen2.5 tokenizer dir}"
