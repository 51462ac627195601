#!/usr/bin/env bash
# Sets up the pinned CPU environment and runs lint plus the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash examples/setup_env.sh
.venv/bin/ruff format --check del_megatron tests benchmarks examples setup.py
.venv/bin/ruff check del_megatron tests benchmarks examples setup.py
.venv/bin/python -m pytest -q tests "$@"
