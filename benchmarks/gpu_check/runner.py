"""One stage, in this process: what the driver's process for that stage runs."""

from __future__ import annotations

import faulthandler
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from .context import Context, init_megatron
from .results import Results
from .sizes import CPU_SIZES, GPU_SIZES
from .stages import STAGE_FUNCTIONS

DUMP_BEFORE_S = 3  # a stage's stacks are written this long before its kill


def run_stage(name: str, cpu: bool, out: Path, deadline: Optional[float] = None) -> int:
    """Run one stage here, its rows appended to OUT/gpu_check.jsonl; a stage that raises
    writes one row with ok false and its error. A few seconds before `deadline` (time.time(),
    when the driver kills this process) every thread's Python stack goes to stderr, from a
    watchdog thread that runs even while the stage waits in C (a CUDA sync, NCCL, a compile)."""
    if deadline is not None:
        faulthandler.dump_traceback_later(max(deadline - time.time() - DUMP_BEFORE_S, 0.5))
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    results = Results(out / "gpu_check.jsonl", fresh=False)
    ctx = Context(device, CPU_SIZES if cpu else GPU_SIZES, results, out)
    try:
        if name not in ("environment", "integration"):
            init_megatron(ctx)
        STAGE_FUNCTIONS[name](ctx)
    except Exception as exc:  # noqa: BLE001  (a stage's failure is a result)
        ctx.results.add(
            name,
            "stage",
            False,
            error=f"{type(exc).__name__}: {exc}"[:1000],
            traceback=traceback.format_exc()[-3000:],
        )
    return 0
