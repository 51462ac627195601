"""One module a stage; STAGE_FUNCTIONS: what runs each stage in its process (limits.STAGES
names them all: "memory" has no function, the speed stage writes its rows)."""

from __future__ import annotations

from typing import Callable, Dict

from ..context import Context
from .correctness import stage_correctness
from .cuda_graph import stage_cuda_graph
from .environment import stage_environment
from .integration import stage_integration
from .logits_free import stage_logits_free
from .recompiles import stage_recompiles
from .speed import stage_speed_and_memory
from .syncs import stage_syncs

STAGE_FUNCTIONS: Dict[str, Callable[[Context], None]] = {
    "environment": stage_environment,
    "integration": stage_integration,
    "correctness": stage_correctness,
    "logits_free": stage_logits_free,
    "speed": stage_speed_and_memory,  # writes the memory rows too
    "syncs": stage_syncs,
    "recompiles": stage_recompiles,
    "cuda_graph": stage_cuda_graph,
}
