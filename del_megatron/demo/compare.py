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
from typing import Callable, Dict, Mapping, Sequence

from ..preflight import SENTENCEPIECE, recommended_weight
from . import report
from .config import (
    NOT_DEFINING,
    SCORING,
    SINGLE_DIGIT_DEL,
    WEIGHT_REDUCTION,
    differing_settings,
)
from .stats import mean_interval, paired_difference

BASELINE = "ce"
STATS = ("mean", "low", "high")  # of an Interval, as the curves store them
# A reused run must also have been scored on the same held-out problems, at the same steps.
REUSE_IGNORES = tuple(name for name in NOT_DEFINING if name not in SCORING)
# The weight of each numerical term at its paper setting for a SentencePiece tokenizer that
# splits digits (this corpus's), as `del-megatron check` recommends it: DEL 0.1 as in the DEL
# authors' CodeLlama / Mistral runs, NTL 0.3 as its authors recommend, DIST2 DEL's (the spec
# names no weight of its own).
PAPER_WEIGHTS = {
    "ce": 0.0,
    **{loss: recommended_weight(loss, SENTENCEPIECE) for loss in ("del", "ntl_was", "ntl_mse")},
    "dist2": recommended_weight("dist2", SENTENCEPIECE),
    SINGLE_DIGIT_DEL: recommended_weight("del", SENTENCEPIECE),
}
# (key in metrics.json, title, format, higher is better): the demo's held-out metrics, and the
# final training CE
LOWER_IS_BETTER = ("mean_abs_log10_error", "final_ce")
METRICS = [
    (key, title, fmt, key not in LOWER_IS_BETTER)
    for key, title, fmt in [*report.METRICS, ("final_ce", "final train CE", "{:.4f}")]
]
# What the learning curves show: the held-out metrics and the training CE at each point.
CURVE_METRICS = [
    (key, title, key not in LOWER_IS_BETTER and key != "train_ce")
    for key, title, _ in [*report.METRICS, report.TRAIN_CE]
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


def run_metrics(run: dict) -> Dict[str, object]:
    """The compared metrics of one finished run, their standard errors (`<key>_se`) and its
    learning curve (`curve`: the held-out metrics on the curve's subset at each point)."""
    values: Dict[str, object] = {key: run[key] for key, *_ in METRICS if key != "final_ce"}
    values["final_ce"] = report.final_train_ce(run["history"])
    for key, se in run.get("standard_errors", {}).items():
        values[f"{key}_se"] = se
    values["curve"] = run.get("curve", [])
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
                wanted["reduction"] = WEIGHT_REDUCTION  # alpha's unit
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


def summarize_curves(
    results: Dict[str, Dict[int, Dict[str, object]]], seeds: Sequence[int]
) -> Dict[str, Dict[str, dict]]:
    """{arm: {metric: {steps, mean, low, high, [difference: {mean, low, high}]}}}: at each curve
    step that every seed's run scored, the mean over seeds with its 95% interval, and the
    difference against ce paired over seeds."""

    def by_step(arm: str, seed: int, key: str) -> Dict[int, float]:
        return {p["step"]: p[key] for p in results[arm][seed].get("curve", [])}

    curves: Dict[str, Dict[str, dict]] = {}
    for arm in results:
        rows = {}
        for key, *_ in CURVE_METRICS:
            per_seed = [by_step(arm, seed, key) for seed in seeds]
            if BASELINE in results and arm != BASELINE:
                base = [by_step(BASELINE, seed, key) for seed in seeds]
            else:
                base = None
            common = set.intersection(*(set(c) for c in per_seed + (base or [])))
            steps = sorted(common)
            row: Dict[str, object] = {"steps": steps}
            intervals = [mean_interval([c[step] for c in per_seed]) for step in steps]
            row.update({name: [getattr(i, name) for i in intervals] for name in STATS})
            if base is not None:
                paired = [
                    paired_difference([c[step] for c in per_seed], [b[step] for b in base])
                    for step in steps
                ]
                row["difference"] = {name: [getattr(d, name) for d in paired] for name in STATS}
            rows[key] = row
        curves[arm] = rows
    return curves


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


def plot(path: str, curves: Dict[str, Dict[str, dict]], n_seeds: int) -> str:
    """Top row: each metric against steps, a line a loss (mean over seeds) in its 95% band;
    bottom row: the difference against ce paired over seeds, in its 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(curves)
    fig, axes = plt.subplots(2, len(CURVE_METRICS), figsize=(4.2 * len(CURVE_METRICS), 7.2))
    for col, (key, title, _) in enumerate(CURVE_METRICS):
        top, bottom = axes[0][col], axes[1][col]
        for color, arm in zip(report.COLORS, arms, strict=False):
            row = curves[arm][key]
            top.plot(row["steps"], row["mean"], "-o", color=color, markersize=3, label=arm)
            if n_seeds >= 2:
                top.fill_between(row["steps"], row["low"], row["high"], color=color, alpha=0.15)
            diff = row.get("difference")
            if diff is not None:
                bottom.plot(row["steps"], diff["mean"], "-o", color=color, markersize=3)
                if n_seeds >= 2:
                    bottom.fill_between(
                        row["steps"], diff["low"], diff["high"], color=color, alpha=0.15
                    )
        bottom.axhline(0.0, color=report.COLORS[0], linewidth=1)
        top.set_title(title, fontsize=10)
        bottom.set_title(f"minus ce, paired: {title.split(' (')[0]}", fontsize=10)
        bottom.set_xlabel("step")
        if key == "train_ce":
            report.log_scale(top, [v for arm in arms for v in curves[arm][key]["mean"]])
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"del-megatron compare: mean over {n_seeds} seeds with 95% intervals (bands), on the "
        "curve's held-out subset",
        fontsize=10,
    )
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
    curves = summarize_curves(results, seeds)
    paths = {name: os.path.join(out, f"compare.{name}") for name in ("json", "md", "png")}
    with open(paths["json"], "w") as fh:
        record = {
            "seeds": list(seeds),
            "arms": {arm.name: {"loss": arm.loss, "weight": arm.weight} for arm in arms},
            "summary": summary,
            "curves": curves,
            "runs": {
                arm: {str(s): m for s, m in by_seed.items()} for arm, by_seed in results.items()
            },
        }
        json.dump(record, fh, indent=1)
    with open(paths["md"], "w") as fh:
        fh.write(table(summary) + "\n")
    plot(paths["png"], curves, len(seeds))
    return paths
