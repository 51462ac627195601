#!/usr/bin/env bash
# Creates (or refreshes) the pinned CPU environment in .venv/ at the repository root.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=.venv/.del-megatron-installed
if [ ! -f "$stamp" ] || [ tests/requirements-cpu.txt -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  # torch first and exactly pinned, so nothing after it can pull a CUDA build.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/requirements-cpu.txt
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
  touch "$stamp"
fi
# The test suite lints the shell scripts with Debian's shellcheck.
if ! command -v shellcheck >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq shellcheck >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq shellcheck >/dev/null; }
  else
    echo "note: shellcheck is not installed; the shell-lint test will fail" >&2
  fi
fi
