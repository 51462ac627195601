#!/usr/bin/env bash
# The image test: builds docker/Dockerfile with its default megatron-core and Megatron-LM versions on
# a CPU stand-in for the NGC PyTorch base (NVRx at the Dockerfile's pin; no Transformer Engine,
# which needs CUDA to build: TRANSFORMER_ENGINE_REF=base), then runs the image for real, as its
# non-root user:
#   1. the smoke step (docker/smoke.py) from the image's working directory: installed packages,
#      Megatron-LM's training code and checkpointing with NVRx, DEL against the float64 reference;
#      and every benchmarks/*.py (the GPU check) imports in the image;
#   2. Megatron-LM's patched /opt/Megatron-LM/pretrain_gpt.py, --numerical-loss del, on CPU through
#      docker/launch.sh (DEL_CPU=1), one container as one node (2 processes, TP=2), run as another
#      uid (docker run --user) that writes its checkpoint into a mounted folder;
#   3. two containers as two nodes (NNODES=2, 1 process each, TP=2 across them): every `lm loss`
#      equals the one-node run's;
#   4. two containers with the elastic rendezvous (RDZV_ENDPOINT): the same losses;
#   5. one container with a worker killed after the checkpoint of iteration 10: torchrun restarts
#      the workers, they resume from the checkpoint, and every logged `lm loss` equals step 2's
#      (the resumed run's second line is the mean of two steps, as every run's second line).
#
#   bash tests/image/run.sh            (as root; from scratch ~0.7 GB of disk at the peak under the
#                                       work folder on .venv312's file system, ~5 GB elsewhere; the
#                                       time it takes: docs/testing.md)
#
# It installs docker.io and mmdebstrap if missing, starts its own Docker engine (data under a temp
# folder) unless one answers already (DOCKER_HOST), and removes what it made at the end: containers,
# images, the engine it started, the temp folder.
# Environment:
#   IMAGE_TEST_DIR     work folder [a new mktemp -d]; with IMAGE_TEST_KEEP=1 a rerun reuses it
#   IMAGE_TEST_KEEP    1: keep the engine, images and work folder (stop with IMAGE_TEST_STOP=1)
#   IMAGE_TEST_STOP    1: only stop and remove what a kept run left in IMAGE_TEST_DIR
#   MEGATRON_LM_DIR    a Megatron-LM checkout to build from (a git repository with the tag, or a
#                      plain tree of that release); else tests/megatron_lm_source.py finds the tag
#                      (MEGATRON_LM_ARCHIVES, a cached or fresh shallow clone: docs/testing.md)
#   DEBIAN_MIRROR      [http://deb.debian.org/debian]
#   PYTHON312          the host's CPython 3.12 that the stand-in gets [the one of .venv312]
#   MEGATRON_CORE_VERSION, MEGATRON_LM_TAG   build other releases than the Dockerfile's defaults
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
here=$root/tests/image
arg_default() { sed -n "s/^ARG $1=//p" "$root/docker/Dockerfile"; }
mlm_tag=${MEGATRON_LM_TAG:-$(arg_default MEGATRON_LM_TAG)}
# Megatron-LM's sources before anything else: without them nothing below can build (one line
# says what to set)
python3 "$root/tests/megatron_lm_source.py" check "$mlm_tag" || exit 3
core_version=${MEGATRON_CORE_VERSION:-$(arg_default MEGATRON_CORE_VERSION)}
nvrx_version=$(arg_default NVRX_VERSION)
image=del-megatron-test/del-megatron:latest
standin=del-megatron-test/pytorch-cpu:standin
# The stand-in is Debian trixie, or the host's release where that is newer: its C library must be
# at least NGC 25.09's (Ubuntu 24.04, glibc 2.39; NVRx 0.6.0's wheels need it) and at least the
# host's (the Python below is the host's).
suite=$(. /etc/os-release && if [ "${ID:-}" = debian ] && [ "${VERSION_ID:-0}" -ge 13 ] 2>/dev/null; then
  echo "$VERSION_CODENAME"; else echo trixie; fi)
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
show_log() {  # the errors in a failed run's log, then its end
  grep -E '(Error|Exception)\b' "$1" | grep -v -E 'Warning|ChildFailedError' | sort | uniq -c |
    sort -rn | head -n 15 || true
  tail -n 30 "$1"
}
wait_port() {  # until something listens on 127.0.0.1:$1
  local _
  for _ in $(seq 80); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.25; done
  die "nothing listens on 127.0.0.1:$1"
}
free_port() { python3 "$root/del_megatron/cpu/ports.py"; }  # outside the ephemeral range

