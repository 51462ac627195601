#!/usr/bin/env bash
# The image test: builds docker/Dockerfile with its default megatron-core and Megatron-LM versions on
# a CPU stand-in for the NGC PyTorch base, then runs the image for real, as its non-root user:
#   1. the smoke step (docker/smoke.py) from the image's working directory, also as another uid
#      on a mounted output folder;
#   2. Megatron-LM's patched /opt/Megatron-LM/pretrain_gpt.py, --numerical-loss del, on CPU through
#      docker/launch.sh (DEL_CPU=1), one container as one node (2 processes, TP=2);
#   3. two containers as two nodes (NNODES=2, 1 process each, TP=2 across them): the same losses;
#   4. the same with the worker of node 1 killed mid-run: torchrun restarts it, it resumes from the
#      checkpoint, and every logged iteration has the losses of step 2;
#   5. the elastic variant (RDZV_ENDPOINT) with two containers: the same losses.
#
#   bash tests/image/run.sh            (as root; about 8 minutes and 12 GB of disk from scratch)
#
# It installs docker.io and mmdebstrap if missing, starts its own Docker engine (data under a temp
# folder) unless one answers already (DOCKER_HOST), and removes what it made at the end: containers,
# images, the engine it started, the temp folder.
# Environment:
#   IMAGE_TEST_DIR     work folder [a new mktemp -d]; with IMAGE_TEST_KEEP=1 a rerun reuses it
#   IMAGE_TEST_KEEP    1: keep the engine, images and work folder (stop with IMAGE_TEST_STOP=1)
#   IMAGE_TEST_STOP    1: only stop and remove what a kept run left in IMAGE_TEST_DIR
#   MEGATRON_LM_DIR    a Megatron-LM checkout to build from (a git repository with the tag, or a
#                      plain tree of that release) [../shared/megatron-lm/<tag>.tar.gz]
#   DEBIAN_MIRROR      [http://deb.debian.org/debian]
#   MEGATRON_CORE_VERSION, MEGATRON_LM_TAG   build other releases than the Dockerfile's defaults
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/image
arg_default() { sed -n "s/^ARG $1=//p" "$root/docker/Dockerfile"; }
mlm_tag=${MEGATRON_LM_TAG:-$(arg_default MEGATRON_LM_TAG)}
core_version=${MEGATRON_CORE_VERSION:-$(arg_default MEGATRON_CORE_VERSION)}
image=del-megatron-test/del-megatron:latest
standin=del-megatron-test/pytorch-cpu:standin
debian=del-megatron-test/debian:trixie
keep=${IMAGE_TEST_KEEP:-0}
work=${IMAGE_TEST_DIR:-}
if [ -z "$work" ]; then
  work=$(mktemp -d /tmp/del-image-test.XXXXXX)
