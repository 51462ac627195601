#!/usr/bin/env bash
# Sets up the pinned environments and runs the test stages. With no argument, everything CI runs:
#   lint   ruff format + lint (Python 3.11 environment)
#   unit   the package's unit tests, on both pinned environments
#   e2e    Megatron-LM's own pretrain_gpt.py (patched) and examples/pretrain_gpt_del.py under
#          torchrun on CPU: core_v0.16.1 on Python 3.11 / megatron-core 0.16.1, core_v0.18.0 and
#          core_v0.19.0 on Python 3.12 / megatron-core 0.19.2 (MEGATRON_LM_DIR: your checkout)
#   image  builds docker/Dockerfile on a CPU stand-in base and runs it (tests/image/run.sh)
# Usage: bash tests/run.sh [lint|unit|e2e|image ...]; DEL_TEST_ENVS="py311" limits the
# environments; extra pytest arguments go in PYTEST_ARGS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
envs=${DEL_TEST_ENVS:-"py311 py312"}
stages=("$@")
[ "${#stages[@]}" -gt 0 ] || stages=(lint unit e2e image)

venv_of() { if [ "$1" = py311 ]; then echo .venv; else echo .venv312; fi; }

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

for name in "${stages[@]}"; do
  case "$name" in
    lint) stage lint lint ;;
    unit) for env in $envs; do
        stage "unit ($env)" pytest_in "$env" tests --ignore=tests/e2e --ignore=tests/image
      done ;;
    e2e) for env in $envs; do stage "e2e ($env)" pytest_in "$env" tests/e2e; done ;;
    image) stage image bash tests/image/run.sh ;;
    *) echo "unknown stage $name: lint, unit, e2e or image" >&2; exit 2 ;;
  esac
done