# ---- the engine ---------------------------------------------------------------------------------
docker_bin=/usr/bin/docker
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v git >/dev/null || need+=(git)
command -v readelf >/dev/null || need+=(binutils)
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
    # Its data (the stand-in, the image, the runs' containers) goes under the work folder: about
    # 0.7 GB where torch's files can be hard-linked from .venv312, 5 GB where they are copied.
    free_mb=$(df -Pm "$work" | awk 'NR == 2 { print $4 }')
    need_mb=6144
    [ "$(stat -L -c %d "$work")" = "$(stat -L -c %d "$root/.venv312" 2>/dev/null)" ] && need_mb=2048
    log "disk: $((free_mb / 1024)) GB free under $work, about $((need_mb / 1024)) GB needed"
    if [ "$free_mb" -lt "$need_mb" ]; then
      rmdir "$work" 2>/dev/null || true
      die "needs about $((need_mb / 1024)) GB free under $work: free some, or set IMAGE_TEST_DIR to a folder on the file system of .venv312 that has it"
    fi
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
  for c in "${containers[@]}"; do
    [ "$keep" = "1" ] && docker logs "$c" >"$work/$c.log" 2>&1
    docker rm -f "$c" >/dev/null 2>&1
  done
  if [ "$keep" != "1" ]; then
    if [ "$own_engine" = "1" ]; then
      if [ -f "$work/dockerd.pid" ]; then
        pid=$(cat "$work/dockerd.pid")
        kill "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      fi
      # dockerd leaves its network namespace bind-mounted in the exec root
      umount "$work/docker-exec/netns/default" 2>/dev/null
      rm -rf "$work"
    else
      docker rmi -f "$image" "$standin" >/dev/null 2>&1
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
    local tree
    tree=$(python3 "$root/tests/megatron_lm_source.py" tree "$mlm_tag" "$work/src") ||
      die "Megatron-LM $mlm_tag: no sources"
    mkdir -p "$repo"
    tar -C "$tree" -c . | tar -C "$repo" -x
  fi
  git -C "$repo" init -q
  git -C "$repo" add -A
  git -C "$repo" -c user.name=image-test -c user.email=image-test@localhost commit -q -m "$mlm_tag"
  git -C "$repo" tag "$mlm_tag"
}

