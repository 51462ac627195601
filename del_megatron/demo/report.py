"""The demo's results.json, its PNG (learning curves per loss) and the printed table."""

from __future__ import annotations

import json
import os
from typing import Dict, List

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


def write_results(out_dir: str, runs: Dict[str, dict]) -> str:
    summary = {
        loss: {
            **{key: run.get(key) for key, _, _ in METRICS},
            "final_train_ce": final_train_ce(run["history"]),
            "train_seconds": run.get("train_seconds"),
            "eval_seconds": run.get("eval_seconds"),
        }
        for loss, run in runs.items()
    }
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as fh:
        json.dump({"summary": summary, "runs": runs}, fh, indent=1)
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


def table(runs: Dict[str, dict]) -> str:
    header = f"{'loss':>8} {'train CE':>9} " + " ".join(f"{t:>26}" for _, t, _ in METRICS)
    lines = [header]
    for loss, run in runs.items():
        ce = final_train_ce(run["history"])
        cells = " ".join(f"{fmt.format(run.get(key, float('nan'))):>26}" for key, _, fmt in METRICS)
        lines.append(f"{loss:>8} {ce:>9.4f} {cells}")
    return "\n".join(lines)


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
