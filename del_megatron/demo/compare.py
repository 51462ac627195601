"""The loss comparison: every requested loss trained from the same seeds on the same data, each
run evaluated on the whole held-out set, and per metric the mean over seeds with a 95% interval
and the paired difference against cross-entropy (`del-megatron compare`).

Runs live in <out>/seed-<S>/<arm>/metrics.json; a finished run is never trained again, so an
interrupted sweep resumes where it stopped (an unfinished run continues from its checkpoint).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence

from . import report
from .config import NOT_DEFINING, differing_settings
from .stats import mean_interval, paired_difference

BASELINE = "ce"
# A reused run must also have been scored on the same held-out problems.
REUSE_IGNORES = tuple(name for name in NOT_DEFINING if name != "eval_problems")
# The weight of each numerical term at its paper setting for a SentencePiece-style tokenizer that
# splits digits (this corpus's): DEL 0.1 as in the DEL authors' CodeLlama / Mistral runs, NTL
# 0.3 as its authors recommend; DIST2 0.1, DEL's (the spec names no weight of its own).
PAPER_WEIGHTS = {"ce": 0.0, "del": 0.1, "ntl_was": 0.3, "ntl_mse": 0.3, "dist2": 0.1}
# (key in metrics.json, title, format, higher is better): the demo's held-out metrics, and the
# final training CE
LOWER_IS_BETTER = ("mean_abs_log10_error", "final_ce")
METRICS = [
    (key, title, fmt, key not in LOWER_IS_BETTER)
    for key, title, fmt in [*report.METRICS, ("final_ce", "final train CE", "{:.4f}")]
]


@dataclass(frozen=True)
class Arm:
    """One loss at one weight: `del` (its paper weight) or `del@0.05`."""

    loss: str
    weight: float

    @property
    def name(self) -> str:
        if self.loss == BASELINE or self.weight == PAPER_WEIGHTS[self.loss]:
            return self.loss
        return f"{self.loss}@{self.weight:g}"


def parse_arm(text: str) -> Arm:
    """`LOSS` or `LOSS@WEIGHT` -> Arm; ValueError naming the problem otherwise."""
    loss, _, weight = text.partition("@")
    if loss not in PAPER_WEIGHTS:
        raise ValueError(f"unknown loss {loss!r} in {text!r}: one of {', '.join(PAPER_WEIGHTS)}")
    if not weight:
        return Arm(loss, PAPER_WEIGHTS[loss])
    if loss == BASELINE:
        raise ValueError(f"{text!r}: cross-entropy has no weight")
    try:
        value = float(weight)
    except ValueError:
        raise ValueError(f"{text!r}: the weight after '@' must be a number") from None
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"{text!r}: the weight must be a non-negative number")
    return Arm(loss, value)


def run_dir(out: str, seed: int, arm: Arm) -> str:
    return os.path.join(out, f"seed-{seed}", arm.name)


def read_run(path: str) -> dict:
    """metrics.json of a run, or {} when there is none yet."""
    try:
        with open(os.path.join(path, "metrics.json")) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


def run_metrics(run: dict) -> Dict[str, float]:
    """The compared metrics of one finished run, and their standard errors (`<key>_se`)."""
    values = {key: run[key] for key, *_ in METRICS if key != "final_ce"}
    values["final_ce"] = run["history"][-1]["ce"]
    for key, se in run.get("standard_errors", {}).items():
        values[f"{key}_se"] = se
    return values


def check_finished_run(path: str, run: dict, wanted: Mapping[str, object]) -> None:
    """A finished run is only reused if it trained, and was scored, as this sweep asks."""
    differ = differing_settings(run.get("config", {}), wanted, ignore=REUSE_IGNORES)
    if differ:
        raise RuntimeError(
            f"{path} holds a run with other settings ({', '.join(differ)}): rerun with the "
            "settings of the runs in that folder, pass another --out, or delete the run to "
            "train it again"
        )


def sweep(
    out: str,
    arms: Sequence[Arm],
    seeds: Sequence[int],
    train: Callable[[Arm, int, str], int],
    settings: Mapping[str, object],
    log: Callable[[str], None] = print,
) -> Dict[str, Dict[int, Dict[str, float]]]:
    """Train every (seed, arm) in that order unless it finished before; {arm: {seed: metrics}}.
    `train(arm, seed, out_dir)` runs one training and returns its exit status; `settings` are
    the training settings (TrainConfig fields) every run shares."""
    results: Dict[str, Dict[int, Dict[str, float]]] = {arm.name: {} for arm in arms}
    total, done = len(arms) * len(seeds), 0
    for seed in seeds:
        for arm in arms:
            done += 1
            path = run_dir(out, seed, arm)
            run = read_run(path)
            if run:
                wanted = {**settings, "loss": arm.loss, "alpha": arm.weight, "seed": seed}
                check_finished_run(path, run, wanted)
            if run.get("finished"):
                log(f"[{done}/{total}] seed {seed}, {arm.name}: finished before, not run again")
            else:
                log(f"[{done}/{total}] seed {seed}, {arm.name}: training")
                code = train(arm, seed, path)
                run = read_run(path)
                if code != 0 or not run.get("finished"):
                    raise RuntimeError(
                        f"seed {seed}, {arm.name} failed (exit {code}); rerun the same command "
                        "to continue the sweep"
                    )
            results[arm.name][seed] = run_metrics(run)
    return results


def summarize(
    results: Dict[str, Dict[int, Dict[str, float]]], seeds: Sequence[int]
) -> Dict[str, Dict[str, dict]]:
    """{arm: {metric: {mean, low, high, n, per_seed, standard_errors, [difference]}}}: the
    difference is paired over seeds against the cross-entropy arm, when there is one."""
    summary: Dict[str, Dict[str, dict]] = {}
    for arm, by_seed in results.items():
        rows = {}
        for key, *_ in METRICS:
            values = [by_seed[seed][key] for seed in seeds]
            row = {**mean_interval(values).as_dict(), "per_seed": values}
            row["standard_errors"] = [by_seed[seed].get(f"{key}_se") for seed in seeds]
            if BASELINE in results and arm != BASELINE:
                baseline = [results[BASELINE][seed][key] for seed in seeds]
                row["difference"] = paired_difference(values, baseline).as_dict()
            rows[key] = row
        summary[arm] = rows
    return summary


def _cell(row: dict, fmt: str) -> str:
    if row["n"] < 2:
        return fmt.format(row["mean"])
    return f"{fmt.format(row['mean'])} [{fmt.format(row['low'])}, {fmt.format(row['high'])}]"


def _difference_cell(row: dict, fmt: str, higher_is_better: bool) -> str:
    diff = row.get("difference")
    if diff is None:
        return "-"
    signed = "{:+" + fmt[2:]
    text = signed.format(diff["mean"])
    if diff["n"] >= 2:
        text += f" [{signed.format(diff['low'])}, {signed.format(diff['high'])}]"
        if diff["low"] > 0 or diff["high"] < 0:
            better = (diff["low"] > 0) == higher_is_better
            text += " better" if better else " worse"
    return text


def table(summary: Dict[str, Dict[str, dict]]) -> str:
    """Markdown: per metric, mean [95% interval] over seeds, and the paired difference against
    ce [95% interval], marked better/worse when the interval excludes 0."""
    header = ["loss"]
    for _, title, *_ in METRICS:
        title = title.replace("|", "\\|")  # "mean |log10 error|" inside a Markdown cell
        header += [title, f"{title}: vs ce"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, rows in summary.items():
        cells = [arm]
        for key, _, fmt, higher in METRICS:
            cells += [_cell(rows[key], fmt), _difference_cell(rows[key], fmt, higher)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str, summary: Dict[str, Dict[str, dict]]) -> str:
    """Bars: mean over seeds with its 95% interval; dots: the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.0 * len(METRICS), 3.8))
    for ax, (key, title, _, _) in zip(axes, METRICS, strict=True):
        rows = [summary[arm][key] for arm in arms]
        means = [row["mean"] for row in rows]
        errors: List[List[float]] = [[], []]
        for row in rows:
            has_interval = row["n"] >= 2
            errors[0].append(row["mean"] - row["low"] if has_interval else 0.0)
            errors[1].append(row["high"] - row["mean"] if has_interval else 0.0)
        ax.bar(arms, means, yerr=errors, capsize=4, color="#9ecae1", edgecolor="#3182bd")
        for x, row in enumerate(rows):
            ax.plot([x] * len(row["per_seed"]), row["per_seed"], "k.", markersize=4)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    n = max(row["n"] for rows in summary.values() for row in rows.values())
    fig.suptitle(f"del-megatron compare: mean over {n} seeds, 95% interval, dots = seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    out: str,
    arms: Sequence[Arm],
    seeds: Sequence[int],
    results: Dict[str, Dict[int, Dict[str, float]]],
) -> Dict[str, str]:
    """compare.json, compare.md and compare.png in `out`; their paths."""
    summary = summarize(results, seeds)
    paths = {name: os.path.join(out, f"compare.{name}") for name in ("json", "md", "png")}
    with open(paths["json"], "w") as fh:
        record = {
            "seeds": list(seeds),
            "arms": {arm.name: {"loss": arm.loss, "weight": arm.weight} for arm in arms},
            "summary": summary,
            "runs": {
                arm: {str(s): m for s, m in by_seed.items()} for arm, by_seed in results.items()
            },
        }
        json.dump(record, fh, indent=1)
    with open(paths["md"], "w") as fh:
        fh.write(table(summary) + "\n")
    plot(paths["png"], summary)
    return paths
