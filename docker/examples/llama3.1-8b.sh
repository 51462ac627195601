#!/usr/bin/env bash
# DEL continued pretraining of a Llama-3.1-8B-class model (TP 4, PP 1). Tokenizer: Llama-3.1's
# Hugging Face tokenizer, which cuts numbers into chunks of up to three digits: DEL trains its
# ten single-digit tokens by default (add --del-slot-logits length for every digit of its
# multi-digit tokens: docs/DEL.md); alpha 0.1, the default (no DEL paper run used Llama-3).
set -euo pipefail
# shellcheck source=docker/examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_pretrain "${1:?launcher}" \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel \
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
  --group-query-attention --num-query-groups 8 \
  --seq-length 8192 --max-position-embeddings 131072 \
  --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8 \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu \
  --untie-embeddings-and-output-weights --disable-bias-linear \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?Llama-3.1 tokenizer dir}"
