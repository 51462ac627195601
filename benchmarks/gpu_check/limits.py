"""The stages, in the order they run, and the seconds each one's process may take."""

from __future__ import annotations

import math
from typing import Dict, Sequence

STAGES = (
    "environment",
    "integration",
    "correctness",
    "logits_free",
    "speed",
    "memory",
    "syncs",
    "recompiles",
    "cuda_graph",
)
# The whole run's seconds, gpu_check.sh's default GPU_CHECK_LIMIT_S: on a GPU 10 minutes of
# device time less 30 s; on the CPU (toy sizes, a CI machine that may be busy) more.
ENVELOPE_S = {"gpu": 570, "cpu": 900}
RESERVE_S = 20  # the driver's start, the kills and the summary
# Seconds each stage's process may take (its start and imports included), in the order they
# run. The integration stage comes right after the environment: the stage most likely to wait
# on something (NCCL, torchrun, two Megatron-LM start-ups) is the one the earlier layout left
# at the end, with what the others had left. Each set fits its envelope less RESERVE_S. The
# speed stage writes the memory rows too.
LIMITS_S = {
    "gpu": {
        "environment": 30, "integration": 250, "correctness": 75, "logits_free": 40,
        "speed": 80, "syncs": 25, "recompiles": 30, "cuda_graph": 20,
    },
    "cpu": {
        "environment": 45, "integration": 420, "correctness": 90, "logits_free": 60,
        "speed": 90, "syncs": 60, "recompiles": 60, "cuda_graph": 45,
    },
}  # fmt: skip


def stage_limits(cpu: bool, stages: Sequence[str], envelope_s: float) -> Dict[str, float]:
    """{stage: seconds} for the stages asked, in running order; scaled down together when they
    would not fit envelope_s - RESERVE_S."""
    limits = {s: t for s, t in LIMITS_S["cpu" if cpu else "gpu"].items() if s in stages}
    scale = min(1.0, max(envelope_s - RESERVE_S, 0) / max(sum(limits.values()), 1))
    return {s: math.floor(t * scale * 10) / 10 for s, t in limits.items()}
