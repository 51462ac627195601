"""The loss comparison: every requested loss trained from the same seeds on the same data, each
run evaluated on the whole held-out set, and per metric the mean over seeds with a 95% interval
and the paired difference against cross-entropy (`del-megatron compare`).

Runs live in <out>/seed-<S>/<arm>/metrics.json; a finished run is never trained again, so an
interrupted sweep resumes where it stopped (an unfinished run continues from its checkpoint).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from ...config import check_weight
from ...digits.slots import RULES
from ..preflight import SENTENCEPIECE, recommended_weight
from . import report
from .config import (
    DEFAULT_SLOT_LOGITS,
    NO_SLOTS,
    NOT_DEFINING,
    SCORING,
    SINGLE_DIGIT_DEL,
    WEIGHT_REDUCTION,
    differing_settings,
)
from .evaluate import END_KEYS
from .stats import mean_interval, paired_difference

BASELINE = "ce"
STATS = ("mean", "low", "high")  # of an Interval, as the curves store them
# A reused run must also have been scored on the same held-out problems, at the same steps.
REUSE_IGNORES = tuple(name for name in NOT_DEFINING if name not in SCORING)
# The weight of each numerical term at its paper setting for a SentencePiece tokenizer that
# splits digits (this corpus's), as `del-megatron check` recommends it: DEL 0.1 as in the DEL
# authors' CodeLlama / Mistral runs, NTL 0.3 as its authors recommend, DIST2 DEL's (the spec
# names no weight of its own), digit_ce (the control: extra weight on digits) DEL's too.
PAPER_WEIGHTS = {
    "ce": 0.0,
    **{loss: recommended_weight(loss, SENTENCEPIECE) for loss in ("del", "ntl_was", "ntl_mse")},
    "dist2": recommended_weight("dist2", SENTENCEPIECE),
    "digit_ce": recommended_weight("digit_ce", SENTENCEPIECE),
    SINGLE_DIGIT_DEL: recommended_weight("del", SENTENCEPIECE),
}
# (key in metrics.json, title, format, higher is better or None: neither): the demo's
# held-out metrics, the final training CE and the answers' length accuracy (MAIN); the digit
# distributions' shape (SHAPE); in continued pretraining the base distribution's CE (BASE).
LOWER_IS_BETTER = (
    "mean_abs_log10_error",
    "final_ce",
    "expected_distance",
    "calibration_error",
    "base_ce",
    "base_ce_change",
)
NO_DIRECTION = ("digit_entropy",)


def _directed(rows) -> list:
    return [
        (key, title, fmt, None if key in NO_DIRECTION else key not in LOWER_IS_BETTER)
        for key, title, fmt in rows
    ]


MAIN = _directed([*report.METRICS, ("final_ce", "final train CE", "{:.4f}"), report.END_METRICS[0]])
SHAPE = _directed(report.SHAPE_METRICS)
BASE_CE = _directed(report.BASE_METRICS)
METRICS = MAIN + SHAPE + BASE_CE
# Per run, kept beside the metrics for the shape figure (digit_shape.summarize).
SHAPE_CURVES = ("distance_profile", "calibration_bins")
# What the learning curves show: the held-out metrics and the training CE at each point.
CURVE_METRICS = [
    (key, title, key not in LOWER_IS_BETTER and key != "train_ce")
    for key, title, _ in [*report.METRICS, report.TRAIN_CE]
]


@dataclass(frozen=True)
class Arm:
    """One loss at one weight, with a slot rule or the default: `del` (its paper weight),
    `del@0.05`, `del:length@0.03` (slot_logits "length")."""

    loss: str
    weight: float
    slot_logits: Optional[str] = None

    @property
    def name(self) -> str:
        name = self.loss if self.slot_logits is None else f"{self.loss}:{self.slot_logits}"
        if self.loss == BASELINE or self.weight == PAPER_WEIGHTS[self.loss]:
            return name
        return f"{name}@{self.weight:g}"

    @property
    def rule(self) -> str:
        """The slot rule its runs train with."""
        return self.slot_logits or DEFAULT_SLOT_LOGITS


def parse_arm(text: str) -> Arm:
    """`LOSS[:RULE][@WEIGHT]` -> Arm; ValueError naming the problem otherwise."""
    spec, _, weight = text.partition("@")
    loss, colon, rule = spec.partition(":")
    if loss not in PAPER_WEIGHTS:
        raise ValueError(f"unknown loss {loss!r} in {text!r}: one of {', '.join(PAPER_WEIGHTS)}")
    if colon and rule not in RULES:
        raise ValueError(f"{text!r}: the slot rule after ':' is one of {', '.join(RULES)}")
    if colon and loss in NO_SLOTS:
        raise ValueError(f"{text!r}: {loss} has no slot logits, so no slot rule")
    slot_logits = rule if colon else None
    if not weight:
        return Arm(loss, PAPER_WEIGHTS[loss], slot_logits)
    if loss == BASELINE:
        raise ValueError(f"{text!r}: cross-entropy has no weight")
    try:
        value = float(weight)
    except ValueError:
        raise ValueError(f"{text!r}: the weight after '@' must be a number") from None
    try:
        value = check_weight(value, "the weight")
    except ValueError as bad:
        raise ValueError(f"{text!r}: {bad}") from None
    return Arm(loss, value, slot_logits)


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
    values: Dict[str, object] = {
        key: run[key] for key in [k for k, *_ in METRICS] + list(SHAPE_CURVES) if key in run
    }
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
    before_seed: Optional[Callable[[int], None]] = None,
) -> Dict[str, Dict[int, Dict[str, float]]]:
    """Train every (seed, arm) in that order unless it finished before; {arm: {seed: metrics}}.
    `train(arm, seed, out_dir)` runs one training and returns its exit status; `settings` are
    the training settings (TrainConfig fields) every run shares; `before_seed(seed)` runs
    before a seed's arms (continued pretraining: its base)."""
    results: Dict[str, Dict[int, Dict[str, float]]] = {arm.name: {} for arm in arms}
    total, done = len(arms) * len(seeds), 0
    for seed in seeds:
        if before_seed is not None:
            before_seed(seed)
        for arm in arms:
            done += 1
            path = run_dir(out, seed, arm)
            run = read_run(path)
            if run:
                wanted = {**settings, "loss": arm.loss, "alpha": arm.weight, "seed": seed}
                wanted["reduction"] = WEIGHT_REDUCTION  # alpha's unit
                if arm.loss not in NO_SLOTS:
                    wanted["slot_logits"] = arm.rule
                check_finished_run(path, run, wanted)
            if run.get("finished") and any(key not in run for key in END_KEYS):
                log(f"[{done}/{total}] seed {seed}, {arm.name}: finished before, scoring its end")
                rescore = train(arm, seed, path)
                run = read_run(path)
                if rescore != 0 or any(key not in run for key in END_KEYS):
                    raise RuntimeError(
                        f"seed {seed}, {arm.name} could not be scored (exit {rescore}); rerun "
                        "the same command to continue the sweep"
                    )
            elif run.get("finished"):
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
    results: Dict[str, Dict[int, Dict[str, float]]],
    seeds: Sequence[int],
    references: Sequence[str] = (),
) -> Dict[str, Dict[str, dict]]:
    """{arm: {metric: {mean, low, high, n, per_seed, standard_errors, [difference],
    [difference_vs_R]}}}: the difference is paired over seeds against the cross-entropy arm,
    when there is one; difference_vs_R against each arm R of `references` that ran."""
    summary: Dict[str, Dict[str, dict]] = {}

    def scored(arm: str, key: str) -> bool:
        return all(key in results[arm][seed] for seed in seeds)

    for arm, by_seed in results.items():
        rows = {}
        for key, *_ in METRICS:
            if not scored(arm, key):  # e.g. the base CE, scored in continued pretraining only
                continue
            values = [by_seed[seed][key] for seed in seeds]
            row = {**mean_interval(values).as_dict(), "per_seed": values}
            row["standard_errors"] = [by_seed[seed].get(f"{key}_se") for seed in seeds]
            if BASELINE in results and arm != BASELINE and scored(BASELINE, key):
                baseline = [results[BASELINE][seed][key] for seed in seeds]
                row["difference"] = paired_difference(values, baseline).as_dict()
            for ref in references:
                if ref in results and arm != ref and scored(ref, key):
                    against = [results[ref][seed][key] for seed in seeds]
                    row[f"difference_vs_{ref}"] = paired_difference(values, against).as_dict()
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


