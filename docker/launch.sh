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
#   DEL_CPU [0]           1: CPU and gloo, for tests, laptops and the tiny demo: OMP_NUM_THREADS=1,
#                         and Megatron-LM's own pretrain() runs on CPU in every process of the job
#                         (del_megatron.cpu: its site folder first on PYTHONPATH, DEL_MEGATRON_CPU=1,
#                         CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron-LM asserts for TP > 1)
#   PYTHON [python]       the interpreter that runs torchrun
# Two containers as two nodes of an elastic job on ONE host need `docker run --pid host`: both
# would otherwise be torchrun's node "<host name>_1" (same host name with --network host, PID 1).
set -euo pipefail

if [ "$#" -eq 0 ]; then
  sed -n '2,21p' "$0" >&2
  exit 2
fi

python=${PYTHON:-python}
# Run as an account without a writable home (docker run --user <uid>): caches go to a temp folder.
if [ ! -w "${HOME:-/}" ]; then
  HOME=$(mktemp -d)
  export HOME
fi
nnodes=${NNODES:-1}
max_restarts=${MAX_RESTARTS:-3}
if [ "${DEL_CPU:-0}" = "1" ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  site=$("$python" -m del_megatron.cpu --site-dir)
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export DEL_MEGATRON_CPU=1
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  nproc=${NPROC_PER_NODE:-2}
else
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
  [ "${gpus:-0}" -gt 0 ] || gpus=1
  nproc=${NPROC_PER_NODE:-$gpus}
fi

args=(--nnodes "$nnodes" --nproc-per-node "$nproc" --max-restarts "$max_restarts")
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  args+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-del-megatron}")
else
  args+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}"
         --master-port "${MASTER_PORT:-29500}")
fi

exec "$python" -m torch.distributed.run "${args[@]}" "$@"