# ---- 1. the CPU stand-in for the NGC base ---------------------------------------------------------
# A root file system made here and imported as one layer, with torch's files hard-linked into that
# layer when the engine is ours (a `pip install` in a Dockerfile writes them three times:
# container layer, diff, image layer; an import once):
#   - a minimal Debian trixie (mmdebstrap; glibc 2.41, as NGC 25.09's Ubuntu 24.04 has 2.39) with
#     git, ca-certificates and the libraries that the Python below links;
#   - the host's CPython 3.12 in /usr/local (NGC 25.09 has 3.12; the project supports 3.11 and
#     3.12, and its py312 test environment uses the same interpreter; Debian has no 3.12);
#   - torch 2.14.1 (the CUDA build from PyPI, which runs on CPU), numpy and what torch requires,
#     hard-linked (copied across file systems) from the py312 test environment that
#     `examples/setup_env.sh py312` installs, less the CUDA libraries only a GPU opens
#     (tests/image/torch_files.py);
#   - like Ubuntu 24.04-based NGC images, a user with uid 1000 (`ubuntu`), so that the project's
#     Dockerfile must cope with one.
copy_python() {  # the interpreter, libpython and the standard library into $1 (a /usr/local)
  local py prefix dst=$1
  py=${PYTHON312:-$("$root/.venv312/bin/python" -c 'import sys; print(sys._base_executable)')}
  prefix=$("$py" -c 'import sys; print(sys.base_prefix)')
  mkdir -p "$dst/bin" "$dst/lib"
  cp -L "$py" "$dst/bin/python3.12"
  find "$prefix/lib" -maxdepth 1 -name 'libpython3.12*.so*' -exec cp -a {} "$dst/lib/" \;
  tar -C "$prefix/lib" --exclude=python3.12/test --exclude=python3.12/site-packages \
    --exclude=python3.12/dist-packages --exclude=python3.12/idlelib --exclude=python3.12/tkinter \
    --exclude='python3.12/lib-dynload/_tkinter*' --exclude='python3.12/config-*' \
    -c python3.12 | tar -C "$dst/lib" -x
  mkdir -p "$dst/lib/python3.12/site-packages"
  log "stand-in Python: $py ($("$py" -V))"
}
# The Debian packages of the libraries that the Python in $1 links, as apt patterns for the
# stand-in's release, comma-separated: the host's package name, or its t64 successor (trixie renamed
# libssl3 to libssl3t64 and the like).
lib_packages() {
  find "$1" -type f -name '*.so*' -exec ldd {} + 2>/dev/null |
    awk '/=> \// { print $3 }' | sort -u | while read -r lib; do
      dpkg -S "$lib" 2>/dev/null || dpkg -S "/usr$lib" 2>/dev/null || true
    done | cut -d: -f1 | sort -u | sed -e 's/[.+]/[&]/g' -e 's/.*/?name("^&(t64)?$")/' |
    paste -sd, -
}
# link_torch DEST: tests/image/torch_files.py into DEST, a folder of the stand-in's layer. dockerd
# bind-mounts its data root onto itself, and a hard link cannot cross mounts, so the links are
# made in a mount namespace of their own without that bind mount (the same folders beneath it);
# where that cannot be, the files are copied.
link_torch() {
  local dest=$1 mnt
  mnt=$(findmnt -n -o TARGET -T "$dest")
  # shellcheck disable=SC2016  # $1 and $@ are the inner bash's
  if [ "$mnt" != "$(findmnt -n -o TARGET -T "$root/.venv312")" ] &&
    unshare --mount --propagation private bash -c 'umount "$1" && shift && exec "$@"' _ \
      "$mnt" "$root/.venv312/bin/python" "$here/torch_files.py" "$dest"; then
    return 0
  fi
  "$root/.venv312/bin/python" "$here/torch_files.py" "$dest"
}
make_standin() {
  local rootfs=$work/standin site=usr/local/lib/python3.12/site-packages upper
  rm -rf "$rootfs"
  mkdir -p "$work/python"
  copy_python "$work/python"
  log "mmdebstrap $suite, the host's Python 3.12, torch from .venv312 | docker import $standin"
  mmdebstrap --quiet --variant=minbase --include="git,ca-certificates,$(lib_packages "$work/python")" \
    --dpkgopt=force-unsafe-io --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --aptopt='Acquire::Languages "none"' \
    "$suite" "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  log "debian root file system made"
  cp -a "$work/python/." "$rootfs/usr/local/"
  rm -rf "$work/python"
  # With our own engine torch goes into the imported layer afterwards, hard-linked from .venv312
  # (no second copy of its 4 GB); through another engine it is imported with the rest.
  [ "$own_engine" = 1 ] || "$root/.venv312/bin/python" "$here/torch_files.py" "$rootfs/$site"
  # A TLS-intercepting proxy before the package index: its CA certificates go into the image.
  find /usr/local/share/ca-certificates -maxdepth 1 -name '*.crt' \
    -exec cp {} "$rootfs/usr/local/share/ca-certificates/" \; 2>/dev/null || true
  PIP_ROOT_USER_ACTION=ignore chroot "$rootfs" /bin/bash -euo pipefail -c '
    ldconfig
    ln -s python3.12 /usr/local/bin/python3 && ln -s python3.12 /usr/local/bin/python
    update-ca-certificates >/dev/null 2>&1
    python -m ensurepip --default-pip >/dev/null 2>&1
    useradd --create-home --uid 1000 --user-group ubuntu'
  tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' - "$standin" >/dev/null
  log "imported ($(du -sh "$rootfs" | cut -f1))"
  rm -rf "$rootfs"
  if [ "$own_engine" = 1 ]; then
    # the one layer's files, as overlay2 mounts them under every container of the image (a
    # container writes to its own layer, never to these)
    upper=$(docker image inspect -f '{{.GraphDriver.Data.UpperDir}}' "$standin")
    [ -d "$upper/$site" ] || die "the stand-in's layer is not at $upper (storage driver overlay2?)"
    link_torch "$upper/$site"
    log "torch and its requirements in the stand-in's layer ($(du -sh "$upper" | cut -f1) in all)"
  fi
  docker run --rm "$standin" python -c "import ssl, sqlite3, ctypes, bz2, lzma, torch; \
assert torch.distributed.is_gloo_available(); print('stand-in: torch', torch.__version__)"
}
# Megatron-LM's repository is prepared while the stand-in is made.
prepare_megatron_lm >"$work/megatron-lm.log" 2>&1 &
mlm_pid=$!
bash "$root/examples/setup_env.sh" py312 >/dev/null
docker image inspect "$standin" >/dev/null 2>&1 || make_standin
wait "$mlm_pid" || { cat "$work/megatron-lm.log"; die "preparing Megatron-LM $mlm_tag"; }

