"""benchmarks/gpu_check.sh --cpu: every stage of the GPU check at toy sizes on the CPU, so that
the one command run on a first GPU cannot rot; and the integration stage's command lines and
comparison, which need Megatron-LM and a GPU to run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check, gpu_integration

ROOT = Path(__file__).resolve().parents[1]
# Rows that fail on a CPU (none).
KNOWN_FAILURES: set = set()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """(exit status, printed output, rows) of `bash benchmarks/gpu_check.sh --cpu`."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    env.pop("MEGATRON_LM_DIR", None)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = gpu_check.read_rows(out / "gpu_check.jsonl")
    return done.returncode, done.stdout + done.stderr, rows


def _rows(rows, stage):
    return [r for r in rows if r["stage"] == stage and r["check"] != "stage time"]


def test_every_stage_reports(cpu_run):
    _, output, rows = cpu_run
    assert {r["stage"] for r in rows} == set(gpu_check.STAGES), output[-3000:]
    assert not [r for r in rows if r["check"] == "stage"], "a stage raised:\n" + output[-3000:]
    timed = {r["stage"] for r in rows if r["check"] == "stage time"}
    assert timed == set(gpu_check.STAGES) - {"memory"}  # speed writes the memory rows


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
    (integration,) = _rows(rows, "integration")
    assert integration["ok"] is None and "MEGATRON_LM_DIR" in integration["skipped"]


def test_summary_and_exit_status(cpu_run):
    """The shell script prints the summary table and exits 1 exactly when a row failed (none
    on a CPU)."""
    status, output, rows = cpu_run
    assert "== gpu_check summary" in output and "| correctness | ce vs Megatron CE" in output
    failed = {(r["stage"], r["check"]) for r in rows if r["ok"] is False}
    assert failed == KNOWN_FAILURES, failed
    assert status == (1 if failed else 0), output[-2000:]
    passed = sum(r["ok"] is True for r in rows)
    assert f"{passed} passed, {len(failed)} failed" in output


GPU_FLAGS = (
    "--transformer-impl transformer_engine", "--bf16", "--use-distributed-optimizer",
    "--mtp-num-layers 1", "--untie-embeddings-and-output-weights", "--vocab-size 151936",
    "--train-iters 5",
)  # fmt: skip


def test_integration_commands_carry_the_gpu_flag_set(tmp_path):
    """On a GPU: the TE spec, bf16, gradient-accumulation fusion (not turned off), the
    distributed optimizer, MTP, an untied output layer and V 151936; logits-free on one run."""
    ctx = gpu_check.Context(torch.device("cuda"), gpu_check.GPU_SIZES, None, tmp_path)
    runs = gpu_check.integration_commands(ctx, tmp_path)
    assert sorted(runs) == ["logits_free", "materialised"]
    for name, command in runs.items():
        line = " ".join(command)
        for flag in GPU_FLAGS:
            assert flag in line, (name, flag)
        assert "--no-gradient-accumulation-fusion" not in line
        assert ("--del-logits-free" in command) == (name == "logits_free")
        assert command[command.index(str(ROOT / "benchmarks" / "gpu_integration.py")) + 1] == str(
            tmp_path / f"integration_{name}_main_grad.pt"
        )


LOG = """ [2026-12-01 10:00:00] iteration        1/       5 | consumed samples:            4 | \
lm loss: 1.193250E+01 | del term: 3.1E-01 | loss scale: 1.0 |
 [2026-12-01 10:00:01] iteration        2/       5 | consumed samples:            8 | \
lm loss: 1.190011E+01 | loss scale: 1.0 |"""


def test_integration_comparison():
    """The stage passes equal runs and fails a logits-free run whose output weight lost the main
    head's gradient (F2: only the MTP head's share left) or whose loss drifts."""
    losses = gpu_check.parse_lm_loss(LOG)
    assert losses == {1: 11.9325, 2: 11.90011}
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(64, 8, generator=gen)
    same = {"materialised": losses, "logits_free": dict(losses)}
    noise = grad + 1e-3 * torch.randn(64, 8, generator=gen)
    assert gpu_check.compare_integration(same, {"materialised": grad, "logits_free": noise})[0]
    dropped = {"materialised": grad, "logits_free": 0.1 * grad}
    ok, figures = gpu_check.compare_integration(same, dropped)
    assert not ok and figures["main_grad_rel_error"] == pytest.approx(0.9)
    drift = {"materialised": losses, "logits_free": {1: 11.9325, 2: 12.5}}
    assert not gpu_check.compare_integration(drift, {"materialised": grad, "logits_free": grad})[0]


def test_integration_saves_the_untied_output_weight():
    """gpu_integration finds output_layer.weight of the first chunk (not the MTP head's, not
    the embedding)."""
    model = torch.nn.Module()
    model.embedding = torch.nn.Embedding(4, 2)
    model.output_layer = torch.nn.Linear(2, 4, bias=False)
    model.mtp = torch.nn.Module()
    model.mtp.output_layer = torch.nn.Linear(2, 4, bias=False)
    assert gpu_integration._output_weight([model]) is model.output_layer.weight


def test_jsonl_survives_a_cut_line(tmp_path):
    path = tmp_path / "gpu_check.jsonl"
    row = {"stage": "speed", "check": "x", "ok": None}
    path.write_text(json.dumps(row) + "\n" + '{"stage": "spe')
    assert gpu_check.read_rows(path) == [row]
