"""compare-qa's tables: per arm the mean over seeds [95% interval] and the paired difference
against ce [95% interval]; the base model's row as scored; the raw per-seed values in JSON."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

from ..demo.compare import _cell, _difference_cell
from ..demo.stats import mean_interval, paired_difference, ratio_standard_error
from .finetune import HISTORY

BASELINE, BASE = "ce", "base"
# (key, title, format, higher is better: True / False / None for neither)
METRICS = (
    ("digit_acc_all", "digit acc", "{:.4f}", True),
    ("digit_acc_copied", "copied", "{:.4f}", True),
    ("digit_acc_computed", "computed", "{:.4f}", True),
    ("top_not_digit", "top token no digit", "{:.4f}", False),
    ("digit_mass", "p(any digit)", "{:.4f}", True),
    ("digit_entropy", "entropy (nats)", "{:.3f}", None),
    ("target_probability", "p(target)", "{:.4f}", True),
    ("expected_distance", "E distance", "{:.3f}", False),
    ("calibration_error", "calibration error", "{:.4f}", False),
    ("final_answer_acc", "final answer", "{:.3f}", True),
)
CLASS_NAMES = ("all", "copied", "computed")
TRAINING = (
    ("final_train_ce", "train CE, last 5 iterations", "{:.4f}", False),
    ("seconds_per_iteration", "s / iteration", "{:.1f}", None),
    ("peak_gib", "peak memory (GiB)", "{:.2f}", None),
)


def training_record(train_dir: str) -> Dict[str, float]:
    """The run's final training CE (mean 'ce loss', else 'lm loss', of its last 5 iterations),
    its mean seconds an iteration (the first, with start-up, left out) and, where logged, its
    peak resident memory (GiB, rank 0)."""
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
        if all("peak_gib" in r for r in ordered):
            out["peak_gib"] = max(r["peak_gib"] for r in ordered)
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


def problem_paired(
    results: Dict[str, Dict[int, dict]], arm: str, seeds: Sequence[int], name: str = "all"
) -> Dict[str, float]:
    """The difference in digit accuracy (of class `name`) between `arm` and ce with the test
    problems as the units: per problem, both arms' correct digit targets summed over `seeds`
    (the same problems, teacher-forced); mean, its standard error (ratio estimator) and the
    normal 95% interval. This is the evaluation's sampling noise; the seeds' interval is the
    training's."""
    diffs: List[float] = []
    counts: List[float] = []
    for seed in seeds:
        ours, theirs = results[arm][seed]["problems"], results[BASELINE][seed]["problems"]
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if len(diffs) <= i:
                diffs.append(0.0)
                counts.append(0.0)
            diffs[i] += a[f"{name}_correct"] - b[f"{name}_correct"]
            counts[i] += a[f"{name}_count"]
    mean = sum(diffs) / sum(counts)
    se = ratio_standard_error(diffs, counts)
    return {"mean": mean, "se": se, "low": mean - 1.96 * se, "high": mean + 1.96 * se}


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


def problems_table(over_problems: Dict[str, Dict[str, dict]]) -> str:
    """Markdown: problem_paired's differences [95% interval] per arm and digit class."""
    header = ["vs ce, problems as units"] + [f"digit acc {n}" for n in CLASS_NAMES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, rows in over_problems.items():
        cells = [
            f"{rows[n]['mean']:+.4f} [{rows[n]['low']:+.4f}, {rows[n]['high']:+.4f}]"
            for n in CLASS_NAMES
        ]
        lines.append("| " + " | ".join([arm] + cells) + " |")
    return "\n".join(lines)


def write(
    out: str,
    results: Dict[str, Dict[int, dict]],
    seeds: Sequence[int],
    title: str = "held-out digit targets, teacher-forced",
) -> str:
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
    done = [s for s in seeds if all(s in results.get(a, {}) for a in results if a != BASE)]
    over_problems = {
        arm: {name: problem_paired(results, arm, done, name) for name in CLASS_NAMES}
        for arm in results
        if arm not in (BASE, BASELINE) and BASELINE in results and done
    }
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(
            {"per_seed": raw, "summary": summary, "paired_over_problems": over_problems},
            f,
            indent=1,
        )
    text = table(summary, METRICS + TRAINING) + "\n\n" + differences(summary, METRICS + TRAINING)
    if over_problems:
        text += "\n\n" + problems_table(over_problems)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    shapes: Dict[str, List[dict]] = {arm: list(runs.values()) for arm, runs in results.items()}
    plot_shape(os.path.join(out, "digit_shape.png"), shapes, title)
    return text
