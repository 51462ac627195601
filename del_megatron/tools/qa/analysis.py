"""The declared analysis of compare-qa (docs/results.md, "The analysis, declared before the
runs"): per-problem counts kept from every score, and the paired difference in a digit class's
accuracy between an arm and a baseline with two intervals: Student-t over seeds (report.py) and
a bootstrap over seeds and problems together (here).

A score's "problems" rows hold, per held-out problem, `<class>_count` and `<class>_correct`
(teacher-forced digit targets of that class, and how many of them the model's top token got
right). `problem_counts` keeps just those, so that a published file lets anyone recompute
every interval.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .answers import CLASSES

ALL = "all"
COUNTED = (ALL,) + CLASSES
DRAWS = 10000  # bootstrap replicates
BOOTSTRAP_SEED = 20261207  # fixed: the published intervals recompute exactly


def problem_counts(rows: Sequence[dict]) -> Dict[str, List[List[int]]]:
    """{class: [[count, correct] per problem]} from a score's per-problem rows."""
    return {
        name: [[int(r[f"{name}_count"]), int(r[f"{name}_correct"])] for r in rows]
        for name in COUNTED
    }


def _matrices(arm: Sequence[dict], baseline: Sequence[dict], name: str):
    """[S, P] float64: the arm's correct minus the baseline's, and the digit targets, per seed
    and problem. arm / baseline: per seed, problem_counts' {class: [[count, correct]]}."""
    diff, count = [], []
    for ours, theirs in zip(arm, baseline, strict=True):
        a, b = ours[name], theirs[name]
        if len(a) != len(b):
            raise ValueError(f"{len(a)} problems paired with {len(b)}: score the same problems")
        diff.append([x[1] - y[1] for x, y in zip(a, b, strict=True)])
        count.append([x[0] for x in a])
    return torch.tensor(diff, dtype=torch.float64), torch.tensor(count, dtype=torch.float64)


def _resample_weights(n: int, draws: int, generator: torch.Generator) -> torch.Tensor:
    """[draws, n]: how often each of n units is drawn in each replicate (with replacement)."""
    picks = torch.randint(n, (draws, n), generator=generator)
    weights = torch.zeros(draws, n, dtype=torch.float64)
    return weights.scatter_add_(1, picks, torch.ones(draws, n, dtype=torch.float64))


def bootstrap_difference(
    arm: Sequence[dict],
    baseline: Sequence[dict],
    name: str,
    confidence: float = 0.95,
    draws: int = DRAWS,
    seed: int = BOOTSTRAP_SEED,
) -> Dict[str, float]:
    """The paired difference in class `name`'s digit accuracy, sum over seeds and problems of
    (arm's correct - baseline's correct) / the digit targets, with a percentile interval from
    resampling seeds and problems together: each replicate draws the seeds with replacement
    and, independently, the problems with replacement (crossed, as every seed's runs are
    scored on the same problems), so that both the training's noise and the evaluation's are
    in the interval. arm / baseline: per seed (the same seeds, in the same order),
    problem_counts' {class: [[count, correct]]}."""
    diff, count = _matrices(arm, baseline, name)
    generator = torch.Generator().manual_seed(seed)
    seeds = _resample_weights(diff.size(0), draws, generator)  # [B, S]
    problems = _resample_weights(diff.size(1), draws, generator)  # [B, P]
    numerator = ((seeds @ diff) * problems).sum(-1)
    denominator = ((seeds @ count) * problems).sum(-1)
    replicates = numerator / denominator.clamp(min=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(replicates, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return {
        "mean": float(diff.sum() / count.sum().clamp(min=1)),
        "low": float(low),
        "high": float(high),
        "confidence": confidence,
        "draws": draws,
        "seeds": int(diff.size(0)),
        "problems": int(diff.size(1)),
    }
