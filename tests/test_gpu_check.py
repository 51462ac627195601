"""benchmarks/gpu_check: the driver's hard kill at a stage's limit, the stage limits against the
envelope, and the integration stage's command lines, corpus, gradient capture and comparison
(the whole --cpu run: test_gpu_check_run.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_integration
from benchmarks.gpu_check.context import Context
from benchmarks.gpu_check.driver import drive, run_stage_process
from benchmarks.gpu_check.limits import ENVELOPE_S, LIMITS_S, RESERVE_S, STAGES, stage_limits
from benchmarks.gpu_check.report import summary
from benchmarks.gpu_check.results import Results, read_rows
from benchmarks.gpu_check.sizes import CPU_SIZES
from benchmarks.gpu_check.stages.integration import stage_integration

ROOT = Path(__file__).resolve().parents[1]


def test_stage_limits_fit_the_envelope():
    """On a GPU and on the CPU the limits, the driver's reserve included, fit the envelope that
    gpu_check.sh gives by default (on a GPU 570 s: 10 minutes of device time less 30 s); the
    integration stage runs right after the environment; a smaller envelope scales every limit
    down."""
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert ENVELOPE_S["gpu"] <= 570
    for kind, limits in LIMITS_S.items():
        assert f"GPU_CHECK_LIMIT_S:-{ENVELOPE_S[kind]}}}" in script
        assert sum(limits.values()) + RESERVE_S <= ENVELOPE_S[kind]
        assert list(limits)[:2] == ["environment", "integration"]
        assert set(limits) == set(STAGES) - {"memory"}
    scaled = stage_limits(False, STAGES, 300)
    assert sum(scaled.values()) <= 300 - RESERVE_S
    assert scaled["integration"] == pytest.approx(250 * 280 / 550, abs=0.1)


def test_integration_is_skipped_without_megatron_lm(tmp_path, monkeypatch, capsys):
    """Without MEGATRON_LM_DIR the stage writes one row that says what to set and shows the
    command lines it would run."""
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    results = Results(tmp_path / "gpu_check.jsonl")
    ctx = Context(torch.device("cpu"), CPU_SIZES, results, tmp_path)
    stage_integration(ctx)
    (row,) = results.rows
    assert row["ok"] is None and "MEGATRON_LM_DIR" in row["skipped"]
    assert sorted(row["commands"]) == sorted(
        f"{r}_{run}" for r in ("digit", "token") for run in ("materialised", "logits_free")
    )


# ---- the driver ---------------------------------------------------------------------------------

# A stage stuck where no signal handler runs: it ignores SIGINT and SIGTERM, and its worker (as
# torchrun starts its workers) is in a session of its own and ignores them too.
STUCK = r"""
import signal, subprocess, sys, time
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
worker = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
     "time.sleep(600)"],
    start_new_session=True,
)
open(sys.argv[1], "w").write(f"{worker.pid}")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_for(path: Path) -> str:
    for _ in range(200):
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_a_stage_past_its_limit_is_killed_with_its_workers(tmp_path):
    """The stage's process and a worker it started in another session, both deaf to SIGINT and
    SIGTERM, are gone once its limit has passed."""
    pid_file = tmp_path / "worker.pid"
    command = [sys.executable, "-c", STUCK, str(pid_file)]
    started = time.monotonic()
    ended = run_stage_process(command, 3, dict(os.environ), tmp_path / "err")
    took = time.monotonic() - started
    worker = int(_wait_for(pid_file))
    assert ended.outcome == "killed" and ended.returncode is None
    assert 3 <= took < 13, took
    assert ended.strays == 1  # the worker: outside the stage's process group
    assert not _alive(worker)


def test_the_driver_reports_a_killed_stage_and_runs_the_next(tmp_path):
    """A stage killed at its limit after writing half a row: a failed row with its limit, its
    time row says killed, the next stage runs and its row parses, and the summary names the
    killed stage."""
    results = Results(tmp_path / "gpu_check.jsonl")
    path = str(results.path)

    def writes(stage: str, then: str = "") -> list:
        """A stage that writes its row, then `then` (half a row) and hangs if given."""
        row = json.dumps({"stage": stage, "check": "x", "ok": True})
        code = f"import time; open({path!r}, 'a').write({row!r} + '\\n' + {then!r})"
        return [sys.executable, "-c", code + ("; time.sleep(600)" if then else "")]

    commands = {"a": writes("a"), "b": writes("b", '{"stage": "b", "ch'), "c": writes("c")}
    limits = {"a": 20, "b": 3, "c": 20}
    seen_deadlines = {}

    def command_of(stage, deadline):
        seen_deadlines[stage] = deadline - time.time()
        return commands[stage]

    drive(results, limits, 60, command_of)
    rows = read_rows(results.path)
    by = {(r["stage"], r["check"]): r for r in rows}
    assert by[("environment", "stage limits")]["limits_s"] == limits
    assert by[("b", "stage")]["ok"] is False and by[("b", "stage")]["limit_s"] == 3
    assert "killed at its limit of 3 s" in by[("b", "stage")]["error"]
    assert [by[(s, "stage time")]["outcome"] for s in "abc"] == ["done", "killed", "done"]
    assert by[("a", "x")]["ok"] and by[("c", "x")]["ok"]  # c's row on a line of its own
    assert all(0 < seen_deadlines[s] <= limits[s] for s in "abc")
    assert "killed at their limit: b" in summary(rows)


