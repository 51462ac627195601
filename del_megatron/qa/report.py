"""compare-qa's tables: per arm the mean over seeds [95% interval] and the paired difference
against ce [95% interval]; the base model's row as scored; the raw per-seed values in JSON."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

from ..demo.compare import _cell, _difference_cell
from ..demo.stats import mean_interval, paired_difference
from .finetune import HISTORY

BASELINE, BASE = "ce", "base"
# (key, title, format, higher is better: True / False / None for neither)
METRICS = (
    ("digit_acc_all", "digit acc", "{:.4f}", True),
    ("digit_acc_copied", "copied", "{:.4f}", True),
    ("digit_acc_computed", "computed", "{:.4f}", True),
    ("digit_entropy", "entropy (nats)", "{:.3f}", None),
    ("target_probability", "p(target)", "{:.4f}", True),
    ("expected_distance", "E distance", "{:.3f}", False),
    ("calibration_error", "calibration error", "{:.4f}", False),
    ("final_answer_acc", "final answer", "{:.3f}", True),
)
TRAINING = (("final_train_ce", "train CE, last 5 iterations", "{:.4f}", False),)


def training_record(train_dir: str) -> Dict[str, float]:
    """The run's final training CE (mean 'ce loss', else 'lm loss', of its last 5 iterations)
    and its mean seconds an iteration (the first, with start-up, left out)."""
    rows: Dict[int, dict] = {}
    path = os.path.join(train_dir, HISTORY)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                rows[int(row["iteration"])] = row  # a resumed run logs its iterations again
    ordered = [rows[k] for k in sorted(rows)]
    out: Dict[str, float] = {}
    if ordered:
        key = "ce loss" if "ce loss" in ordered[-1] else "lm loss"
        last = [r[key] for r in ordered[-5:]]
        out["final_train_ce"] = sum(last) / len(last)
        timed = [r["seconds"] for r in ordered[1:]] or [ordered[0]["seconds"]]
        out["seconds_per_iteration"] = sum(timed) / len(timed)
    return out


def summarize(results: Dict[str, Dict[int, dict]], seeds: Sequence[int]) -> Dict[str, dict]:
    """{arm: {metric: {mean, low, high, n, per_seed, [difference]}}} over the seeds every arm
    finished; the base row has one value, no interval."""
    summary: Dict[str, dict] = {}
    for arm, by_seed in results.items():
        used = [0] if arm == BASE else [s for s in seeds if s in by_seed]
        if not used:
            continue
        rows = {}
        for key, *_ in METRICS + TRAINING:
            if not all(key in by_seed[s] for s in used):
                continue
            values = [by_seed[s][key] for s in used]
            row = mean_interval(values).as_dict()
            row["per_seed"] = dict(zip(used, values, strict=True))
            ce = results.get(BASELINE, {})
            if arm not in (BASE, BASELINE) and all(key in ce.get(s, {}) for s in used):
                row["difference"] = paired_difference(values, [ce[s][key] for s in used]).as_dict()
            rows[key] = row
        summary[arm] = rows
    return summary


def table(summary: Dict[str, dict], metrics: Sequence[tuple] = METRICS) -> str:
    """Markdown: a row per arm (the base model first), mean [95% interval] per metric."""
    header = ["model"] + [title for _, title, *_ in metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, rows in summary.items():
        cells = [arm] + [
            _cell(rows[key], fmt) if key in rows else "-" for key, _, fmt, _ in metrics
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def differences(summary: Dict[str, dict], metrics: Sequence[tuple] = METRICS) -> str:
    """Markdown: per arm but ce and base, the paired difference against ce [95% interval]."""
    header = ["vs ce"] + [title for _, title, *_ in metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, rows in summary.items():
        if arm in (BASE, BASELINE):
            continue
        cells = [arm] + [
            _difference_cell(rows[k], fmt, hi) if k in rows else "-" for k, _, fmt, hi in metrics
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out: str, results: Dict[str, Dict[int, dict]], seeds: Sequence[int]) -> str:
    """results.json (per seed, without per-problem rows), results.md and digit_shape.png under
    `out`; returns the Markdown."""
    from ..demo.report import plot_shape

    raw = {
        arm: {
            str(s): {k: v for k, v in score.items() if k != "problems"} for s, score in runs.items()
        }
        for arm, runs in results.items()
    }
    summary = summarize(results, seeds)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"per_seed": raw, "summary": summary}, f, indent=1)
    text = table(summary, METRICS + TRAINING) + "\n\n" + differences(summary, METRICS + TRAINING)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    shapes: Dict[str, List[dict]] = {arm: list(runs.values()) for arm, runs in results.items()}
    plot_shape(os.path.join(out, "digit_shape.png"), shapes, "held-out digit targets")
    return text
