#!/usr/bin/env bash
# GPU check, under 10 minutes on one modern GPU: correctness of every kernel against the CPU
# float64 reference, then the benchmark grid on the GPU(s). Writes JSON to $OUT (default
# benchmarks/results). Needs torch with CUDA and megatron-core in the active Python.
#
#   bash benchmarks/gpu_check.sh            # in the del-megatron Docker image, or any CUDA env
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
if [[ "$GPUS" -lt 1 ]]; then
  echo "gpu_check.sh: no CUDA device visible" >&2
  exit 2
fi
TPS="1"
for tp in 2 4 8; do
  if [[ "$GPUS" -ge "$tp" ]]; then TPS="$TPS $tp"; fi
done

timeout 120 "$PYTHON" benchmarks/gpu_check.py --json "$OUT/gpu_check.json"
# shellcheck disable=SC2086  # TPS is a list of sizes
timeout 150 "$PYTHON" benchmarks/bench_loss.py --device cuda --tp $TPS --dtype bf16 \
  --tokens 4096 16384 --vocab 32000 128256 151936 --reps 5 \
  --impls megatron_ce megatron_fused del del_compiled del_recompute del_softmax del_naive \
  --json "$OUT/bench_loss_gpu.json"
# The logits-free path (numerical_linear_loss, what --del-logits-free runs) against the output
# layer's matmul + numerical_lm_loss: CUDA time and peak memory side by side (issue targets:
# <= 0.25x memory, <= 1.3x time), on the "auto" weight-gradient route and each route forced.
# shellcheck disable=SC2086
timeout 300 "$PYTHON" benchmarks/bench_loss.py --device cuda --linear --tp $TPS \
  --dtype bf16 fp32 --tokens 4096 16384 --vocab 151936 --hidden 512 1024 --reps 3 \
  --impls linear_materialised linear_logits_free linear_logits_free_forward \
  linear_logits_free_backward --json "$OUT/bench_linear_gpu.json"
