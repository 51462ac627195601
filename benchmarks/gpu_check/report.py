"""The summary printed at the end: one line a result, each stage's limit and time, the verdict."""

from __future__ import annotations

import json
from typing import List

from .limits import STAGES

SUMMARY_FIELDS = (
    "kernel", "value_error", "grad_error", "grad_hidden_error", "grad_weight_error",
    "forward_ms", "backward_ms", "gb_s", "hbm_share", "time_vs_megatron_ce", "time_vs_te_ce",
    "peak_mib", "peak_vs_megatron_ce", "peak_vs_te_ce", "vs_floor", "cuda_reported", "causes",
    "new_graphs_per_call", "replay_error", "data_parallel", "digit_share", "main_grad_rel_error",
    "lm_loss_rel_error", "del_term_rel_error", "run_seconds", "skipped", "error",
)  # fmt: skip
DRIVER_CHECKS = ("stage time", "stage limits")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict) and value:
        return json.dumps(value)[:60]
    return str(value)[:80]


def _stage_table(rows: List[dict]) -> List[str]:
    """Each stage's limit, time and how it ended, and the limits against the envelope."""
    plan = next((r for r in rows if r["check"] == "stage limits"), None)
    if plan is None:
        return []
    times = {r["stage"]: r for r in rows if r["check"] == "stage time"}
    lines = ["", "| stage | limit s | took s | ended |", "|---|---|---|---|"]
    for stage, limit in plan["limits_s"].items():
        took = times.get(stage, {})
        seconds, ended = took.get("seconds", ""), took.get("outcome", "not run")
        lines.append(f"| {stage} | {limit:g} | {seconds} | {ended} |")
    lines.append(
        f"stage limits add up to {plan['sum_s']:g} s of the {plan['envelope_s']:g} s envelope"
    )
    return lines


def summary(rows: List[dict]) -> str:
    """A Markdown table, one line per result, the stages' limits and times, and the verdict:
    passed, failed and the stages with no result."""
    lines = ["| stage | check | ok | figures |", "|---|---|---|---|"]
    for row in rows:
        if row["check"] in DRIVER_CHECKS:
            continue
        if row["stage"] == "environment" and row["check"] == "environment":
            figures = ", ".join(
                f"{k} {_cell(v)}" for k, v in row.items() if k not in ("stage", "check", "ok")
            )
        else:
            figures = ", ".join(
                f"{k} {_cell(row[k])}" for k in SUMMARY_FIELDS if row.get(k) is not None
            )
        mark = {True: "pass", False: "FAIL", None: ""}[row["ok"]]
        lines.append(f"| {row['stage']} | {row['check']} | {mark} | {figures} |")
    failed = [r for r in rows if r["ok"] is False]
    passed = [r for r in rows if r["ok"] is True]
    plan = next((r["limits_s"] for r in rows if r["check"] == "stage limits"), STAGES)
    expected = [s for s in STAGES if s in plan or (s == "memory" and "speed" in plan)]
    missing = [
        s
        for s in expected
        if not any(r["stage"] == s and r["check"] != "stage limits" for r in rows)
    ]
    verdict = f"{len(passed)} passed, {len(failed)} failed"
    killed = [
        r["stage"] for r in rows if r["check"] == "stage time" and r.get("outcome") == "killed"
    ]
    if killed:
        verdict += f"; killed at their limit: {', '.join(killed)}"
    if missing:
        verdict += f"; no result from: {', '.join(missing)}"
    return "\n".join(lines + _stage_table(rows) + ["", verdict])
