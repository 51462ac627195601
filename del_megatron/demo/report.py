"""results.json, the PNG with loss curves and metrics side by side, and the printed table."""

from __future__ import annotations

import json
import os
from typing import Dict

METRICS = [
    ("digit_accuracy", "digit acc (teacher-forced)", "{:.3f}"),
    ("exact_accuracy", "exact answer (greedy)", "{:.3f}"),
    ("mean_abs_log10_error", "mean |log10 error|", "{:.4f}"),
]


def write_results(out_dir: str, runs: Dict[str, dict]) -> str:
    summary = {
        loss: {
            **{key: run.get(key) for key, _, _ in METRICS},
            "final_loss": run["history"][-1]["loss"] if run["history"] else None,
            "final_ce": run["history"][-1]["ce"] if run["history"] else None,
            "train_seconds": run.get("train_seconds"),
        }
        for loss, run in runs.items()
    }
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as fh:
        json.dump({"summary": summary, "runs": runs}, fh, indent=1)
    return path


def plot(out_dir: str, runs: Dict[str, dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(METRICS), figsize=(4.2 * (1 + len(METRICS)), 3.6))
    for loss, run in runs.items():
        steps = [h["step"] for h in run["history"]]
        axes[0].plot(steps, [h["ce"] for h in run["history"]], label=f"{loss}: CE part")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("cross-entropy (train)")
    axes[0].set_yscale("log")
    axes[0].legend()
    names = list(runs)
    for ax, (key, title, _) in zip(axes[1:], METRICS, strict=True):
        values = [runs[n].get(key) or 0.0 for n in names]
        bars = ax.bar(
            names, values, color=["#888888", "#1f77b4", "#ff7f0e", "#2ca02c"][: len(names)]
        )
        ax.bar_label(bars, fmt="%.3f")
        ax.set_title(title)
    fig.suptitle("del-megatron CPU demo: held-out problems")
    fig.tight_layout()
    path = os.path.join(out_dir, "results.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(runs: Dict[str, dict]) -> str:
    header = f"{'loss':>8} {'final CE':>9} " + " ".join(f"{t:>26}" for _, t, _ in METRICS)
    lines = [header]
    for loss, run in runs.items():
        ce = run["history"][-1]["ce"] if run["history"] else float("nan")
        cells = " ".join(f"{fmt.format(run.get(key, float('nan'))):>26}" for key, _, fmt in METRICS)
        lines.append(f"{loss:>8} {ce:>9.4f} {cells}")
    return "\n".join(lines)
