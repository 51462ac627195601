#!/usr/bin/env bash
# torchrun for one node of a (multi-node) job; the same script inside and outside the image.
#
#   docker/launch.sh <training script or -m module> [its arguments...]
#
# Environment (defaults in brackets):
#   NNODES [1]            nodes in the job
#   NODE_RANK [0]         this node's rank (static rendezvous)
#   NPROC_PER_NODE        processes on this node [number of GPUs, or 2 on CPU]
#   MASTER_ADDR [127.0.0.1], MASTER_PORT [29500]   static rendezvous on node 0
#   RDZV_ENDPOINT         host:port of an elastic c10d rendezvous; replaces the static one
#   RDZV_ID [del-megatron]  job id for the elastic rendezvous
#   MAX_RESTARTS [3]      torchrun restarts the workers this often after a failure; training
#                         scripts resume from their last checkpoint (Megatron-LM: --load)
#   DEL_CPU [0]           1: gloo on CPU (OMP_NUM_THREADS=1), for tests and the tiny demo
set -euo pipefail

if [ "$#" -eq 0 ]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi

nnodes=${NNODES:-1}
max_restarts=${MAX_RESTARTS:-3}
if [ "${DEL_CPU:-0}" = "1" ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  nproc=${NPROC_PER_NODE:-2}
else
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
  nproc=${NPROC_PER_NODE:-${gpus:-1}}
fi

args=(--nnodes "$nnodes" --nproc-per-node "$nproc" --max-restarts "$max_restarts")
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  args+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-del-megatron}")
else
  args+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}"
         --master-port "${MASTER_PORT:-29500}")
fi

python=${PYTHON:-python}
exec "$python" -m torch.distributed.run "${args[@]}" "$@"
