"""benchmarks/gpu_check.sh --cpu, the whole run: every stage of the GPU check at toy sizes on
the CPU, each in a process of its own, the integration stage (Megatron-LM's pretrain_gpt.py at
DP 2 on two gloo ranks) included, so that the one command run on a first GPU cannot rot.
tests/conftest.py collects it where the integration stage can run (megatron-core >= 0.18, the
GPU image's); test_gpu_check.py tests the driver and the stages' pieces on every environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_integration
from benchmarks.gpu_check.limits import ENVELOPE_S, LIMITS_S, STAGES
from benchmarks.gpu_check.report import DRIVER_CHECKS
from benchmarks.gpu_check.results import read_rows
from benchmarks.gpu_check.stages.integration import MIN_LOGITS_FREE_CORE
from tests import megatron_lm_source

ROOT = Path(__file__).resolve().parents[1]
# Rows that fail on a CPU (none).
KNOWN_FAILURES: set = set()


@pytest.fixture(scope="module")
def megatron_lm_tree(tmp_path_factory):
    """(tree, why not): this environment's newest Megatron-LM tag unpacked (docs/testing.md says
    where the sources come from), its bytecode compiled once as the e2e stage does."""
    from tests.e2e.megatron_lm import tags_for_this_environment

    tag = tags_for_this_environment()[-1]
    try:
        source = megatron_lm_source.find(tag, network=False)
    except megatron_lm_source.SourceUnavailable as missing:
        return None, str(missing)
    tree = megatron_lm_source.materialise(source, tmp_path_factory.mktemp("megatron-lm"))
    if gpu_integration.megatron_core_version(tree) >= MIN_LOGITS_FREE_CORE:
        sources = [str(tree / "megatron"), *map(str, tree.glob("*.py"))]
        compile_all = [sys.executable, "-m", "compileall", "-q", "-j", "0", *sources]
        subprocess.run(compile_all, check=True, capture_output=True)
    return tree, None


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, megatron_lm_tree):
    """(exit status, printed output, rows, OUT) of `bash benchmarks/gpu_check.sh --cpu`."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    env.pop("MEGATRON_LM_DIR", None)
    if megatron_lm_tree[0] is not None:
        env["MEGATRON_LM_DIR"] = str(megatron_lm_tree[0])
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1000,
    )
    rows = read_rows(out / "gpu_check.jsonl")
    return done.returncode, done.stdout + done.stderr, rows, out


def _rows(rows, stage):
    return [r for r in rows if r["stage"] == stage and r["check"] not in DRIVER_CHECKS]


def test_every_stage_reports_in_its_own_process_within_its_limit(cpu_run):
    _, output, rows, _ = cpu_run
    assert {r["stage"] for r in rows} == set(STAGES), output[-3000:]
    assert not [r for r in rows if r["check"] == "stage"], "a stage failed:\n" + output[-3000:]
    times = {r["stage"]: r for r in rows if r["check"] == "stage time"}
    assert list(times) == list(LIMITS_S["cpu"])  # in order; speed writes memory's rows
    for stage, row in times.items():
        assert row["outcome"] == "done" and row["limit_s"] == LIMITS_S["cpu"][stage]
        assert 0 < row["seconds"] < row["limit_s"], row


def test_correctness_and_logits_free_pass(cpu_run):
    """Megatron's CE (every kernel), the fp64 reference (both reductions), the logits-free
    routes: all within tolerance, at both N and both dtypes; the weight-gradient sink's product
    formed by upcasting on a CPU (no fp32-output GEMM there)."""
    rows = _rows(cpu_run[2], "correctness") + _rows(cpu_run[2], "logits_free")
    assert len(rows) == 2 * (3 + 2) + 2 * (1 + 2) + 2 * 3 + 1
    failed = [r for r in rows if r["ok"] is not True]
    assert not failed, failed
    (sink,) = [r for r in rows if r["check"].startswith("weight-gradient sink product")]
    assert sink["route"] == "upcast", sink


