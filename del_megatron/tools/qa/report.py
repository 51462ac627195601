"""compare-qa's tables: per arm the mean over seeds [95% interval] and the paired difference
against ce [95% interval]; the base model's row as scored; the declared comparisons (every arm
against ce, every numerical arm against each digit_ce control) on the primary metric with the
seeds' interval and the bootstrap over seeds and problems; the raw per-seed values and each
problem's counts in JSON (docs/results.md declares the analysis)."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Sequence, Tuple

from ..demo.compare import _cell, _difference_cell
from ..demo.stats import mean_interval, paired_difference, ratio_standard_error
from . import analysis
from .finetune import HISTORY

BASELINE, BASE = "ce", "base"
CONTROL = "digit_ce"  # arms of this loss are controls: every other numerical arm meets them too
# The declared primary metric (docs/results.md): accuracy on the digits the model computes.
PRIMARY_CLASS = "computed"
PRIMARY = f"digit_acc_{PRIMARY_CLASS}"
# (key, title, format, higher is better: True / False / None for neither); the primary first
METRICS = (
    (PRIMARY, "computed (primary)", "{:.4f}", True),
    ("digit_acc_restated", "restated", "{:.4f}", True),
    ("digit_acc_copied", "copied", "{:.4f}", True),
    ("digit_acc_other", "other", "{:.4f}", True),
    ("digit_acc_all", "all digits", "{:.4f}", True),
    ("top_not_digit", "top token no digit", "{:.4f}", False),
    ("digit_mass", "p(any digit)", "{:.4f}", True),
    ("digit_entropy", "entropy (nats)", "{:.3f}", None),
    ("target_probability", "p(target)", "{:.4f}", True),
    ("expected_distance", "E distance", "{:.3f}", False),
    ("calibration_error", "calibration error", "{:.4f}", False),
    ("final_answer_acc", "final answer", "{:.3f}", True),
)
CLASS_NAMES = (PRIMARY_CLASS, "restated", "copied", "other", "all")
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


def _loss(arm: str) -> str:
    return arm.split("@")[0]


def contrasts(arms: Sequence[str]) -> List[Tuple[str, str]]:
    """The declared comparisons (arm, against): every arm against ce, and every numerical arm
    other than a control against each digit_ce arm (the control for extra weight on digits)."""
    pairs = [(a, BASELINE) for a in arms if a not in (BASE, BASELINE)]
    controls = [a for a in arms if _loss(a) == CONTROL]
    pairs += [
        (a, c) for c in controls for a in arms if a not in (BASE, BASELINE) and _loss(a) != CONTROL
    ]
    return pairs


def _finite(values: Sequence[float]) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def summarize(results: Dict[str, Dict[int, dict]], seeds: Sequence[int]) -> Dict[str, dict]:
    """{arm: {metric: {mean, low, high, n, per_seed, [difference]}}} over the seeds every arm
    finished; the base row has one value, no interval; a metric not scored (NaN: no greedy
    decoding) is left out."""
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
            if not _finite(values):
                continue
            row = mean_interval(values).as_dict()
            row["per_seed"] = dict(zip(used, values, strict=True))
            ce = results.get(BASELINE, {})
            if arm not in (BASE, BASELINE) and all(key in ce.get(s, {}) for s in used):
                row["difference"] = paired_difference(values, [ce[s][key] for s in used]).as_dict()
            rows[key] = row
        summary[arm] = rows
    return summary


def problem_paired(
    results: Dict[str, Dict[int, dict]],
    arm: str,
    seeds: Sequence[int],
    name: str = "all",
    against: str = BASELINE,
) -> Dict[str, float]:
    """The difference in digit accuracy (of class `name`) between `arm` and `against` with the
    test problems as the units: per problem, both arms' correct digit targets summed over
    `seeds` (the same problems, teacher-forced); mean, its standard error (ratio estimator)
    and the normal 95% interval. This is the evaluation's sampling noise; the seeds' interval
    is the training's."""
    diffs: List[float] = []
    counts: List[float] = []
    for seed in seeds:
        ours, theirs = results[arm][seed]["problems"], results[against][seed]["problems"]
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if len(diffs) <= i:
                diffs.append(0.0)
                counts.append(0.0)
            diffs[i] += a[f"{name}_correct"] - b[f"{name}_correct"]
            counts[i] += a[f"{name}_count"]
    mean = sum(diffs) / sum(counts)
    se = ratio_standard_error(diffs, counts)
    return {"mean": mean, "se": se, "low": mean - 1.96 * se, "high": mean + 1.96 * se}


def compare(
    results: Dict[str, Dict[int, dict]], arm: str, against: str, seeds: Sequence[int], family: int
) -> Dict[str, dict]:
    """Per digit class, `arm` - `against` paired over `seeds`: the seeds' Student-t interval
    ("seeds"), the bootstrap over seeds and problems ("bootstrap", 95%), for the primary class
    also at 1 - 0.05 / family ("bootstrap_family": Bonferroni over the declared comparisons),
    and problems as units ("problems")."""
    counts = {
        side: [analysis.problem_counts(results[side][s]["problems"]) for s in seeds]
        for side in (arm, against)
    }
    out: Dict[str, dict] = {}
    for name in CLASS_NAMES:
        key = f"digit_acc_{name}"
        values = [results[arm][s][key] for s in seeds]
        baseline = [results[against][s][key] for s in seeds]
        row = {
            "seeds": paired_difference(values, baseline).as_dict(),
            "bootstrap": analysis.bootstrap_difference(counts[arm], counts[against], name),
            "problems": problem_paired(results, arm, seeds, name, against),
        }
        if name == PRIMARY_CLASS:
            row["bootstrap_family"] = analysis.bootstrap_difference(
                counts[arm], counts[against], name, confidence=1 - 0.05 / max(family, 1)
            )
        out[name] = row
    return out


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


