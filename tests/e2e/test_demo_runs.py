"""The CPU demo (the README's main job) and `del-megatron compare` run for real, at toy size:
prepare, a CE base, CE and DEL continued from it under torchrun, evaluate, resume, and a 2 x 2
continued-pretraining sweep. The e2e stage runs them on Python 3.11, the main job's
environment (tests/run.sh)."""

import json
import os
import subprocess
import sys

import pytest

from del_megatron.cpu.ports import free_port

# A few seconds of training: shared by the demo (with DATA) and the bare torchrun worker.
TRAIN = "--steps 24 --micro-batch 8 --seq-len 32 --hidden 64 --heads 4 --eval-problems 8"
TRAIN = (
    TRAIN + " --save-interval 6 --warmup 4 --lr 0.005 --min-lr 0.0002 --curve-points 3"
    " --curve-problems 4"
).split()
DATA = "--num-docs 2000 --num-eval 16".split()
BASE = "--base-steps 30".split()


def run_cli(*argv):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "del_megatron.tools.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = run_cli("demo", "--out", str(out), *TRAIN, *DATA, *BASE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_quick_demo_learns_and_reports_every_metric(quick_demo):
    out, proc = quick_demo
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == {"ce", "del"}
    base = json.loads((out / "base" / "metrics.json").read_text())
    assert len(base["history"]) == 30 and base["config"]["loss"] == "ce"
    assert results["base"]["base_ce"] == base["base_ce"]
    # the base learned the base corpus; each run continued from its weights, on the continued
    # corpus, in the same order: their first batch's CE is the same, below the base's first
    assert base["history"][-1]["ce"] < 0.8 * base["history"][0]["ce"]
    firsts = {loss: run["history"][0]["ce"] for loss, run in results["runs"].items()}
    assert firsts["ce"] == pytest.approx(firsts["del"], rel=1e-6)
    assert firsts["ce"] < 0.8 * base["history"][0]["ce"]
    continued_meta = json.loads((out / "continued-data" / "meta.json").read_text())
    assert continued_meta["distribution"] == "continued"
    for loss, run in results["runs"].items():
        history = run["history"]
        assert len(history) == 24 and run["finished"]
        assert run["config"]["init_from"] == str(out / "base" / "checkpoints")
        assert run["base_ce_change"] == pytest.approx(run["base_ce"] - base["base_ce"])
        for key in ("digit_entropy", "target_probability", "expected_distance"):
            assert results["summary"][loss][key] == run[key] and run[key] > 0, key
        assert 0 <= run["calibration_error"] <= 1 and len(run["distance_profile"]) == 10
        for key in ("digit_accuracy", "exact_accuracy", "mean_abs_log10_error"):
            assert isinstance(run[key], float) and run[key] >= 0, key
        # the learning curve: 4 of the 8 held-out problems at steps 8, 16 and 24
        assert [(p["step"], p["problems"]) for p in run["curve"]] == [(8, 4), (16, 4), (24, 4)]
        assert run["curve"][1]["train_ce"] == pytest.approx(sum(h["ce"] for h in history[8:16]) / 8)
    assert results["runs"]["ce"]["history"][0]["loss"] == pytest.approx(
        results["runs"]["ce"]["history"][0]["ce"]
    )
    assert results["runs"]["del"]["history"][0]["loss"] > results["runs"]["del"]["history"][0]["ce"]
    assert (out / "results.png").stat().st_size > 10_000
    assert (out / "results_shape.png").stat().st_size > 10_000
    assert "base-distribution CE of the base before continuing" in proc.stdout
    assert "digit acc" in proc.stdout and "exact answer" in proc.stdout
    assert "digit accuracy during training" in proc.stdout
    assert (out / "data" / "corpus_text_document.bin").exists()


