"""The demo's results.json, its PNG (learning curves per loss) and the printed table."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

METRICS = [
    ("digit_accuracy", "digit acc (teacher-forced)", "{:.3f}"),
    ("exact_accuracy", "exact answer (greedy)", "{:.3f}"),
    ("mean_abs_log10_error", "mean |log10 error|", "{:.4f}"),
]
# Scored at the end of a run only: the answer's number tokens of the right length, and the
# digit distributions' entropy ("length" slot logits for every run).
END_METRICS = [
    ("length_accuracy", "length acc (teacher-forced)", "{:.3f}"),
    ("digit_entropy", "digit entropy (nats)", "{:.3f}"),
]
# The digit distributions' shape at the held-out digit targets (digit_shape), at the end.
SHAPE_METRICS = [
    ("digit_entropy", "digit entropy (nats)", "{:.3f}"),
    ("target_probability", "p(target digit)", "{:.3f}"),
    ("expected_distance", "E|digit - target|", "{:.3f}"),
    ("calibration_error", "calibration error (ECE)", "{:.3f}"),
]
# Continued pretraining: the CE on the base distribution's held-out texts after the run, and
# its change from the base's own (the base before continuing).
BASE_METRICS = [
    ("base_ce", "base-distribution CE", "{:.4f}"),
    ("base_ce_change", "base CE change", "{:.4f}"),
]
TRAIN_CE = ("train_ce", "train CE (mean between points)", "{:.4f}")
# One a loss: enough for every loss of `compare` at four DEL weights (a color left out drops its
# loss from the plot).
COLORS = ["#555555", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
COLORS += ["#7f7f7f", "#bcbd22", "#17becf"]


def final_train_ce(history: List[dict]) -> float:
    """Mean per-batch training CE over the last 5% of a run's steps (at least one): one batch's
    CE is too noisy to compare runs by."""
    if not history:
        return float("nan")
    tail = history[-max(1, len(history) // 20) :]
    return sum(h["ce"] for h in tail) / len(tail)


def log_scale(ax, values: List[float]) -> None:
    """A log y axis with a few ticks labelled in plain numbers over `values`' range (the
    training CE falls from ~6 to below 1)."""
    import math

    from matplotlib.ticker import NullFormatter

    ax.set_yscale("log")
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    if not finite:
        return
    low, high = math.log(min(finite)), math.log(max(finite))
    ticks = sorted({float(f"{math.exp(low + (high - low) * k / 4):.2g}") for k in range(5)})
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())


def write_results(out_dir: str, runs: Dict[str, dict], base: Optional[dict] = None) -> str:
    """results.json: per loss its metrics (and the base's, continued pretraining's starting
    point, under "base"), and every run's whole record."""
    summary = {
        loss: {
            **{key: run.get(key) for key, _, _ in METRICS + SHAPE_METRICS + BASE_METRICS},
            "final_train_ce": final_train_ce(run["history"]),
            "train_seconds": run.get("train_seconds"),
            "eval_seconds": run.get("eval_seconds"),
        }
        for loss, run in runs.items()
    }
    record = {"summary": summary, "runs": runs}
    if base is not None:
        record["base"] = {
            key: base.get(key) for key in ("base_ce", "train_seconds", "eval_seconds", "config")
        }
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
    return path


