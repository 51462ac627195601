"""The command line: the whole run (the driver), one stage (--stage, what the driver starts), or
the summary of a results file (--summary)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from .driver import drive
from .limits import ENVELOPE_S, STAGES, stage_limits
from .report import summary
from .results import Results, read_rows
from .runner import run_stage
from .stages import STAGE_FUNCTIONS

PACKAGE = Path(__file__).resolve().parent  # `python PACKAGE` runs __main__.py
ROOT = PACKAGE.parents[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 all passed, 1 something failed (or --summary found no row), 2 no GPU."""
    description = sys.modules[__package__].__doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="gpu_check", description=description)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--cpu", action="store_true", help="every stage at toy sizes on the CPU")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--summary", type=Path, help="print the summary of a JSON lines file")
    parser.add_argument("--envelope-s", type=float, help="the whole run's seconds")
    parser.add_argument("--no-summary", action="store_true", help="(gpu_check.sh prints it)")
    parser.add_argument("--stage", choices=list(STAGE_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.summary:
        rows = read_rows(args.summary)
        print(summary(rows))
        return 1 if any(r["ok"] is False for r in rows) or not rows else 0
    if args.stage:
        return run_stage(args.stage, args.cpu, args.out, args.deadline)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --cpu for the toy-size run)", file=sys.stderr)
        return 2
    asked = {"speed" if s == "memory" else s for s in args.stages} | {"environment"}
    envelope_s = args.envelope_s or ENVELOPE_S["cpu" if args.cpu else "gpu"]
    limits = stage_limits(args.cpu, sorted(asked), envelope_s)
    results = Results(args.out / "gpu_check.jsonl")
    base = [sys.executable, str(PACKAGE), "--out", str(args.out)]
    base += ["--cpu"] if args.cpu else []
    drive(
        results,
        limits,
        envelope_s,
        lambda stage, deadline: [*base, "--stage", stage, "--deadline", str(deadline)],
    )
    rows = read_rows(results.path)
    if not args.no_summary:
        print(summary(rows))
    return 1 if any(r["ok"] is False for r in rows) else 0