# ---- 2. docker/Dockerfile with its defaults --------------------------------------------------------
gitd_port=$(free_port)
git daemon --reuseaddr --listen=127.0.0.1 --port="$gitd_port" --export-all \
  --base-path="$work/git" --pid-file="$work/gitd.pid" >"$work/gitd.log" 2>&1 &
wait_port "$gitd_port"
log "docker build docker/Dockerfile (megatron-core $core_version, Megatron-LM $mlm_tag)"
tb=$(date +%s)
docker build --force-rm --network host -f "$root/docker/Dockerfile" \
  --build-arg BASE_IMAGE="$standin" \
  --build-arg MEGATRON_CORE_VERSION="$core_version" --build-arg MEGATRON_LM_TAG="$mlm_tag" \
  --build-arg MEGATRON_LM_REPO="git://127.0.0.1:$gitd_port/Megatron-LM-$mlm_tag" \
  --build-arg TRANSFORMER_ENGINE_REF=base \
  -t "$image" "$root" >"$work/build.log" 2>&1 || { show_log "$work/build.log"; die "docker build"; }
kill "$(cat "$work/gitd.pid")" && rm -f "$work/gitd.pid"
build_s=$(($(date +%s) - tb))
size=$(docker image inspect -f '{{.Size}}' "$image")
base_size=$(docker image inspect -f '{{.Size}}' "$standin")
log "built in ${build_s}s: image $((size / 1000000)) MB ($(((size - base_size) / 1000000)) MB on the base)"
# Transformer Engine is not built: the stand-in has no CUDA compiler (TRANSFORMER_ENGINE_REF=base
# keeps the base's, which has none). NVRx is installed at the Dockerfile's pin, and Megatron-LM's
# checkpointing accepts it (the smoke step's second stage).
grep -m1 "Transformer Engine: the base image's (TRANSFORMER_ENGINE_REF=base): none" \
  "$work/build.log" || die "the build did not keep the base's (absent) Transformer Engine"
grep -m1 "dist_checkpointing import (NVRx $nvrx_version)" "$work/build.log" ||
  die "the smoke step did not import Megatron-LM's checkpointing with NVRx $nvrx_version"
grep -m1 'del-megatron OK' "$work/build.log" || die "no smoke line in the build log"

# ---- 3. runs ------------------------------------------------------------------------------------
run=$work/run
mkdir -p "$run"
chown 1000 "$run"