def _difference_cell(
    row: dict, fmt: str, higher_is_better: Optional[bool], key: str = "difference"
) -> str:
    diff = row.get(key)
    if diff is None:
        return "-"
    signed = "{:+" + fmt[2:]
    text = signed.format(diff["mean"])
    if diff["n"] >= 2:
        text += f" [{signed.format(diff['low'])}, {signed.format(diff['high'])}]"
        if diff["low"] > 0 or diff["high"] < 0:
            if higher_is_better is None:
                text += " higher" if diff["low"] > 0 else " lower"
            else:
                better = (diff["low"] > 0) == higher_is_better
                text += " better" if better else " worse"
    return text


def _shown(summary: Dict[str, Dict[str, dict]], metrics: Sequence[tuple]) -> List[tuple]:
    """The metrics of `metrics` that every arm of `summary` has."""
    return [m for m in metrics if all(m[0] in rows for rows in summary.values())]


def table_against(
    summary: Dict[str, Dict[str, dict]], reference: str, metrics: Sequence[tuple] = MAIN
) -> str:
    """Markdown: per metric, the difference against `reference` paired over seeds [95%
    interval] (summarize(..., references=[reference]))."""
    key = f"difference_vs_{reference}"
    metrics = _shown(summary, metrics)
    header = ["loss"] + [f"{title}: vs {reference}" for _, title, *_ in metrics]
    header = [h.replace("|", "\\|") for h in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, rows in summary.items():
        if arm == reference:
            continue
        cells = [arm] + [
            _difference_cell(rows[name], fmt, higher, key) for name, _, fmt, higher in metrics
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(summary: Dict[str, Dict[str, dict]], metrics: Sequence[tuple] = MAIN) -> str:
    """Markdown: per metric of `metrics` that every arm has, mean [95% interval] over seeds,
    and the paired difference against ce [95% interval], marked better/worse when the
    interval excludes 0."""
    metrics = _shown(summary, metrics)
    header = ["loss"]
    for _, title, *_ in metrics:
        title = title.replace("|", "\\|")  # "mean |log10 error|" inside a Markdown cell
        header += [title, f"{title}: vs ce"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, rows in summary.items():
        cells = [arm]
        for key, _, fmt, higher in metrics:
            cells += [_cell(rows[key], fmt), _difference_cell(rows[key], fmt, higher)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(
    path: str,
    curves: Dict[str, Dict[str, dict]],
    n_seeds: int,
    summary: Optional[Dict[str, Dict[str, dict]]] = None,
) -> str:
    """Top row: each metric against steps, a line a loss (mean over seeds) in its 95% band;
    bottom row: the difference against ce paired over seeds, in its 95% band. With `summary`,
    a column more per end-of-run metric (report.END_METRICS) every arm has: its mean with the
    95% interval (top) and the paired difference against ce (bottom), a bar a loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(curves)
    ends = [
        (key, title)
        for key, title, _ in report.END_METRICS
        if summary and all(key in summary[arm] for arm in arms)
    ]
    columns = len(CURVE_METRICS) + len(ends)
    fig, axes = plt.subplots(2, columns, figsize=(4.2 * columns, 7.2), squeeze=False)
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
    for col, (key, title) in enumerate(ends, start=len(CURVE_METRICS)):
        _end_bars(axes[0][col], axes[1][col], arms, summary, key, title)
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


def _end_bars(top, bottom, arms, summary, key: str, title: str) -> None:
    """One end-of-run metric: a bar a loss with its 95% interval (top), and its difference
    against ce paired over seeds (bottom)."""
    positions = list(range(len(arms)))
    colors = [c for c, _ in zip(report.COLORS, arms, strict=False)]
    for axis, field in ((top, None), (bottom, "difference")):
        rows = [summary[arm][key] for arm in arms]
        if field is not None:
            rows = [row.get(field) for row in rows]
        means = [r["mean"] if r else 0.0 for r in rows]
        errors = [
            [r["mean"] - r["low"] if r and r["n"] >= 2 else 0.0 for r in rows],
            [r["high"] - r["mean"] if r and r["n"] >= 2 else 0.0 for r in rows],
        ]
        axis.bar(positions[: len(colors)], means[: len(colors)], color=colors)
        axis.errorbar(
            positions[: len(colors)],
            means[: len(colors)],
            yerr=[e[: len(colors)] for e in errors],
            fmt="none",
            ecolor="black",
            capsize=3,
        )
        axis.set_xticks(positions, arms, rotation=60, fontsize=7)
    top.set_title(f"{title}, end of run", fontsize=10)
    bottom.axhline(0.0, color=report.COLORS[0], linewidth=1)
    bottom.set_title(f"minus ce, paired: {title.split(' (')[0]}", fontsize=10)


def write_report(
    out: str,
    arms: Sequence[Arm],
    seeds: Sequence[int],
    results: Dict[str, Dict[int, Dict[str, float]]],
    bases: Optional[Mapping[int, dict]] = None,
) -> Dict[str, str]:
    """compare.json, compare.md, compare.png (learning curves, end bars) and compare_shape.png
    (the digit distributions' shape) in `out`; their paths. `bases`: continued pretraining's
    base run of each seed (its metrics.json), reported as the base CE before continuing."""
    summary = summarize(results, seeds, references=[SINGLE_DIGIT_DEL])
    curves = summarize_curves(results, seeds)
    paths = {name: os.path.join(out, f"compare.{name}") for name in ("json", "md", "png")}
    paths["shape"] = os.path.join(out, "compare_shape.png")
    base = None
    if bases is not None:
        values = [bases[seed]["base_ce"] for seed in seeds]
        base = {"base_ce": {**mean_interval(values).as_dict(), "per_seed": values}}
    with open(paths["json"], "w") as fh:
        record = {
            "seeds": list(seeds),
            "arms": {
                arm.name: {"loss": arm.loss, "weight": arm.weight, "slot_logits": arm.rule}
                for arm in arms
            },
            "summary": summary,
            "curves": curves,
            "runs": {
                arm: {str(s): m for s, m in by_seed.items()} for arm, by_seed in results.items()
            },
        }
        if base is not None:
            record["base"] = base
        json.dump(record, fh, indent=1)
    with open(paths["md"], "w") as fh:
        fh.write(table(summary) + "\n")
        if SINGLE_DIGIT_DEL in summary:
            fh.write(f"\nPaired against {SINGLE_DIGIT_DEL}:\n\n")
            fh.write(table_against(summary, SINGLE_DIGIT_DEL) + "\n")
        fh.write("\nThe digit distributions at the held-out digit targets:\n\n")
        fh.write(table(summary, SHAPE) + "\n")
        if base is not None:
            fh.write(
                "\nCE on the base distribution's held-out texts: the base before continuing "
                f"{_cell(base['base_ce'], '{:.4f}')}; after each arm, and its change:\n\n"
            )
            fh.write(table(summary, BASE_CE) + "\n")
    plot(paths["png"], curves, len(seeds), summary)
    report.plot_shape(
        paths["shape"],
        {arm: [by_seed[seed] for seed in seeds] for arm, by_seed in results.items()},
        f"del-megatron compare: digit distributions at held-out digit targets, {len(seeds)} seeds",
    )
    return paths
