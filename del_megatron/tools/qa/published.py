"""A published compare-qa result read back as runs: `report.write`'s results.json (per seed,
without per-problem rows) and its problem counts (each problem's [count, correct] per class)
give each run's score again, so a later sweep on the same model, data and schedule adds arms
to it without training its runs again (`compare-qa --published`)."""

from __future__ import annotations

import json
import os
from typing import Dict

from .analysis import COUNTED


def problems_path(results_path: str) -> str:
    """docs/results/X.json -> docs/results/X_problems.json (report.write's problem counts, as
    published beside it)."""
    stem, ext = os.path.splitext(results_path)
    return f"{stem}_problems{ext}"


def load(results_path: str) -> Dict[str, Dict[int, dict]]:
    """{arm: {seed: score}} of a published result: each run's per-seed values with its
    per-problem rows ({class}_count, {class}_correct) rebuilt from the problem counts."""
    with open(results_path) as f:
        per_seed = json.load(f)["per_seed"]
    with open(problems_path(results_path)) as f:
        counts = json.load(f)
    runs: Dict[str, Dict[int, dict]] = {}
    for arm, by_seed in per_seed.items():
        for seed, score in by_seed.items():
            classes = counts[arm][seed]
            problems = len(classes[COUNTED[0]])
            rows = [
                {
                    **{f"{name}_count": classes[name][i][0] for name in COUNTED},
                    **{f"{name}_correct": classes[name][i][1] for name in COUNTED},
                }
                for i in range(problems)
            ]
            runs.setdefault(arm, {})[int(seed)] = {**score, "problems": rows}
    return runs