def test_speed_and_memory_rows(cpu_run):
    """Every implementation timed (forward and backward apart) and its peak set against
    Megatron's CE and the logits + gradient floor; the kernels that keep the logits (not an fp32
    softmax, as "softmax" and Megatron do) at most Megatron's peak."""
    speed, memory = _rows(cpu_run[2], "speed"), _rows(cpu_run[2], "memory")
    impls = {"megatron_ce", "del", "del_recompute", "del_softmax", "del_compiled", "ce"}
    assert {r["impl"] for r in speed} == {r["impl"] for r in memory} == impls
    for row in speed:
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0 and row["gb_s"] > 0, row
    for row in memory:
        assert row["vs_floor"] > 0 and (row["impl"] == "megatron_ce") != (
            "peak_vs_megatron_ce" in row
        )
    kept = [r for r in memory if r["impl"] not in ("megatron_ce", "del_softmax")]
    assert len(kept) == 4 and all(r["ok"] for r in kept), kept


def test_sync_audit(cpu_run):
    """The loss path's cases (the logits-free forward route with its loss mask included) find
    no cause of a host sync."""
    rows = {r["check"]: r for r in _rows(cpu_run[2], "syncs")}
    assert len(rows) == 6
    for row in rows.values():
        assert row["ok"] is True, row


def test_recompiles_and_skips(cpu_run):
    rows = cpu_run[2]
    (recompiles,) = _rows(rows, "recompiles")
    assert recompiles["ok"], recompiles
    assert recompiles["new_graphs_per_call"][1:3] == [0, 0], recompiles  # other N: no graph
    (graph,) = _rows(rows, "cuda_graph")
    assert graph["ok"] is None and "CUDA" in graph["skipped"]


def test_integration_trains_at_dp2_on_numbers_with_both_reductions(cpu_run, megatron_lm_tree):
    """Megatron-LM's pretrain_gpt.py through the drop-in on two gloo ranks (DP 2, overlapped
    reduce-scatter and all-gather, small buckets), on a corpus where 38% of the tokens are
    digits: for the digit and the token reduction, logits-free off and on agree in lm loss,
    DEL term and both ranks' output-layer main_grad, with digit targets in every step. On a
    megatron-core without logits-free (0.16) the stage says so and runs nothing."""
    tree, missing = megatron_lm_tree
    if tree is None:
        pytest.skip(f"no Megatron-LM sources for the integration stage: {missing}")
    rows = _rows(cpu_run[2], "integration")
    if gpu_integration.megatron_core_version(tree) < MIN_LOGITS_FREE_CORE:
        (row,) = rows
        assert row["ok"] is None and "needs megatron-core >= 0.18" in row["skipped"], row
        return
    corpus, *pairs = rows
    assert corpus["ok"] and corpus["digit_share"] > 0.3, corpus
    assert [r["reduction"] for r in pairs] == ["digit", "token"]
    for row in pairs:
        assert row["ok"] is True, row
        assert row["ranks"] == row["ranks_compared"] == 2 and "gloo" in row["data_parallel"]
        assert row["digit_share"] > 0.3 and row["digit_tokens_min"] > 0, row
        assert row["main_grad_norm"][0] > 0 and row["main_grad_norm"][1] > 0, row
    digit_log = (cpu_run[3] / "integration_digit_logits_free.log").read_text()
    assert "del (alpha 0.1 on the mean term over digit targets, digit reduction)" in digit_log
    assert "logits-free loss; the output layer's gradients take the" in digit_log


def test_summary_and_exit_status(cpu_run):
    """The shell script prints the summary table, each stage's limit and time and the limits'
    sum against the envelope, and exits 1 exactly when a row failed (none on a CPU)."""
    status, output, rows, _ = cpu_run
    assert "== gpu_check summary" in output and "| correctness | ce vs Megatron CE" in output
    assert "| stage | limit s | took s | ended |" in output
    for stage, limit in LIMITS_S["cpu"].items():
        assert re.search(rf"\| {stage} \| {limit:g} \| [0-9.]+ \| done \|", output), stage
    total, envelope = sum(LIMITS_S["cpu"].values()), ENVELOPE_S["cpu"]
    assert f"stage limits add up to {total:g} s of the {envelope} s envelope" in output
    failed = {(r["stage"], r["check"]) for r in rows if r["ok"] is False}
    assert failed == KNOWN_FAILURES, failed
    assert status == (1 if failed else 0), output[-2000:]
    passed = sum(r["ok"] is True for r in rows)
    assert f"{passed} passed, {len(failed)} failed" in output
