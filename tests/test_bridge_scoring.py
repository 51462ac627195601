"""Scoring a Megatron-Bridge checkpoint (Bridge environment): examples/bridge_pretrain_del.py
trains a tiny Qwen2-class model from random weights for TRAIN_ITERS iterations, once with plain
cross-entropy and the digit telemetry (--loss ce, the A/B control arm) and once with DEL
(--loss del), validating once, after training, at the iteration it saves; then the same
command with `--load <checkpoint> --skip-train` scores each checkpoint through Bridge's own
evaluation. Every entry of the scoring run's printed validation line equals, to the printed
digits, the line the training run printed at that iteration.

The runs are the example's main() with the command's arguments, one after another in one gloo
process (Bridge's import alone takes most of a minute), their stdout read here: each run starts
after a "=== <run>" line of the worker (python -m tests.test_bridge_scoring <folder>). The data
is a Megatron indexed dataset of arithmetic text, every document different, so a sampler that
read other validation samples would print other numbers: a control run scores the CE checkpoint
with the sampler Bridge's skip_train gives by itself (the dataset's "single"), which the example's
--skip-train replaces with the shuffled one of a training run's validation. (Bridge's test loader
follows that setting in both runs: the scoring run's test line reads the test split in the
shuffled order, the training run's in the dataset's.)
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPHA = 0.5
TRAIN_ITERS = 3
ARMS = ("ce", "del")
CONTROL = "score ce, skip_train's own sampler"
DIGIT_ENTRIES = {"digit acc", "digit entropy", "digit target prob", "digit distance", "digit share"}
ENTRIES = {"ce": {"lm loss", "ce loss"} | DIGIT_ENTRIES}
ENTRIES["del"] = ENTRIES["ce"] | {"del term"}
VALIDATION = ("validation", TRAIN_ITERS)  # Bridge's validation line after training, or scoring


def model_dir(folder: str) -> str:
    return os.path.join(folder, "hf_model")


def data_prefix(folder: str) -> str:
    return os.path.join(folder, "data", "arithmetic_text_document")


def checkpoint_dir(folder: str, arm: str) -> str:
    return os.path.join(folder, f"checkpoints_{arm}")


def flags(folder: str, arm: str) -> list:
    """The training run's flags: validation once, after training (eval interval past the last
    iteration), at the iteration saved (--hf-model saves at --train-iters)."""
    args = ["--cpu", "--hf-model", model_dir(folder), "--data-path", data_prefix(folder)]
    args += ["--loss", arm, "--alpha", str(ALPHA), "--seq-length", "16", "--lr", "1e-3"]
    args += ["--global-batch-size", "4", "--micro-batch-size", "2"]
    args += ["--train-iters", str(TRAIN_ITERS), "--eval-interval", str(TRAIN_ITERS + 1)]
    return args + ["--eval-iters", "2"]


def write_model_and_data(folder: str) -> None:
    """A random tiny Qwen2 model with an offline digit-splitting Qwen2 tokenizer
    (tests/hf_workers.py), and 400 documents "x + y = s, x x y is p" with random numbers."""
    import random

    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import Qwen2ForCausalLM

    from .bridge_workers.fixtures import tiny_hf_config
    from .hf_workers import qwen2_tokenizer

    torch.manual_seed(0)
    tok = qwen2_tokenizer()
    Qwen2ForCausalLM(tiny_hf_config(vocab_size=512)).float().save_pretrained(model_dir(folder))
    tok.save_pretrained(model_dir(folder))
    rng = random.Random(0)
    os.makedirs(os.path.dirname(data_prefix(folder)))
    builder = IndexedDatasetBuilder(data_prefix(folder) + ".bin", dtype=numpy.int32)
    for _ in range(400):
        x, y = rng.randint(0, 999), rng.randint(0, 99)
        ids = tok(f"{x} + {y} = {x + y}, {x} x {y} is {x * y}", add_special_tokens=False)
        builder.add_document(torch.tensor(ids["input_ids"]), [len(ids["input_ids"])])
    builder.finalize(data_prefix(folder) + ".idx")


def worker(folder: str) -> None:
    """The runs, in one process (one gloo rank, the caller's MASTER_ADDR/PORT)."""
    import importlib.util

    import torch.distributed as dist

    from del_megatron.cpu import bridge

    bridge.activate()  # before Bridge's import
    write_model_and_data(folder)
    dist.init_process_group("gloo", rank=0, world_size=1)
    path = os.path.join(ROOT, "examples", "bridge_pretrain_del.py")
    spec = importlib.util.spec_from_file_location("bridge_pretrain_del", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def run(name: str, argv: list) -> None:
        print(f"=== {name}", flush=True)
        assert example.main(argv) == 0

    for arm in ARMS:
        run(f"train {arm}", flags(folder, arm) + ["--save", checkpoint_dir(folder, arm)])
    for arm in ARMS:
        scoring = ["--load", checkpoint_dir(folder, arm), "--skip-train"]
        run(f"score {arm}", flags(folder, arm) + scoring)
    try:  # a folder without a checkpoint: refused, not an untrained model scored
        example.main(flags(folder, "ce") + ["--load", os.path.join(folder, "none"), "--skip-train"])
    except SystemExit as refusal:
        print(f"=== refused: {refusal}", flush=True)
    # The control: skip_train as Bridge gives it, without the example's sampler.
    example.score_only = lambda cfg: setattr(cfg.validation, "skip_train", True)
    run(CONTROL, flags(folder, "ce") + ["--load", checkpoint_dir(folder, "ce"), "--skip-train"])
    dist.destroy_process_group()


def printed_evaluations(stdout: str) -> dict:
    """{run: {(set, iteration): {entry: printed value}}} from Bridge's " validation loss at
    iteration N on validation set | lm loss value: 6.035141E+00 | lm loss PPL: ... |" lines."""
    runs: dict = {}
    line_re = re.compile(r"validation loss at iteration (\d+)( on (validation|test) set)? \|(.*)")
    for line in stdout.splitlines():
        if line.startswith("=== "):
            current = runs.setdefault(line[4:], {})
            continue
        match = line_re.search(line)
        if match:
            values = {}
            for field in match.group(4).split("|"):
                name, sep, value = field.strip().rpartition(" value: ")
                if sep:
                    values[name] = value
            where = (match.group(3) or "in training", int(match.group(1)))
            assert where not in current, f"two evaluations at {where}"
            current[where] = values
    return runs


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    from del_megatron.cpu.ports import free_port

    folder = tmp_path_factory.mktemp("scoring")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "tests.test_bridge_scoring", str(folder)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    runs = printed_evaluations(proc.stdout)
    (folder / "runs.log").write_text(proc.stdout)
    numbers = {
        arm: {
            which: {k: float(v) for k, v in runs[f"{which} {arm}"][VALIDATION].items()}
            for which in ("train", "score")
        }
        for arm in ARMS
    }
    numbers[CONTROL] = {k: float(v) for k, v in runs[CONTROL][VALIDATION].items()}
    out = folder / "bridge_scoring.json"
    out.write_text(json.dumps(numbers, indent=1))
    print(f"\ntrained vs scored validation numbers: {out}")
    return {"runs": runs, "folder": folder}


@pytest.mark.parametrize("arm", ARMS)
def test_scoring_prints_the_validation_the_run_logged_at_that_iteration(scored, arm):
    """--load <checkpoint> --skip-train: Bridge's validation at the checkpoint's iteration, every
    entry the digits the training run printed for its validation there (its only one)."""
    trained, scoring = scored["runs"][f"train {arm}"], scored["runs"][f"score {arm}"]
    assert set(trained) == {VALIDATION, ("test", TRAIN_ITERS)}, trained.keys()
    assert VALIDATION in scoring, scoring.keys()
    assert set(trained[VALIDATION]) == ENTRIES[arm]  # no "digit tokens" or weight in evaluation
    assert scoring[VALIDATION] == trained[VALIDATION]


def test_digit_entries_hold_numbers_of_each_arms_own_model(scored):
    """The entries are numbers in their ranges, and each checkpoint scored its own: the CE and
    DEL models print different losses on the same batches."""
    runs = scored["runs"]
    lines = {
        arm: {k: float(v) for k, v in runs[f"score {arm}"][VALIDATION].items()} for arm in ARMS
    }
    for line in lines.values():
        assert 0 <= line["digit acc"] <= 1 and 0 < line["digit target prob"] < 1
        assert 0 < line["digit entropy"] <= 2.31  # at most ln 10
        assert 0 < line["digit share"] < 1 and line["digit distance"] >= 0
        assert line["ce loss"] > 0
    assert lines["del"]["del term"] > 0
    assert lines["ce"]["digit share"] == lines["del"]["digit share"]  # the same targets
    assert lines["ce"]["ce loss"] != lines["del"]["ce loss"]


def test_skip_trains_own_sampler_reads_other_validation_batches(scored):
    """Why the example sets the shuffled validation sampler: with the one Bridge's skip_train
    takes from the dataset config ("single", which the test split has in training too), the
    same checkpoint prints other validation numbers (and the training run's test line)."""
    runs = scored["runs"]
    control, trained = runs[CONTROL], runs["train ce"]
    assert set(control[VALIDATION]) == set(trained[VALIDATION])
    assert control[VALIDATION]["ce loss"] != trained[VALIDATION]["ce loss"]
    test_set = ("test", TRAIN_ITERS)
    assert control[test_set] == trained[test_set]


def test_a_folder_without_a_checkpoint_is_refused(scored):
    refused = [run for run in scored["runs"] if run.startswith("refused: ")]
    assert len(refused) == 1 and "--skip-train: no checkpoint in" in refused[0], refused


if __name__ == "__main__":
    worker(sys.argv[1])