fi
mkdir -p "$work"
work=$(cd "$work" && pwd)
t0=$(date +%s)
log() { printf '[image-test %4ss] %s\n' "$(($(date +%s) - t0))" "$*"; }
die() { log "FAILED: $*"; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ---- the engine ---------------------------------------------------------------------------------
docker_bin=/usr/bin/docker
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v git >/dev/null || need+=(git)
if [ "${#need[@]}" -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -x "$docker_bin" ] || docker_bin=$(command -v docker)
docker() { "$docker_bin" "$@"; }

own_engine=0
if [ -S "$work/docker.sock" ]; then
  export DOCKER_HOST=unix://$work/docker.sock
fi
if ! docker info >/dev/null 2>&1; then
  own_engine=1
  export DOCKER_HOST=unix://$work/docker.sock
  if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (data root $work/docker)"
    mkdir -p "$work/docker"
    nohup dockerd --data-root "$work/docker" --exec-root "$work/docker-exec" \
      --host "$DOCKER_HOST" --pidfile "$work/dockerd.pid" --storage-driver=overlay2 \
      --iptables=false --ip6tables=false --bridge=none >"$work/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 "$work/dockerd.log"; die "dockerd did not start"; }
  fi
elif [ "$work/docker.sock" = "${DOCKER_HOST#unix://}" ]; then
  own_engine=1
fi

containers=()
cleanup() {
  local rc=$?
  set +e
  [ -f "$work/gitd.pid" ] && kill "$(cat "$work/gitd.pid")" 2>/dev/null && rm -f "$work/gitd.pid"
  for c in "${containers[@]}"; do docker rm -f "$c" >/dev/null 2>&1; done
  if [ "$keep" != "1" ]; then
    if [ "$own_engine" = "1" ]; then
      if [ -f "$work/dockerd.pid" ]; then
        pid=$(cat "$work/dockerd.pid")
        kill "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      fi
      rm -rf "$work"
    else
      docker rmi -f "$image" "$standin" "$debian" >/dev/null 2>&1
      rm -rf "$work"
    fi
    log "cleaned up (exit $rc)"
  else
    log "kept $work (engine: DOCKER_HOST=$DOCKER_HOST; IMAGE_TEST_STOP=1 IMAGE_TEST_DIR=$work to remove)"
  fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT
if [ "${IMAGE_TEST_STOP:-0}" = "1" ]; then
  keep=0
  exit 0
fi

# ---- Megatron-LM for the build, served over git:// on 127.0.0.1 ---------------------------------
prepare_megatron_lm() {
  local repo=$work/git/Megatron-LM-$mlm_tag
  [ -d "$repo/.git" ] && return 0
  mkdir -p "$work/git"
  if [ -n "${MEGATRON_LM_DIR:-}" ] && git -C "$MEGATRON_LM_DIR" rev-parse -q --verify \
      "refs/tags/$mlm_tag" >/dev/null 2>&1; then
    git clone -q --no-checkout --branch "$mlm_tag" --depth 1 "file://$MEGATRON_LM_DIR" "$repo"
    return 0
  fi
  if [ -n "${MEGATRON_LM_DIR:-}" ]; then
    [ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has no pretrain_gpt.py"
    mkdir -p "$repo"
    tar -C "$MEGATRON_LM_DIR" --exclude=.git -c . | tar -C "$repo" -x
  else
    local tarball=$root/../shared/megatron-lm/$mlm_tag.tar.gz
    [ -f "$tarball" ] || die "no $tarball: set MEGATRON_LM_DIR to a Megatron-LM $mlm_tag checkout"
    mkdir -p "$repo"
    tar -C "$repo" -xzf "$tarball" --strip-components=1
  fi
  git -C "$repo" init -q
  git -C "$repo" add -A
  git -C "$repo" -c user.name=image-test -c user.email=image-test@localhost commit -q -m "$mlm_tag"
  git -C "$repo" tag "$mlm_tag"
}

# ---- 1. the CPU stand-in for the NGC base ---------------------------------------------------------
# Megatron-LM's repository is prepared while the root file system is made.
prepare_megatron_lm >"$work/megatron-lm.log" 2>&1 &
mlm_pid=$!
if ! docker image inspect "$debian" >/dev/null 2>&1; then
  log "mmdebstrap trixie (Python 3.13) | docker import $debian"
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-pip,python-is-python3,git,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --aptopt='Acquire::Languages "none"' \
    trixie - "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" |
    docker import --change 'CMD ["/bin/bash"]' \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$debian" >/dev/null
fi
wait "$mlm_pid" || { cat "$work/megatron-lm.log"; die "preparing Megatron-LM $mlm_tag"; }

log "stand-in base $standin (torch from the package index)"
mkdir -p "$work/standin/certs"
cp "$here/standin.Dockerfile" "$work/standin/Dockerfile"
# A TLS-intercepting proxy before the package index: its CA certificates go into the image.
find /usr/local/share/ca-certificates -maxdepth 1 -name '*.crt' -exec cp {} "$work/standin/certs/" \; 2>/dev/null || true
docker build -q --force-rm --network host --build-arg BASE_IMAGE="$debian" -t "$standin" "$work/standin" >/dev/null

# ---- 2. docker/Dockerfile with its defaults --------------------------------------------------------
gitd_port=$(free_port)
git daemon --reuseaddr --listen=127.0.0.1 --port="$gitd_port" --export-all \
  --base-path="$work/git" --pid-file="$work/gitd.pid" >"$work/gitd.log" 2>&1 &
for _ in $(seq 40); do [ -f "$work/gitd.pid" ] && break; sleep 0.25; done
log "docker build docker/Dockerfile (megatron-core $core_version, Megatron-LM $mlm_tag)"
tb=$(date +%s)
docker build --force-rm --network host -f "$root/docker/Dockerfile" \
  --build-arg BASE_IMAGE="$standin" \
  --build-arg MEGATRON_CORE_VERSION="$core_version" --build-arg MEGATRON_LM_TAG="$mlm_tag" \
  --build-arg MEGATRON_LM_REPO="git://127.0.0.1:$gitd_port/Megatron-LM-$mlm_tag" \
  -t "$image" "$root" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; die "docker build"; }
kill "$(cat "$work/gitd.pid")" && rm -f "$work/gitd.pid"
build_s=$(($(date +%s) - tb))
size=$(docker image inspect -f '{{.Size}}' "$image")
base_size=$(docker image inspect -f '{{.Size}}' "$standin")
log "built in ${build_s}s: image $((size / 1000000)) MB ($(((size - base_size) / 1000000)) MB on the base)"
grep -m1 'del-megatron OK' "$work/build.log" || die "no smoke line in the build log"

# ---- 3. runs ------------------------------------------------------------------------------------
run=$work/run
mkdir -p "$run"
chown 1000 "$run"

log "smoke step in a container (the image's user and working directory)"
out=$(docker run --rm --entrypoint python "$image" /opt/del-megatron/docker/smoke.py)
echo "$out"
[[ "$out" == *"OK in /workspace/run as uid 1000:"* ]] || die "smoke step"
mkdir -p "$work/mnt-4321" && chown 4321:4321 "$work/mnt-4321"
out=$(docker run --rm --user 4321:4321 -v "$work/mnt-4321:/workspace/run" --entrypoint bash "$image" \
  -c 'python /opt/del-megatron/docker/smoke.py && DEL_CPU=1 /opt/del-megatron/docker/launch.sh --help >/dev/null && echo written > out.txt && echo "HOME ok"')
echo "$out"
if [[ "$out" != *"as uid 4321:"*"HOME ok"* ]] || [ ! -f "$work/mnt-4321/out.txt" ]; then
  die "smoke step as uid 4321"
fi

iters=40
pretrain=(/opt/Megatron-LM/pretrain_gpt.py
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128
  --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 4
  --tensor-model-parallel-size 2 --train-iters "$iters" --lr 1e-3 --min-lr 1e-4
  --lr-decay-style cosine --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024
  --distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
  --no-rope-fusion --transformer-impl local --log-interval 1 --eval-iters 0 --eval-interval 1000
  --numerical-loss del --del-alpha 0.01 --del-digit-token-ids 10 11 12 13 14 15 16 17 18 19)
# MAX_RESTARTS=0: a failure fails the run at once (only the restart run below allows restarts)
docker_run=(docker run --network host --ipc host -v "$run:/workspace/run" -e DEL_CPU=1
  -e MAX_RESTARTS=0)

# one container: both processes
log "Megatron-LM pretrain_gpt.py, one container (2 processes, TP=2)"
containers+=(del-image-test-one-node)
"${docker_run[@]}" --rm --name del-image-test-one-node -e NPROC_PER_NODE=2 \
  -e MASTER_PORT="$(free_port)" "$image" "${pretrain[@]}" >"$work/one_node.log" 2>&1 ||
  { tail -40 "$work/one_node.log"; die "one node"; }
python3 "$here/losses.py" --iters "$iters" "$work/one_node.log"

# two containers as two nodes; $1 names the run, the rest goes to docker run of both
two_nodes() {
  local name=$1 r
  shift
  for r in 0 1; do
    containers+=("del-image-test-$name-$r")
    "${docker_run[@]}" -d --name "del-image-test-$name-$r" -e NNODES=2 -e NPROC_PER_NODE=1 "$@" \
      -e NODE_RANK=$r "$image" "${pretrain[@]}" "${extra[@]}" >/dev/null
  done
}
wait_two() {
  local name=$1 r rc fail=0
  for r in 0 1; do
    rc=$(docker wait "del-image-test-$name-$r")
    docker logs "del-image-test-$name-$r" >"$work/$name-$r.log" 2>&1
    if [ "$rc" != "0" ]; then
      tail -30 "$work/$name-$r.log"
      fail=1
    fi
  done
  [ "$fail" = "0" ] || die "$name: a container exited with an error"
}

log "two containers as two nodes (static rendezvous, 1 process each, TP=2 across them)"
extra=()
two_nodes two_nodes -e MASTER_ADDR=127.0.0.1 -e MASTER_PORT="$(free_port)"
wait_two two_nodes
python3 "$here/losses.py" --iters "$iters" --ref "$work/one_node.log" "$work"/two_nodes-[01].log

log "two nodes, node 1's worker killed after the checkpoint of iteration 10: restart and resume"
ckpt=/workspace/run/ckpt-restart
extra=(--save "$ckpt" --load "$ckpt" --save-interval 10)
two_nodes restart -e MASTER_ADDR=127.0.0.1 -e MASTER_PORT="$(free_port)" -e MAX_RESTARTS=1
tracker=$run/ckpt-restart/latest_checkpointed_iteration.txt
for _ in $(seq 1200); do [ -s "$tracker" ] && break; sleep 0.05; done
[ -s "$tracker" ] || die "restart: no checkpoint after 60 s"
# the worker: the child of torchrun's agent in node 1's container (host pids, from docker top)
worker=$(docker top del-image-test-restart-1 -eo pid,ppid,args | awk '
  NR > 1 && /torch\.distributed\.run/ { agent = $1 }
  NR > 1 { pid[NR] = $1; ppid[NR] = $2 }
  END { for (i in pid) if (ppid[i] == agent) print pid[i] }' | head -n 1)
[ -n "$worker" ] || die "restart: no worker process found in node 1"
kill -9 "$worker"
log "killed node 1's worker (host pid $worker) after checkpoint $(cat "$tracker")"
wait_two restart
python3 "$here/losses.py" --iters "$iters" --ref "$work/one_node.log" --restarted \
  "$work"/restart-[01].log

log "two containers, elastic rendezvous (RDZV_ENDPOINT; --pid host, see docker/launch.sh)"
extra=()
two_nodes elastic --pid host -e RDZV_ENDPOINT="127.0.0.1:$(free_port)" -e RDZV_ID=image-test
wait_two elastic
python3 "$here/losses.py" --iters "$iters" --ref "$work/one_node.log" "$work"/elastic-[01].log

docker rm "${containers[@]}" >/dev/null
containers=()
log "disk: work folder $(du -sh "$work" 2>/dev/null | cut -f1) (Docker data root included when the engine is ours)"
log "PASSED in $(($(date +%s) - t0))s"
