#!/usr/bin/env bash
# DEL continued pretraining of a Nemotron-H-8B-class hybrid model (TP 4, PP 1): 52 layers, 24
# Mamba-2, 4 attention and 24 MLP, through Megatron-LM's pretrain_hybrid.py with the drop-in
# (del_megatron.megatron.pretrain_hybrid_del). The published nvidia/Nemotron-H-8B-Base-8K shape:
# 8,100,852,736 parameters (tests/test_model_examples.py). Its layer spec is Megatron-LM's own
# (Transformer Engine, mamba_ssm, causal_conv1d: a GPU image). Tokenizer: Nemotron-H's Hugging
# Face tokenizer (131,072 pieces); `del-megatron check` reads it and prints the digit ids.
set -euo pipefail
# shellcheck source=docker/examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PRETRAIN_MODULE=del_megatron.megatron.pretrain_hybrid_del run_pretrain "${1:?launcher}" \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --sequence-parallel \
  --hybrid-layer-pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" \
  --hidden-size 4096 --ffn-hidden-size 21504 --num-attention-heads 32 \
  --group-query-attention --num-query-groups 8 --kv-channels 128 \
  --mamba-num-heads 128 --mamba-head-dim 64 --mamba-state-dim 128 --mamba-num-groups 8 \
  --squared-relu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
  --position-embedding-type none --untie-embeddings-and-output-weights \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --seq-length 8192 --max-position-embeddings 8192 \
  --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?Nemotron-H tokenizer dir}"