def test_a_stage_that_dies_is_reported_with_its_stderr(tmp_path):
    results = Results(tmp_path / "gpu_check.jsonl")
    command = [sys.executable, "-c", "import os, sys; sys.stderr.write('boom'); os.abort()"]
    drive(results, {"a": 20}, 60, lambda stage, deadline: command)
    (failed,) = [r for r in results.rows if r["check"] == "stage"]
    assert "ended with status signal 6" in failed["error"] and "boom" in failed["stderr_tail"]


# ---- the integration stage's pieces -------------------------------------------------------------


def _commands(cuda: bool, ranks: int, tmp_path: Path) -> dict:
    return gpu_integration.commands(cuda, ranks, tmp_path, tmp_path / "data" / "numbers", 5)


GPU_FLAGS = (
    "--transformer-impl transformer_engine", "--bf16", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size 100000",
    "--mtp-num-layers 1", "--untie-embeddings-and-output-weights", "--vocab-size 151936",
    "--train-iters 5", "--tokenizer-type NullTokenizer",
)  # fmt: skip


def test_integration_commands_carry_the_gpu_flag_set(tmp_path):
    """On a GPU: the TE spec, bf16, gradient-accumulation fusion (not turned off), the
    distributed optimizer with overlapped reduce-scatter and all-gather in small buckets, MTP,
    an untied output layer, V 151936, the corpus (no mock data); both reductions, the digit one
    first, logits-free on one run of each; the gradient file prefix of each run."""
    runs = _commands(True, 2, tmp_path)
    assert list(runs) == [
        "digit_materialised", "digit_logits_free", "token_materialised", "token_logits_free",
    ]  # fmt: skip
    for name, command in runs.items():
        line = " ".join(command)
        for flag in GPU_FLAGS:
            assert flag in line, (name, flag)
        assert "--no-gradient-accumulation-fusion" not in line and "--mock-data" not in line
        assert f"--data-path {tmp_path / 'data' / 'numbers'}" in line
        assert f"--nproc-per-node 2 --master-port {gpu_integration.PORT}" in line
        assert ("--del-logits-free" in command) == name.endswith("logits_free")
        assert f"--del-reduction {name.split('_')[0]}" in line
        entry = command.index(str(ROOT / "benchmarks" / "gpu_integration.py"))
        assert command[entry + 1] == str(tmp_path / f"integration_{name}_main_grad")
    cpu = " ".join(_commands(False, 2, tmp_path)["digit_logits_free"])
    assert "--distributed-backend gloo" in cpu and "--vocab-size 1024" in cpu.split("151936")[-1]


def test_data_parallel_size(tmp_path):
    """DP 2 on the CPU and with 2+ GPUs (one rank a GPU), DP 1 on one GPU, and why."""
    assert gpu_integration.data_parallel(False, 0)[0] == 2
    assert gpu_integration.data_parallel(True, 8) == (
        2,
        "DP 2: one rank on each of 2 of the 8 GPUs (NCCL)",
    )
    ranks, why = gpu_integration.data_parallel(True, 1)
    assert ranks == 1 and "NCCL runs one rank a device" in why and "--cpu" in why


LOG = """ [2026-12-01 10:00:00] iteration        1/       2 | consumed samples:            4 | \
lm loss: 1.193250E+01 | ce loss: 1.190000E+01 | del term: 3.250000E-01 | digit tokens: 390 | \
digit share: 3.8E-01 | loss scale: 1.0 |
 [2026-12-01 10:00:01] iteration        2/       2 | consumed samples:            8 | \
lm loss: 1.190011E+01 | del term: 3.1E-01 | digit tokens: 377 | loss scale: 1.0 |"""


