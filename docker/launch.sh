#!/usr/bin/env bash
# torchrun for one node of a (multi-node) job; the same script inside and outside the image.
#
#   docker/launch.sh <training script or -m module> [its arguments...]
#
# Environment (defaults in brackets):
#   NNODES [1]            nodes in the job
#   NODE_RANK [0]         this node's rank (static rendezvous)
#   NPROC_PER_NODE        processes on this node [the GPUs CUDA would show a worker: the entries
#                         of CUDA_VISIBLE_DEVICES when it is set, else `nvidia-smi --list-gpus`;
#                         2 with DEL_CPU=1]
#   MASTER_ADDR [127.0.0.1], MASTER_PORT [29500]   static rendezvous on node 0
#   RDZV_ENDPOINT         host:port of an elastic c10d rendezvous; replaces the static one
#   RDZV_ID [del-megatron]  job id for the elastic rendezvous
#   MAX_RESTARTS          torchrun restarts the workers this often after a failure; training scripts
#                         resume from their last checkpoint (Megatron-LM: --load). [3 on one node or
#                         with RDZV_ENDPOINT; 0 for a static multi-node job, which refuses more: its
#                         nodes restart alone and the job does not re-form; use RDZV_ENDPOINT]
#   CUDA_DEVICE_MAX_CONNECTIONS [1]  Megatron-LM asserts 1 with TP > 1 or CP > 1 before Blackwell;
#                         left unset with --use-megatron-fsdp / --use-torch-fsdp2 (they assert not 1)
#   DEL_CPU [0]           1: CPU and gloo, for tests, laptops and the tiny demo: OMP_NUM_THREADS=1,
#                         and Megatron-LM's own pretrain() runs on CPU in every process of the job
#                         (del_megatron.cpu: its site folder first on PYTHONPATH, DEL_MEGATRON_CPU=1,
#                         CUDA_DEVICE_MAX_CONNECTIONS=1)
#   PYTHON [python]       the interpreter that runs torchrun
# Two containers as two nodes of an elastic job on ONE host need `docker run --pid host`: both
# would otherwise be torchrun's node "<host name>_1" (same host name with --network host, PID 1).
set -euo pipefail

die() {
  echo "launch.sh: $*" >&2
  exit 2
}

if [ "$#" -eq 0 ]; then
  sed -n '2,/^set /{/^#/p;}' "$0" >&2
  exit 2
fi

# How many GPUs a worker's CUDA will enumerate: CUDA_VISIBLE_DEVICES's entries up to the first
# one CUDA rejects (it stops there, e.g. at -1 or SLURM's NoDevFiles), at most as many as
# nvidia-smi lists; nvidia-smi alone when it is unset (nvidia-smi ignores it). Empty: unknown.
# NVIDIA_VISIBLE_DEVICES is not read: the container runtime applies it before the container
# starts, so nvidia-smi in the container lists those GPUs only (and NGC images set it to `all`).
visible_gpus() {
  local listed entry n=0
  listed=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU ' || true)
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ]; then
    [ "${listed:-0}" -gt 0 ] && echo "$listed"
    return 0
  fi
  local -a entries=()
  IFS=, read -ra entries <<<"$CUDA_VISIBLE_DEVICES"
  for entry in "${entries[@]}"; do
    entry=${entry//[[:space:]]/}
    [[ $entry =~ ^([0-9]+|GPU-[0-9A-Fa-f-]+|MIG-[0-9A-Za-z/-]+)$ ]] || break
    n=$((n + 1))
  done
  if [ "${listed:-0}" -gt 0 ] && [ "$listed" -lt "$n" ]; then
    n=$listed
  fi
  echo "$n"
}

python=${PYTHON:-python}
# Run as an account without a writable home (docker run --user <uid>): caches go to a temp folder.
if [ ! -w "${HOME:-/}" ]; then
  HOME=$(mktemp -d)
  export HOME
fi
nnodes=${NNODES:-1}
if [ "${DEL_CPU:-0}" = "1" ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  site=$("$python" -m del_megatron.cpu --site-dir)
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export DEL_MEGATRON_CPU=1
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  nproc=${NPROC_PER_NODE:-2}
else
  # Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for TP > 1 or CP > 1 on GPUs before
  # Blackwell (megatron/training/arguments.py), and its own scripts export it; its FSDP scripts
  # unset it instead, as Megatron-FSDP and torch FSDP2 assert that it is not 1.
  fsdp=0
  for arg in "$@"; do
    case $arg in --use-megatron-fsdp | --use-torch-fsdp2) fsdp=1 ;; esac
  done
  if [ "$fsdp" = 0 ]; then
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  fi
  if [ -n "${NPROC_PER_NODE:-}" ]; then
    nproc=$NPROC_PER_NODE
  else
    nproc=$(visible_gpus)
    if [ -z "$nproc" ]; then
      echo "launch.sh: nvidia-smi lists no GPU and NPROC_PER_NODE is unset: 1 process" >&2
      nproc=1
    elif [ "$nproc" = 0 ]; then
      die "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' leaves no GPU visible: request GPUs" \
        "(e.g. sbatch --gpus-per-node), set NPROC_PER_NODE, or DEL_CPU=1 to run on CPU"
    fi
  fi
fi

# Restarts: the elastic rendezvous re-forms the whole job after a failure (every node's agent
# restarts its workers in a new round); a static one does so only on one node. Across nodes each
# agent would restart its own workers alone, the others' would wait in their collectives, and a
# node that is gone cannot be replaced.
if [ -z "${RDZV_ENDPOINT:-}" ] && [ "$nnodes" != 1 ]; then
  max_restarts=${MAX_RESTARTS:-0}
  [ "$max_restarts" = 0 ] ||
    die "MAX_RESTARTS=$max_restarts with a static rendezvous across NNODES=$nnodes nodes:" \
      "torchrun would restart one node's workers alone and the job would not re-form. For" \
      "restarts use the elastic rendezvous (RDZV_ENDPOINT=host:port, the same on every node);" \
      "otherwise MAX_RESTARTS=0"
else
  max_restarts=${MAX_RESTARTS:-3}
fi

args=(--nnodes "$nnodes" --nproc-per-node "$nproc" --max-restarts "$max_restarts")
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  args+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-del-megatron}")
else
  args+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}"
    --master-port "${MASTER_PORT:-29500}")
fi

exec "$python" -m torch.distributed.run "${args[@]}" "$@"
