#!/usr/bin/env bash
# The first thing to run on a GPU: is the CUDA path correct and fast? Under 10 minutes on one
# H200: environment; with MEGATRON_LM_DIR set, Megatron-LM's pretrain_gpt.py through the drop-in,
# logits-free off and on, digit and token reductions, at DP 2 on 2+ GPUs; correctness at real
# sizes, logits-free gradients, speed and memory against Megatron's CE, its fused CE and TE's,
# host syncs, recompiles, a CUDA-graph capture (benchmarks/gpu_check/ says what each checks).
# Each stage runs in a process of its own and is killed, with every process it started, at its
# time limit; the limits add up to less than GPU_CHECK_LIMIT_S (570 s; 900 s with --cpu, where
# a busy CI machine may be slow). Every result goes to $OUT/gpu_check.jsonl as it completes;
# the summary (results, then each stage's limit and time) is printed at the end, whatever
# stopped the run. Exit status: 0 all passed, 1 something failed or was killed, 2 no GPU.
#
#   bash benchmarks/gpu_check.sh                      # in the del-megatron image or a CUDA env
#   MEGATRON_LM_DIR=/opt/Megatron-LM bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --cpu                # toy sizes on the CPU (what CI runs)
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-benchmarks/results}
PYTHON=${PYTHON:-python}
case " $* " in
  *" --cpu "*) LIMIT_S=${GPU_CHECK_LIMIT_S:-900} ;;
  *) LIMIT_S=${GPU_CHECK_LIMIT_S:-570} ;;
esac
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# The stages' limits fit LIMIT_S; this is the backstop. SIGINT first (gpu_check kills the stage
# in progress and writes that it stopped), then SIGKILL.
timeout --signal=INT --kill-after=10 "$LIMIT_S" \
  "$PYTHON" -m benchmarks.gpu_check --out "$OUT" --envelope-s "$LIMIT_S" --no-summary "$@"
status=$?
echo
echo "== gpu_check summary ($OUT/gpu_check.jsonl) =="
"$PYTHON" -m benchmarks.gpu_check --summary "$OUT/gpu_check.jsonl"
summary_status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
  echo "gpu_check: stopped after ${LIMIT_S} s; the stages above are what completed" >&2
  exit 1
fi
if [[ $status -eq 2 ]]; then exit 2; fi
exit $(( status != 0 || summary_status != 0 ))
