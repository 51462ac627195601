#!/usr/bin/env bash
# The main job, continued pretraining as users run DEL: set up the pinned CPU environment, then
# pretrain a small Megatron-Core GPTModel (TP=2 over 2 gloo processes) with cross-entropy on a
# number-rich corpus, and continue it with cross-entropy and with DEL on a number-heavier one,
# scoring held-out problems during training (learning curves) and at the end, with the digit
# distributions' shape and the base distribution's CE. Writes
# runs/demo/{results.json,results.png,results_shape.png}. About 7 minutes on 2 idle cores from a
# fresh clone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash examples/setup_env.sh
exec .venv/bin/del-megatron demo --out "${DEMO_OUT:-runs/demo}" "$@"