def test_integration_log_parsing_and_comparison():
    """The comparison passes equal runs and fails a logits-free run whose output weight lost the
    main head's gradient (F2: only the MTP head's share left), whose loss drifts, whose steps
    had no digit target or which stopped early."""
    logs = gpu_integration.parse_log(LOG)
    assert logs[1]["lm loss"] == 11.9325 and logs[1]["digit tokens"] == 390
    assert logs[2] == {"consumed samples": 8, "lm loss": 11.90011, "del term": 0.31,
                       "digit tokens": 377, "loss scale": 1.0}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    grad = [torch.randn(64, 8, generator=gen) for _ in range(2)]
    noise = [g + 1e-3 * torch.randn(64, 8, generator=gen) for g in grad]
    same = {"materialised": logs, "logits_free": json.loads(json.dumps(logs), object_hook=_ints)}

    def check(runs, logits_free_grad):
        return gpu_integration.compare(
            runs, {"materialised": grad, "logits_free": logits_free_grad}, 2
        )

    ok, figures = check(same, noise)
    assert ok and figures["ranks_compared"] == 2 and figures["digit_tokens_min"] == 377
    ok, figures = check(same, [g.clone() for g in grad[:1]] + [0.1 * grad[1]])
    assert not ok and figures["main_grad_rel_error"] == pytest.approx(0.9)
    drift = json.loads(json.dumps(logs), object_hook=_ints)
    drift[2]["lm loss"] = 12.5
    assert not check({"materialised": logs, "logits_free": drift}, grad)[0]
    no_digits = json.loads(json.dumps(logs), object_hook=_ints)
    no_digits[2]["digit tokens"] = 0.0
    assert not check({"materialised": logs, "logits_free": no_digits}, grad)[0]
    assert not check({"materialised": logs, "logits_free": {1: logs[1]}}, grad)[0]


def _ints(d: dict) -> dict:
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def test_main_grad_is_read_before_the_optimizer_step(tmp_path):
    """The gradient saved is main_grad as the optimizer's step finds it (after backward and the
    gradient reduction, before clipping and the update), once, and the step still runs."""
    weight = torch.nn.Parameter(torch.zeros(4, 2))
    weight.main_grad = torch.arange(8.0).reshape(4, 2)

    class Optimizer:
        def step(self):
            weight.main_grad.mul_(0.5)  # clipping, then zeroing for the next step
            weight.main_grad.zero_()
            return "stepped"

    optimizer = Optimizer()
    gpu_integration.save_before_step(optimizer, weight, str(tmp_path / "g"))
    assert optimizer.step() == "stepped"
    saved = torch.load(tmp_path / "g.rank0.pt")
    assert torch.equal(saved, torch.arange(8.0).reshape(4, 2))
    assert weight.main_grad.abs().sum() == 0
    weight.main_grad.fill_(7.0)
    optimizer.step()
    assert torch.equal(torch.load(tmp_path / "g.rank0.pt"), saved)  # the first step's only


def test_integration_saves_the_untied_output_weight():
    """gpu_integration finds output_layer.weight of the first chunk (not the MTP head's, not
    the embedding)."""
    model = torch.nn.Module()
    model.embedding = torch.nn.Embedding(4, 2)
    model.output_layer = torch.nn.Linear(2, 4, bias=False)
    model.mtp = torch.nn.Module()
    model.mtp.output_layer = torch.nn.Linear(2, 4, bias=False)
    assert gpu_integration._output_weight([model]) is model.output_layer.weight


def test_number_corpus(tmp_path):
    """Read back with megatron.core's IndexedDataset: the ids stay in the vocabulary, digits are
    ids 10-19 and the share the writer reports is the share in the file (over 30%)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "numbers"
    written = gpu_integration.write_number_corpus(prefix, vocab=1024, tokens=20_000)
    dataset = IndexedDataset(str(prefix))
    ids = torch.cat([torch.as_tensor(dataset[i].astype("int64")) for i in range(len(dataset))])
    assert len(dataset) == written["documents"] and ids.numel() == written["tokens"] >= 20_000
    assert ids.min() >= 10 and ids.max() < 1023 and not ((ids >= 20) & (ids < 30)).any()
    share = ((ids >= 10) & (ids < 20)).double().mean().item()
    assert share == pytest.approx(written["digit_share"]) and share > 0.3


def test_megatron_core_version(tmp_path):
    info = tmp_path / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    assert gpu_integration.megatron_core_version(tmp_path) == (0, 16)
    assert gpu_integration.megatron_core_version(tmp_path / "none") is None


def test_jsonl_survives_a_cut_line(tmp_path):
    path = tmp_path / "gpu_check.jsonl"
    row = {"stage": "speed", "check": "x", "ok": None}
    path.write_text(json.dumps(row) + "\n" + '{"stage": "spe')
    assert read_rows(path) == [row]
    Results(path, fresh=False).add("speed", "y", True)
    assert read_rows(path) == [row, {"stage": "speed", "check": "y", "ok": True}]
