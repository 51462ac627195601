#!/usr/bin/env bash
# The main job: set up the pinned CPU environment, then train a small Megatron-Core GPTModel
# (TP=2 over 2 gloo processes) with cross-entropy and with DEL on a number-rich corpus and
# compare them on held-out problems. Writes runs/demo/{results.json,results.png}.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash examples/setup_env.sh
exec .venv/bin/del-megatron demo --out "${DEMO_OUT:-runs/demo}" "$@"