def test_resume_reaches_the_same_losses(quick_demo, tmp_path):
    out, _ = quick_demo
    data = str(out / "continued-data")
    stopped = tmp_path / "stopped"
    common = ["--data-dir", data, "--loss", "del", "--no-progress", *TRAIN]
    common += ["--init-from", str(out / "base" / "checkpoints")]  # as the demo's run

    def torchrun():
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "del_megatron.tools.cli",
            "train",
        ]

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    first = subprocess.run(
        torchrun() + ["--out-dir", str(stopped), "--stop-after", "12", *common],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((stopped / "metrics.json").read_text())["finished"] is False
    other = subprocess.run(
        torchrun() + ["--out-dir", str(stopped), "--resume", *common, "--lr", "0.00123"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert other.returncode != 0
    assert "trained with other settings (lr" in other.stderr and "-> 0.00123" in other.stderr
    second = subprocess.run(
        torchrun() + ["--out-dir", str(stopped), "--resume", *common],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = json.loads((stopped / "metrics.json").read_text())["history"]
    unstopped = json.loads((out / "del" / "metrics.json").read_text())["history"]
    assert [h["step"] for h in resumed] == list(range(1, 25))
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in unstopped], rel=1e-5)
    # the curve point scored before the stop (step 8) came back from the checkpoint
    curve = json.loads((stopped / "metrics.json").read_text())["curve"]
    unstopped_curve = json.loads((out / "del" / "metrics.json").read_text())["curve"]
    assert [p["step"] for p in curve] == [8, 16, 24]
    assert [p["train_ce"] for p in curve] == pytest.approx(
        [p["train_ce"] for p in unstopped_curve], rel=1e-5
    )


TOY = "--steps 6 --micro-batch 4 --seq-len 32 --hidden 64 --heads 4 --warmup 1 --save-interval 3"
TOY += " --curve-points 2 --curve-problems 6"
TOY_DATA = "--num-docs 400 --num-eval 12"


def test_compare_command_at_toy_size(tmp_path):
    """Continued pretraining, 2 seeds x 2 losses, through torchrun (one process: TP=2 is the
    demo test's); then a rerun that trains nothing."""
    out = tmp_path / "cmp"
    argv = [sys.executable, "-m", "del_megatron.tools.cli", "compare", "--out", str(out)]
    argv += ["--continue-from-base", "--base-steps", "8"]
    argv += ["--losses", "ce", "del@0.5", "--seeds", "3", "4", "--nproc", "1"]
    argv += [*TOY.split(), *TOY_DATA.split()]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads((out / "compare.json").read_text())
    assert record["seeds"] == [3, 4] and set(record["summary"]) == {"ce", "del@0.5"}
    for arm in ("ce", "del@0.5"):
        for seed in (3, 4):
            run = json.loads((out / f"seed-{seed}" / arm / "metrics.json").read_text())
            assert run["finished"] and run["eval_problems"] == 12
            assert run["config"]["seed"] == seed
            assert run["config"]["alpha"] == (0.5 if arm != "ce" else 0.0)
    del_digit = record["summary"]["del@0.5"]["digit_accuracy"]
    ce_digit = record["summary"]["ce"]["digit_accuracy"]
    assert del_digit["mean"] == pytest.approx(sum(del_digit["per_seed"]) / 2)
    expected = [d - c for d, c in zip(del_digit["per_seed"], ce_digit["per_seed"], strict=True)]
    assert del_digit["difference"]["mean"] == pytest.approx(sum(expected) / 2)
    assert all(se is not None and se >= 0 for se in del_digit["standard_errors"])
    curve = record["curves"]["del@0.5"]["digit_accuracy"]
    assert curve["steps"] == [3, 6]
    ends = [
        json.loads((out / f"seed-{seed}" / arm / "metrics.json").read_text())["curve"][-1]
        for arm in ("ce", "del@0.5")
        for seed in (3, 4)
    ]
    assert curve["difference"]["mean"][-1] == pytest.approx(
        (
            ends[2]["digit_accuracy"]
            + ends[3]["digit_accuracy"]
            - ends[0]["digit_accuracy"]
            - ends[1]["digit_accuracy"]
        )
        / 2
    )
    assert (out / "compare.png").stat().st_size > 10_000
    assert (out / "compare_shape.png").stat().st_size > 10_000
    assert "| del@0.5 |" in (out / "compare.md").read_text()
    bases = [json.loads((out / f"seed-{s}" / "base" / "metrics.json").read_text()) for s in (3, 4)]
    assert record["base"]["base_ce"]["per_seed"] == [b["base_ce"] for b in bases]
    change = record["summary"]["del@0.5"]["base_ce_change"]["per_seed"]
    after = record["summary"]["del@0.5"]["base_ce"]["per_seed"]
    assert change == pytest.approx([a - b["base_ce"] for a, b in zip(after, bases, strict=True)])
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished before, not run again") == 6  # 2 bases, 4 arms
    assert json.loads((out / "compare.json").read_text())["summary"] == record["summary"]
