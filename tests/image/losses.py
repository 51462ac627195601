"""Reads `lm loss` per iteration from Megatron-LM logs and compares runs (tests/image/run.sh).

    python3 losses.py --iters N LOG...                 every iteration 1..N logged, values finite
    python3 losses.py --iters N --ref REF LOG...       ... and each logged value equals REF's
                                                       (--ref may repeat: one run's logs)
    --restarted: the logs hold a restart: iterations after the checkpoint may be logged twice
                 (each must match). An iteration whose reported lm loss differs while training
                 went on identically (its grad norm equal, the next iteration's lm loss equal)
                 is reported as a reporting defect after the resume, not as a failure.

Values are compared as Megatron prints them (`lm loss: 6.931472E+00`), so "equal" means equal to
the printed digits. Standard library only: it runs with the host's python3.
"""

import argparse
import math
import re
import sys

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.Ee+-]+) \|")
GRAD_NORM = re.compile(r"\| grad norm: ([0-9.Ee+-]+) \|")


def grad_norm(line):
    m = GRAD_NORM.search(line)
    return m.group(1) if m else None


def read(paths):
    found = []
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = LINE.search(line)
                if m:
                    found.append((int(m.group(1)), m.group(2), line))
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
    iters = sorted({i for i, _, _ in found})
    if iters != list(range(1, a.iters + 1)):
        errors.append(f"logged iterations {iters}, expected 1..{a.iters}")
    for i, value, line in found:
        if not math.isfinite(float(value)):
            errors.append(f"iteration {i}: lm loss {value}")
        if "ce loss" not in line:
            errors.append(f"iteration {i}: no `ce loss` entry (is --numerical-loss del active?)")
    repeated = len(found) - len(iters)
    if not a.restarted and repeated:
        errors.append(f"{repeated} iterations logged twice")
    summary = f"{len(iters)} iterations, {repeated} logged again after a restart"
    if a.ref:
        ref_lines = {i: line for i, _, line in read(a.ref)}
        ref = {i: v for i, v, _ in read(a.ref)}
        bad = [(i, v, ref.get(i), line) for i, v, line in found if ref.get(i) != v]
        last = {i: v for i, v, _ in found}  # after a restart: the resumed run's value
        glitches = []
        for i, v, r, line in bad:
            same_training = (
                a.restarted
                and i in ref_lines
                and grad_norm(line) == grad_norm(ref_lines[i])
                and i + 1 in ref
                and last.get(i + 1) == ref[i + 1]
            )
            if same_training:
                glitches.append(f"iteration {i}: lm loss {v}, reference {r}")
            else:
                errors.append(f"iteration {i}: lm loss {v}, reference {r}")
        if not bad:
            summary += f"; all {len(found)} logged values equal the reference's"
        else:
            summary += f"; {len(found) - len(bad)} of {len(found)} equal the reference's"
        for g in glitches:
            print(
                f"losses: WARNING {g}, with the same grad norm and the same next lm loss: "
                "training resumed exactly, but this report differs (a reporting defect after "
                "the resume)",
                file=sys.stderr,
            )
    first = {i: v for i, v, _ in found}
    summary += f"; lm loss at 1, {a.iters // 2}, {a.iters}: "
    summary += ", ".join(first.get(i, "?") for i in (1, a.iters // 2, a.iters))
    if errors:
        print("\n".join(["losses: " + e for e in errors]), file=sys.stderr)
        return 1
    print("losses:", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
