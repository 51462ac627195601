#!/usr/bin/env bash
# Sets up the pinned environments and runs the test stages. With no argument, everything CI runs:
#   lint   ruff format + lint (Python 3.11 environment)
#   wheel  builds the wheel, installs it (--no-deps) into a fresh environment that takes torch and
#          megatron-core from .venv, and runs `del-megatron check` and a DEL loss from it, outside
#          the checkout (tests/wheel/run.sh)
#   unit   the package's unit tests, on both pinned environments; on Python 3.12 the
#          Megatron-Bridge and NeMo tests run in the bridge layer (.venv312-bridge)
#   e2e    Megatron-LM's own pretrain_gpt.py (patched) and examples/pretrain_gpt_del.py under
#          torchrun on CPU: core_v0.16.1 on Python 3.11 / megatron-core 0.16.1, core_v0.18.0 and
#          core_v0.19.0 and the development heads main and dev (tests/e2e/test_heads.py) on
#          Python 3.12 / megatron-core 0.19.2 (MEGATRON_LM_DIR: your checkout);
#          on Python 3.11 also docker/launch.sh on this machine and the demo's torchrun runs
#          (tests/e2e/test_launch_cpu.py, tests/e2e/test_demo_runs.py)
#   image  builds docker/Dockerfile on a CPU stand-in base and runs it (tests/image/run.sh)
#   automodel  NeMo AutoModel 0.7.0's own recipe with the numerical loss on CPU, in its pinned
#          layer over the Python 3.11 environment (.venv-automodel: tests/test_automodel.py)
# Usage: bash tests/run.sh [lint|wheel|unit|e2e|image|automodel ...]; DEL_TEST_ENVS="py311" limits the
# environments; extra pytest arguments go in PYTEST_ARGS. With no argument (CI) the stages run
# one after another; only the Python 3.12 set-up runs beside lint, wheel and the Python 3.11 unit
# tests (the image stage takes torch from that environment).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
envs=${DEL_TEST_ENVS:-"py311 py312"}
stages=("$@")

venv_of() {
  case "$1" in
    py311) echo .venv ;; py312) echo .venv312 ;; bridge) echo .venv312-bridge ;;
    automodel) echo .venv-automodel ;;
  esac
}

setup_pid=""  # everything()'s Python 3.12 set-up while it runs beside lint and unit (py311)

stop_setup() {  # a failing lint or unit stage ends the run: the set-up beside it stops too
  if [ -n "$setup_pid" ]; then
    pkill -TERM -P "$setup_pid" || true
    kill "$setup_pid" 2>/dev/null || true
  fi
  wait
}

stage() {
  local name=$1 start=$SECONDS
  shift
  echo "=== $name"
  "$@"
  echo "=== $name: $((SECONDS - start)) s"
}

lint() {
  bash examples/setup_env.sh py311
  .venv/bin/ruff format --check del_megatron tests benchmarks examples setup.py
  .venv/bin/ruff check del_megatron tests benchmarks examples setup.py
}

pytest_in() {  # pytest_in ENV ARGS...: pytest in that pinned environment
  local env=$1
  shift
  bash examples/setup_env.sh "$env"
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  # a passing test's tmp_path (checkpoints, models) is removed at the end of its session
  "$(venv_of "$env")/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
    -o tmp_path_retention_policy=failed "$@" ${PYTEST_ARGS:-}
}

unit_in() {
  pytest_in "$1" tests --ignore=tests/e2e --ignore=tests/image
  if [ "$1" = py312 ]; then
    echo "--- Megatron-Bridge and NeMo (.venv312-bridge)"
    DEL_TEST_BRIDGE=1 pytest_in bridge tests/test_bridge.py tests/test_nemo.py tests/test_qa_bridge.py \
      tests/test_bridge_scoring.py
  fi
}

automodel_in() {
  DEL_TEST_AUTOMODEL=1 pytest_in automodel tests/test_automodel.py tests/test_automodel_loss.py
}

e2e_in() {
  # docker/launch.sh on this machine and the demo's torchrun runs: on 3.11 (the main job's
  # environment); on 3.12 launch.sh runs in the image stage's containers
  local skip=()
  if [ "$1" != py311 ]; then
    skip=(--ignore=tests/e2e/test_launch_cpu.py --ignore=tests/e2e/test_demo_runs.py)
  fi
  pytest_in "$1" tests/e2e "${skip[@]}"
}

free_disk() { echo "=== disk: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free"; }

everything() {
  # One stage at a time, except the Python 3.12 set-up (downloads and unpacking), which runs
  # beside lint, wheel and the Python 3.11 unit tests (172 s of set-up beside 62 s of lint left
  # the machine waiting 110 s). Test stages do not run beside each other: in two streams they took
  # 2451 s where one at a time took 1479 s, each 2-3x slower than alone (likely: a torchrun
  # job's gloo ranks wait for each other in every collective, and beside another stream one of
  # them is often descheduled).
  local setup_log rc=0
  free_disk
  setup_log=$(mktemp /tmp/del-megatron-setup-py312.XXXXXX)
  # the AutoModel layer (over .venv, which lint builds first) after it, in the same stream
  {
    stage "set-up (py312, bridge)" bash examples/setup_env.sh bridge
    until [ -f .venv/.del-megatron-installed ]; do sleep 5; done
    stage "set-up (automodel)" bash examples/setup_env.sh automodel
  } >"$setup_log" 2>&1 &
  setup_pid=$!
  trap stop_setup EXIT
  stage lint lint
  stage wheel bash tests/wheel/run.sh
  stage "unit (py311)" unit_in py311
  wait "$setup_pid" || rc=$?
  setup_pid=""
  cat "$setup_log"
  rm -f "$setup_log"
  [ "$rc" = 0 ] || { echo "set-up (py312, automodel) failed" >&2; return "$rc"; }
  stage "e2e (py311)" e2e_in py311
  stage "unit (py312)" unit_in py312
  stage "e2e (py312)" e2e_in py312
  stage image bash tests/image/run.sh
  stage automodel automodel_in
  free_disk
}

if [ "${#stages[@]}" -eq 0 ]; then
  [ "$envs" = "py311 py312" ] || { echo "DEL_TEST_ENVS needs stage names" >&2; exit 2; }
  everything
  echo "=== all stages: $SECONDS s"
  exit 0
fi
for name in "${stages[@]}"; do
  case "$name" in
    lint) stage lint lint ;;
    wheel) stage wheel bash tests/wheel/run.sh ;;
    unit) for env in $envs; do stage "unit ($env)" unit_in "$env"; done ;;
    e2e) for env in $envs; do stage "e2e ($env)" e2e_in "$env"; done ;;
    image) stage image bash tests/image/run.sh ;;
    automodel) stage automodel automodel_in ;;
    *) echo "unknown stage $name: lint, wheel, unit, e2e, image or automodel" >&2; exit 2 ;;
  esac
done
