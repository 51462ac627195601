#!/usr/bin/env bash
# The first thing to run on a GPU: is the CUDA path correct and fast? Under 10 minutes on one
# H200: environment, correctness at real sizes, logits-free gradients, speed and memory against
# Megatron's CE, its fused CE and TE's, host syncs, recompiles, a CUDA-graph capture and, with
# MEGATRON_LM_DIR set, one Megatron-LM pretrain_gpt.py run with logits-free off and on
# (benchmarks/gpu_check.py says what each stage checks). Every result goes to
# $OUT/gpu_check.jsonl as it completes; the summary table is printed at the end, whatever
# stopped the run. Exit status: 0 all passed, 1 something failed, 2 no GPU.
#
#   bash benchmarks/gpu_check.sh                      # in the del-megatron image or a CUDA env
#   MEGATRON_LM_DIR=/opt/Megatron-LM bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --cpu                # toy sizes on the CPU (what CI runs)
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-benchmarks/results}
PYTHON=${PYTHON:-python}
LIMIT_S=${GPU_CHECK_LIMIT_S:-570}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# SIGINT first (the stage in progress is cut short, what is written stays), then SIGKILL.
timeout --signal=INT --kill-after=20 "$LIMIT_S" "$PYTHON" benchmarks/gpu_check.py --out "$OUT" "$@"
status=$?
echo
echo "== gpu_check summary ($OUT/gpu_check.jsonl) =="
"$PYTHON" benchmarks/gpu_check.py --summary "$OUT/gpu_check.jsonl"
summary_status=$?
if [[ $status -eq 124 || $status -eq 130 || $status -eq 137 ]]; then
  echo "gpu_check: stopped after ${LIMIT_S} s; the stages above are what completed" >&2
  exit 1
fi
if [[ $status -eq 2 ]]; then exit 2; fi
exit $(( status != 0 || summary_status != 0 ))
