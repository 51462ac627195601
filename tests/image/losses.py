"""Reads `lm loss` per iteration from Megatron-LM logs and compares runs (tests/image/run.sh).

    python3 losses.py --iters N LOG...                 every iteration 1..N logged, values finite
    python3 losses.py --iters N --ref REF LOG...       ... and each logged value equals REF's
                                                       (--ref may repeat: one run's logs)
    --restarted: the logs hold a restart that resumed from a checkpoint: iterations after the
                 checkpoint may be logged twice, and each logged value must match. Megatron-LM
                 does not reset its log accumulators after a run's first iteration, so the
                 second line after the resume (like every run's second line) is the mean of
                 its step and the one before: it must equal the mean of REF's two.

Values are compared as Megatron prints them (`lm loss: 6.931472E+00`), so "equal" means equal to
the printed digits (7 significant). Standard library only: it runs with the host's python3.
"""

import argparse
import math
import re
import sys

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.Ee+-]+) \|")
RESUMED = "successfully loaded checkpoint"
PRINTED = 2e-6


def read(paths):
    """[(iteration, printed lm loss, line, lines since a resume or -1)]."""
    found = []
    for path in paths:
        since_resume = -1
        with open(path, errors="replace") as f:
            for line in f:
                if RESUMED in line:
                    since_resume = 0
                m = LINE.search(line)
                if m:
                    if since_resume >= 0:
                        since_resume += 1
                    found.append((int(m.group(1)), m.group(2), line, since_resume))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--ref", action="append")
    parser.add_argument("--restarted", action="store_true")
    parser.add_argument("logs", nargs="+")
    a = parser.parse_args()
    found = read(a.logs)
    errors = []
    iters = sorted({i for i, *_ in found})
    if iters != list(range(1, a.iters + 1)):
        errors.append(f"logged iterations {iters}, expected 1..{a.iters}")
    for i, value, line, _ in found:
        if not math.isfinite(float(value)):
            errors.append(f"iteration {i}: lm loss {value}")
        if "ce loss" not in line:
            errors.append(f"iteration {i}: no `ce loss` entry (is --numerical-loss del active?)")
    repeated = len(found) - len(iters)
    resumed = sum(1 for *_, since in found if since == 1)
    if not a.restarted and (repeated or resumed):
        errors.append(f"{repeated} iterations logged twice, {resumed} resumes")
    if a.restarted and resumed != 1:
        errors.append(f"{resumed} resumes from a checkpoint logged, expected 1")
    summary = f"{len(iters)} iterations, {repeated} logged again after a restart"
    if a.ref:
        ref = {i: float(v) for i, v, *_ in read(a.ref)}
        equal = 0
        for i, value, _, since in found:
            expected = ref.get(i)
            if a.restarted and since == 2 and i - 1 in ref and expected is not None:
                expected = (ref[i - 1] + expected) / 2
            if expected is not None and math.isclose(float(value), expected, rel_tol=PRINTED):
                equal += 1
            else:
                errors.append(f"iteration {i}: lm loss {value}, reference {expected}")
        summary += f"; {equal} of {len(found)} logged values equal the reference's"
    first = {i: v for i, v, *_ in found}
    summary += f"; lm loss at 1, {a.iters // 2}, {a.iters}: "
    summary += ", ".join(first.get(i, "?") for i in (1, a.iters // 2, a.iters))
    if errors:
        print("\n".join(["losses: " + e for e in errors]), file=sys.stderr)
        return 1
    print("losses:", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
