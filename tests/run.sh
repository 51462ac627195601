#!/usr/bin/env bash
# Sets up the pinned environments and runs the test stages. With no argument, everything CI runs:
#   lint   ruff format + lint (Python 3.11 environment)
#   unit   the package's unit tests, on both pinned environments; on Python 3.12 the
#          Megatron-Bridge and NeMo tests run in the bridge layer (.venv312-bridge)
#   e2e    Megatron-LM's own pretrain_gpt.py (patched) and examples/pretrain_gpt_del.py under
#          torchrun on CPU: core_v0.16.1 on Python 3.11 / megatron-core 0.16.1, core_v0.18.0 and
#          core_v0.19.0 on Python 3.12 / megatron-core 0.19.2 (MEGATRON_LM_DIR: your checkout);
#          (older tags: the patch and drop-in tests; the newest: every test); on Python 3.11 also
#          docker/launch.sh on this machine and the demo's torchrun runs (the main job)
#   image  builds docker/Dockerfile on a CPU stand-in base and runs it (tests/image/run.sh)
# Usage: bash tests/run.sh [lint|unit|e2e|image ...]; DEL_TEST_ENVS="py311" limits the
# environments; extra pytest arguments go in PYTEST_ARGS. With no argument (CI) the stages run in
# three lanes at once, so that the 2 cores stay busy (one torchrun launch is mostly single-process
# start-up): lint and the Python 3.11 stages, then the Python 3.12 e2e runs of the older
# Megatron-LM tags; after the Python 3.12 set-up, its unit stage; and the image stage, then the
# Python 3.12 e2e runs of the newest tag. Each lane's log is printed when it ends.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
envs=${DEL_TEST_ENVS:-"py311 py312"}
stages=("$@")

venv_of() {
  case "$1" in py311) echo .venv ;; py312) echo .venv312 ;; bridge) echo .venv312-bridge ;; esac
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
  "$(venv_of "$env")/bin/python" -m pytest -q -p no:cacheprovider "$@" ${PYTEST_ARGS:-}
}

unit_in() {
  pytest_in "$1" tests --ignore=tests/e2e --ignore=tests/image
  if [ "$1" = py312 ]; then
    echo "--- Megatron-Bridge and NeMo (.venv312-bridge)"
    DEL_TEST_BRIDGE=1 pytest_in bridge tests/test_bridge.py tests/test_nemo.py
  fi
}

e2e_in() {  # e2e_in ENV [PYTEST ARGS...]
  local env=$1
  shift
  # docker/launch.sh and the demo's own runs: on 3.11 here (the main job's environment); on 3.12
  # launch.sh runs in the image stage's containers
  local skip=()
  if [ "$env" != py311 ]; then
    skip=(--ignore=tests/e2e/test_launch_cpu.py --ignore=tests/e2e/test_demo_runs.py)
  fi
  pytest_in "$env" tests/e2e "${skip[@]}" "$@"
}

e2e_tags() {  # the Megatron-LM tags the e2e stage runs in ENV, oldest first
  bash examples/setup_env.sh "$1" >/dev/null
  "$(venv_of "$1")/bin/python" -c \
    'from tests.e2e.megatron_lm import tags_for_this_environment as t; print(*t())'
}

lanes=()  # "name pid log" of everything()'s background lanes

stop_lanes() {
  local lane name pid log
  for lane in "${lanes[@]}"; do
    read -r name pid log <<<"$lane"
    pkill -TERM -P "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
  done
  wait
  for lane in "${lanes[@]}"; do  # what they had done, for the failure's context
    read -r name pid log <<<"$lane"
    echo "=== lane '$name' (stopped): the end of its log"
    tail -n 40 "$log"
  done
}

everything() {
  local logs ready setup_pid py312_tags older newest lane name pid log rc=0
  logs=$(mktemp -d /tmp/del-megatron-ci.XXXXXX)
  ready=$logs/py312-ready
  stage lint lint
  (
    stage "set-up (py312, bridge)" bash examples/setup_env.sh bridge
    touch "$ready"
  ) >"$logs/set-up.log" 2>&1 &
  setup_pid=$!
  py312_ready() {
    until [ -f "$ready" ] || ! kill -0 "$setup_pid" 2>/dev/null; do sleep 2; done
    [ -f "$ready" ] || { cat "$logs/set-up.log"; echo "set-up (py312) failed" >&2; return 1; }
  }
  (
    py312_ready
    stage "unit (py312)" unit_in py312
  ) >"$logs/unit-py312.log" 2>&1 &
  lanes+=("unit-py312 $! $logs/unit-py312.log")
  (
    py312_ready
    stage image bash tests/image/run.sh
    read -r -a py312_tags <<<"$(e2e_tags py312)"
    newest=${py312_tags[-1]}
    stage "e2e (py312, $newest)" e2e_in py312 -k "$newest"
  ) >"$logs/image-e2e-py312.log" 2>&1 &
  lanes+=("image-e2e-py312 $! $logs/image-e2e-py312.log")
  trap stop_lanes EXIT  # a failing stage here ends the run and stops the lanes
  stage "unit (py311)" unit_in py311
  stage "e2e (py311)" e2e_in py311
  py312_ready
  read -r -a py312_tags <<<"$(e2e_tags py312)"
  older=("${py312_tags[@]:0:${#py312_tags[@]}-1}")
  if [ "${#older[@]}" -gt 0 ]; then
    stage "e2e (py312, ${older[*]})" e2e_in py312 -k "not ${py312_tags[-1]}"
  fi
  cat "$logs/set-up.log"
  for lane in "${lanes[@]}"; do
    read -r name pid log <<<"$lane"
    echo "=== waiting for lane '$name'"
    if wait "$pid"; then echo "=== lane '$name' passed"; else rc=1; echo "=== lane '$name' FAILED"; fi
    cat "$log"
  done
  lanes=()
  trap - EXIT
  rm -rf "$logs"
  return "$rc"
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
    unit) for env in $envs; do stage "unit ($env)" unit_in "$env"; done ;;
    e2e) for env in $envs; do stage "e2e ($env)" e2e_in "$env"; done ;;
    image) stage image bash tests/image/run.sh ;;
    *) echo "unknown stage $name: lint, unit, e2e or image" >&2; exit 2 ;;
  esac
done