log "smoke step in a container (the image's user and working directory)"
out=$(docker run --rm --entrypoint python "$image" /opt/del-megatron/docker/smoke.py 2>/dev/null)
echo "$out"
[[ "$out" == *"OK in /workspace/run as uid 1000:"*"NVRx $nvrx_version, no CUDA device"* ]] ||
  die "smoke step"

# The GPU check ships in the image: every benchmarks/*.py and benchmarks/gpu_check module imports there (the modules of tests/ that
# they import included), from the folder gpu_check.sh runs them in.
log "the GPU check's scripts import in the image"
out=$(docker run --rm --workdir /opt/del-megatron --entrypoint python "$image" -W ignore -c '
import glob, importlib.util as u, os, sys
assert os.path.isfile("benchmarks/gpu_check.sh")
for path in sorted(glob.glob("benchmarks/*.py")):
    spec = u.spec_from_file_location(os.path.basename(path)[:-3], path)
    sys.modules[spec.name] = module = u.module_from_spec(spec)
    spec.loader.exec_module(module)
    print("imports:", path)
import importlib, pkgutil
import benchmarks.gpu_check as package
for info in pkgutil.walk_packages(package.__path__, "benchmarks.gpu_check."):
    importlib.import_module(info.name)
    print("imports:", info.name)' 2>&1) ||
  { echo "$out" | tail -n 20; die "benchmarks/ does not import in the image"; }
grep '^imports:' <<<"$out"

iters=20
pretrain=(/opt/Megatron-LM/pretrain_gpt.py
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128
  --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 4
  --tensor-model-parallel-size 2 --train-iters "$iters" --lr 1e-3 --min-lr 1e-4
  --lr-decay-style cosine --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024
  --distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
  --no-rope-fusion --transformer-impl local --log-interval 1 --eval-iters 0 --eval-interval 1000
  --numerical-loss del --del-alpha 0.01 --del-digit-token-ids 10 11 12 13 14 15 16 17 18 19
  --ckpt-format torch)
# MAX_RESTARTS=0: a failure fails the run at once (only the restart run below allows restarts)
docker_run=(docker run --network host --ipc host -v "$run:/workspace/run" -e DEL_CPU=1
  -e MAX_RESTARTS=0)

# kill_after_checkpoint CONTAINER TRACKER: once Megatron-LM has written a checkpoint (TRACKER, its
# latest_checkpointed_iteration.txt), SIGKILL one worker of CONTAINER: a child of torchrun's agent
# (host pids, from docker top).
kill_after_checkpoint() {
  local name=$1 tracker=$2 deadline worker
  deadline=$(($(date +%s) + 300))
  until [ -s "$tracker" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || die "$name: no checkpoint after 300 s"
    [ "$(docker inspect -f '{{.State.Running}}' "$name")" = true ] ||
      { docker logs "$name" 2>&1 | tail -30; die "$name ended before its checkpoint"; }
    sleep 0.05
  done
  worker=$(docker top "$name" -eo pid,ppid,args | awk '
    NR > 1 && /torch\.distributed\.run/ { agent = $1 }
    NR > 1 { pid[NR] = $1; ppid[NR] = $2 }
    END { for (i in pid) if (ppid[i] == agent) print pid[i] }' | head -n 1)
  [ -n "$worker" ] || die "$name: no worker process found"
  kill -9 "$worker"
  log "killed a worker of $name (host pid $worker) after the checkpoint of iteration $(cat "$tracker")"
}

# One container, both processes. It runs as another uid (docker run --user, as users do to own
# what they write) with its output folder mounted: its checkpoint lands there, and launch.sh finds
# a home for the caches although that uid has no account in the image.
log "Megatron-LM pretrain_gpt.py, one container (2 processes, TP=2), as uid 4321"
mkdir -p "$work/mnt-4321"
chown 4321:4321 "$work/mnt-4321"
containers+=(del-image-test-one-node)
docker run --rm --name del-image-test-one-node --user 4321:4321 --network host --ipc host \
  -v "$work/mnt-4321:/workspace/run" -e DEL_CPU=1 -e MAX_RESTARTS=0 -e NPROC_PER_NODE=2 \
  -e MASTER_PORT="$(free_port)" "$image" "${pretrain[@]}" --save /workspace/run/ckpt \
  --save-interval "$iters" >"$work/one_node.log" 2>&1 ||
  { show_log "$work/one_node.log"; die "one node"; }
python3 "$here/losses.py" --iters "$iters" "$work/one_node.log"
[ "$(cat "$work/mnt-4321/ckpt/latest_checkpointed_iteration.txt")" = "$iters" ] ||
  die "one node: no checkpoint of iteration $iters in the mounted folder"
[ "$(stat -c %u "$work/mnt-4321/ckpt")" = 4321 ] || die "one node: the checkpoint is not uid 4321's"

# two containers as two nodes; $1 names the run, the rest goes to docker run of both
two_nodes() {
  local name=$1 r
  shift
  for r in 0 1; do
    containers+=("del-image-test-$name-$r")
    "${docker_run[@]}" -d --name "del-image-test-$name-$r" -e NNODES=2 -e NPROC_PER_NODE=1 "$@" \
      -e NODE_RANK=$r "$image" "${pretrain[@]}" >/dev/null
  done
}
wait_two() {
  local name=$1 r rc fail=0
  for r in 0 1; do
    rc=$(docker wait "del-image-test-$name-$r")
    docker logs "del-image-test-$name-$r" >"$work/$name-$r.log" 2>&1
    if [ "$rc" != "0" ]; then
      show_log "$work/$name-$r.log"
      fail=1
    fi
  done
  [ "$fail" = "0" ] || die "$name: a container exited with an error"
}

log "two containers as two nodes (static rendezvous, 1 process each, TP=2 across them)"
two_nodes two_nodes -e MASTER_ADDR=127.0.0.1 -e MASTER_PORT="$(free_port)"
wait_two two_nodes
python3 "$here/losses.py" --iters "$iters" --ref "$work/one_node.log" "$work"/two_nodes-[01].log

log "two containers, elastic rendezvous (RDZV_ENDPOINT; --pid host, see docker/launch.sh)"
two_nodes elastic --pid host -e RDZV_ENDPOINT="127.0.0.1:$(free_port)" -e RDZV_ID=image-test
wait_two elastic
python3 "$here/losses.py" --iters "$iters" --ref "$work/one_node.log" "$work"/elastic-[01].log

# One container again, one worker killed after the checkpoint of iteration 10: torchrun restarts
# the workers, they resume from the checkpoint (--load), and every logged lm loss, before the kill
# and after the resume, equals the undisturbed run's (del_megatron.cpu.rendezvous gives each
# restart attempt its own rendezvous keys; without them the new workers dial the killed ones).
log "one container, a worker killed after the checkpoint of iteration 10: restart and resume"
containers+=(del-image-test-restart)
"${docker_run[@]}" -d --name del-image-test-restart -e MAX_RESTARTS=1 -e NPROC_PER_NODE=2 \
  -e MASTER_PORT="$(free_port)" "$image" "${pretrain[@]}" --save /workspace/run/ckpt-restart \
  --load /workspace/run/ckpt-restart --save-interval 10 >/dev/null
kill_after_checkpoint del-image-test-restart "$run/ckpt-restart/latest_checkpointed_iteration.txt"
# a resumed job that does not finish within 5 minutes hangs
rc=$(timeout 300 "$docker_bin" wait del-image-test-restart) || rc="no exit within 300 s"
docker logs del-image-test-restart >"$work/restart.log" 2>&1
[ "$rc" = 0 ] || { show_log "$work/restart.log"; die "restart: $rc"; }
grep -q "exitcode: -9" "$work/restart.log" || die "restart: torchrun did not see the kill"
python3 "$here/losses.py" --iters "$iters" --ref "$work/one_node.log" --restarted \
  "$work/restart.log"

# (the one-node container removed itself: --rm)
docker rm -f "${containers[@]}" >/dev/null 2>&1 || true
containers=()
log "disk: work folder $(du -sh "$work" 2>/dev/null | cut -f1) (Docker data root included when the engine is ours)"
log "PASSED in $(($(date +%s) - t0))s"