def against_controls(per_seed: Dict[str, Dict], metrics: Sequence[tuple] = METRICS) -> str:
    """Markdown: per numerical arm and digit_ce arm (the declared control pairs), the arm's
    paired difference from the control over their common seeds [95% Student-t] per metric
    (`per_seed`: {arm: {seed: score}}, seeds as ints or strings)."""
    pairs = [(a, c) for a, c in contrasts(list(per_seed)) if c != BASELINE]
    header = ["vs the control"] + [title for _, title, *_ in metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, control in pairs:
        seeds = sorted(set(per_seed[arm]) & set(per_seed[control]), key=int)
        cells = [f"{arm} vs {control}"]
        for key, _, fmt, higher in metrics:
            ours = [per_seed[arm][s].get(key) for s in seeds]
            theirs = [per_seed[control][s].get(key) for s in seeds]
            if not (_finite(ours) and _finite(theirs)):
                cells.append("-")
                continue
            row = {"difference": paired_difference(ours, theirs).as_dict()}
            cells.append(_difference_cell(row, fmt, higher))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interval(row: dict) -> str:
    return f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]"


def primary_table(compared: Dict[str, Dict[str, dict]], family: int) -> str:
    """Markdown: the primary metric per declared comparison, with both intervals and the
    Bonferroni-adjusted bootstrap interval."""
    adjusted = f"{100 * (1 - 0.05 / max(family, 1)):.1f}%"
    header = [
        "comparison",
        "computed-digit acc difference",
        "95% over seeds (t)",
        "95% bootstrap, seeds x problems",
        f"{adjusted} bootstrap ({family} comparisons)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, rows in compared.items():
        row = rows[PRIMARY_CLASS]
        cells = [name, f"{row['seeds']['mean']:+.4f}"]
        for interval in (row["seeds"], row["bootstrap"], row["bootstrap_family"]):
            cells.append(f"[{interval['low']:+.4f}, {interval['high']:+.4f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def classes_table(compared: Dict[str, Dict[str, dict]]) -> str:
    """Markdown (secondary): every class's difference per comparison, with its bootstrap
    interval over seeds and problems."""
    header = ["comparison (bootstrap 95%)"] + [f"{n}" for n in CLASS_NAMES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, rows in compared.items():
        cells = [name] + [_interval(rows[n]["bootstrap"]) for n in CLASS_NAMES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PROBLEM_COUNTS = "problem_counts.json"


def write_problem_counts(path: str, per_problem: Dict[str, Dict[str, dict]]) -> None:
    """{arm: {seed: {class: [[count, correct] per problem]}}} as JSON, one line a run."""
    lines = []
    for arm, runs in per_problem.items():
        seeds = [
            f"  {json.dumps(str(s))}: {json.dumps(c, separators=(',', ':'))}"
            for s, c in runs.items()
        ]
        lines.append(f" {json.dumps(arm)}: {{\n" + ",\n".join(seeds) + "\n }")
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


def write(
    out: str,
    results: Dict[str, Dict[int, dict]],
    seeds: Sequence[int],
    title: str = "held-out digit targets, teacher-forced",
) -> str:
    """results.json (per seed without per-problem rows, the summary and the declared
    comparisons), problem_counts.json (per run, each problem's counts per class: every interval
    recomputes from it), results.md and digit_shape.png under `out`; returns the Markdown."""
    from ..demo.report import plot_shape

    raw = {
        arm: {
            str(s): {k: v for k, v in score.items() if k != "problems"} for s, score in runs.items()
        }
        for arm, runs in results.items()
    }
    per_problem = {
        arm: {str(s): analysis.problem_counts(score["problems"]) for s, score in runs.items()}
        for arm, runs in results.items()
        if all("problems" in score for score in runs.values())
    }
    summary = summarize(results, seeds)
    done = [s for s in seeds if all(s in results.get(a, {}) for a in results if a != BASE)]
    pairs = [p for p in contrasts(list(results)) if done] if BASELINE in results else []
    compared = {
        f"{arm} vs {against}": compare(results, arm, against, done, len(pairs))
        for arm, against in pairs
    }
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(
            {
                "per_seed": raw,
                "summary": summary,
                "comparisons": compared,
                "seeds_compared": done,
            },
            f,
            indent=1,
        )
    write_problem_counts(os.path.join(out, PROBLEM_COUNTS), per_problem)
    text = table(summary, METRICS + TRAINING) + "\n\n" + differences(summary, METRICS + TRAINING)
    if compared:
        text += "\n\n" + primary_table(compared, len(pairs))
        text += "\n\n" + classes_table(compared)
        text += "\n\n" + against_controls(results, METRICS)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    shapes: Dict[str, List[dict]] = {arm: list(runs.values()) for arm, runs in results.items()}
    plot_shape(os.path.join(out, "digit_shape.png"), shapes, title)
    return text