def plot(out_dir: str, runs: Dict[str, dict]) -> str:
    """One panel a metric against steps, a line a loss: the held-out metrics on the curve's
    fixed subset at each point, the end's score on every held-out problem as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [*METRICS, TRAIN_CE]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.7))
    subset = None
    for color, (loss, run) in zip(COLORS, runs.items(), strict=False):
        curve = run.get("curve", [])
        steps = [p["step"] for p in curve]
        subset = subset or (curve[0]["problems"] if curve else None)
        for ax, (key, _, _) in zip(axes, panels, strict=True):
            ax.plot(steps, [p[key] for p in curve], "-o", color=color, markersize=3, label=loss)
            if key in run and curve:  # the end, on all held-out problems
                ax.plot([steps[-1]], [run[key]], "D", color=color, markersize=7, mfc="none")
    for ax, (_, title, _) in zip(axes, panels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    log_scale(axes[-1], [p["train_ce"] for run in runs.values() for p in run.get("curve", [])])
    axes[0].legend(fontsize=8)
    problems = max((run.get("eval_problems", 0) for run in runs.values()), default=0)
    fig.suptitle(
        f"del-megatron CPU demo: held-out metrics on {subset} problems during training "
        f"(lines) and on all {problems} at the end (open diamonds)",
        fontsize=10,
    )
    fig.tight_layout()
    path = os.path.join(out_dir, "results.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(runs: Dict[str, dict], base: Optional[dict] = None) -> str:
    """The printed tables: per loss the held-out metrics, then the digit distributions' shape
    and (with the `base` run) the base distribution's CE after the run and its change."""
    lines = []
    shape = SHAPE_METRICS + (BASE_METRICS if base is not None else [])
    for metrics in (METRICS, shape):
        first = f"{'loss':>8} {'train CE':>9} " if metrics is METRICS else f"{'loss':>8} "
        lines.append(first + " ".join(f"{t:>26}" for _, t, _ in metrics))
        for loss, run in runs.items():
            cells = " ".join(
                f"{fmt.format(run.get(key, float('nan'))):>26}" for key, _, fmt in metrics
            )
            if metrics is METRICS:
                cells = f"{final_train_ce(run['history']):>9.4f} " + cells
            lines.append(f"{loss:>8} {cells}")
        lines.append("")
    if base is not None:
        lines.append(f"base-distribution CE of the base before continuing: {base['base_ce']:.4f}")
    return "\n".join(lines).rstrip()


def curve_table(runs: Dict[str, dict]) -> str:
    """Digit accuracy at each curve point, a column a loss (the curve's subset)."""
    losses = list(runs)
    steps = sorted({p["step"] for run in runs.values() for p in run.get("curve", [])})
    by_step = {
        loss: {p["step"]: p["digit_accuracy"] for p in run.get("curve", [])}
        for loss, run in runs.items()
    }
    lines = [f"{'step':>6} " + " ".join(f"{loss:>9}" for loss in losses)]
    for step in steps:
        cells = " ".join(
            f"{by_step[loss][step]:>9.3f}" if step in by_step[loss] else f"{'-':>9}"
            for loss in losses
        )
        lines.append(f"{step:>6} {cells}")
    return "digit accuracy during training (curve subset):\n" + "\n".join(lines)


def plot_shape(path: str, runs: Dict[str, List[dict]], title: str) -> str:
    """The digit distributions' shape per loss (runs: {loss: [each seed's metrics]}): left, the
    mean probability of a digit by its distance from the target (log scale; the mean over
    seeds); right, the top digit's accuracy against its confidence (the seeds' targets pooled
    per confidence bin), the diagonal being calibrated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (profile_ax, bins_ax) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    shown: List[float] = []
    for color, (loss, seeds) in zip(COLORS, runs.items(), strict=False):
        profiles = [run["distance_profile"] for run in seeds]
        mean = [sum(values) / len(values) for values in zip(*profiles, strict=True)]
        profile_ax.plot(range(len(mean)), mean, "-o", color=color, markersize=3, label=loss)
        shown += mean
        pooled = [[0.0, 0.0, 0.0] for _ in seeds[0]["calibration_bins"]]
        for run in seeds:
            for total, (count, confidence, accuracy) in zip(
                pooled, run["calibration_bins"], strict=True
            ):
                total[0] += count
                total[1] += count * confidence
                total[2] += count * accuracy
        points = [(c / n, a / n) for n, c, a in pooled if n > 0]
        bins_ax.plot(*zip(*points, strict=True), "-o", color=color, markersize=3, label=loss)
    log_scale(profile_ax, shown)
    profile_ax.set_xlabel("distance from the target digit")
    profile_ax.set_title("mean probability of a digit, by distance from the target", fontsize=10)
    bins_ax.plot([0, 1], [0, 1], ":", color=COLORS[0], linewidth=1)
    bins_ax.set_xlabel("confidence of the top digit (bin mean)")
    bins_ax.set_title("accuracy of the top digit (calibrated: on the diagonal)", fontsize=10)
    profile_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
