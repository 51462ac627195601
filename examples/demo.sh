#!/usr/bin/env bash
# The main job: set up the pinned CPU environment, then train a small Megatron-Core GPTModel
# (TP=2 over 2 gloo processes) with cross-entropy and with DEL on a number-rich corpus, scoring
# held-out problems during training (learning curves) and at the end. Writes
# runs/demo/{results.json,results.png}. About 10 minutes on 2 idle cores from a fresh clone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash examples/setup_env.sh
exec .venv/bin/del-megatron demo --out "${DEMO_OUT:-runs/demo}" "$@"
