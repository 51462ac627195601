"""An A/B on Megatron-LM's own loop: a stock run, the control arm (`--numerical-loss ce`) and
the DEL arm from one command line, each checkpoint scored afterwards, and refusals in one line.

At each environment's newest tag (core_v0.16.1, core_v0.19.0), through the drop-in (the patched
script reaches the same plugin calls; the refusals run both):
- the control arm trains stock pretrain_gpt.py's loss (TensorBoard's float32 `lm loss`, every
  step) and reports every entry of the DEL arm under the same name, but the term and its weight;
- the console's digit entries are means over the digit targets of each log interval
  (--log-interval 5 over a stream where some steps have none), TensorBoard's the step's own;
- `--load CKPT --skip-train` scores each arm's checkpoint: the validation and test lines equal
  the ones the run itself printed for that checkpoint;
- a refusal prints one line on rank 0 and no traceback on any rank (torchrun's own report of a
  failed process aside, which the workers' own stderr files leave out).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from del_megatron.megatron.refusals import EXIT_CODE

from .conftest import VARIANTS
from .megatron_lm import (
    DIGIT_IDS,
    DIGIT_KEYED,
    MOCK_DATA,
    TINY_GPT,
    console_value,
    cpu_environment,
    log_intervals,
    tensorboard_scalars,
    validation_lines,
)
from .megatron_lm import tags_for_this_environment as _tags
from .test_pretrain_gpt import CE_ARM, PRINTED, TELEMETRY, TP2

newest_tag = pytest.mark.parametrize("tag", _tags()[-1:])
DROP_IN = "drop-in"
IDS = ["--del-digit-token-ids", *DIGIT_IDS]
# The validation pass at iteration 10 reads the validation set's first batches, as a scoring
# run's does (--skip-train starts it at 0); the one after training reads the next ones.
ARM = (
    TINY_GPT
    + MOCK_DATA
    + TP2
    + ["--log-interval", "5", "--eval-interval", "10", "--eval-iters", "2"]
)
ARMS = {
    "stock": [],
    "ce": ["--numerical-loss", "ce", *IDS, "--del-alpha", "0.3"],  # the weight flag: unused
    "del": ["--numerical-loss", "del", *IDS, "--del-alpha", "0.3"],
}
UNUSED = "del_megatron: --del-alpha unused: --numerical-loss ce trains Megatron's cross-entropy"


def arm(trainer, name: str):
    """One arm of the A/B, with TensorBoard and (but stock) a torch checkpoint at 10."""
    saving = [] if name == "stock" else ["--save", str(trainer.path(f"ckpt-{name}"))]
    saving += ["--save-interval", "10", "--ckpt-format", "torch"] if saving else []
    flags = ARM + ARMS[name] + ["--tensorboard-dir", str(trainer.path(f"tb-{name}"))] + saving
    run = trainer.run(f"arm-{name}", flags)
    assert run.returncode == 0 and sorted(run.iterations) == [1, 5, 10], run.log[-3000:]
    return run, tensorboard_scalars(trainer.path(f"tb-{name}"))


def tags_of(scalars: dict) -> set:
    return {tag for tag in scalars if not tag.endswith(" vs samples")}


@newest_tag
def test_the_control_arm_trains_stock_ce_and_reports_the_del_arms_entries(trainers, tag):
    trainer = trainers(tag, DROP_IN)
    (stock, stock_tb), (ce, ce_tb), (numerical, del_tb) = (arm(trainer, n) for n in ARMS)
    # The same tags as the DEL arm but the term and its weight; stock has none of them.
    term = {"del term", "del weight", "del term validation"}
    assert tags_of(del_tb) - tags_of(ce_tb) == term, tags_of(ce_tb)
    assert set(CE_ARM) <= tags_of(ce_tb) and not set(TELEMETRY) & tags_of(stock_tb)
    # Stock pretrain_gpt.py's loss, step by step, in float32.
    stock_loss, ce_loss = dict(stock_tb["lm loss"]), dict(ce_tb["lm loss"])
    assert sorted(ce_loss) == sorted(stock_loss) == list(range(1, 11))
    worst = max(abs(ce_loss[s] / stock_loss[s] - 1) for s in stock_loss)
    assert worst <= 1e-6, worst
    assert dict(ce_tb["ce loss"]) == ce_loss
    assert ce.log.count(UNUSED) == 1, ce.log[-3000:]
    (trainer.workdir / "ab-arms.json").write_text(
        json.dumps(
            {
                "tags": {"stock": sorted(tags_of(stock_tb)), "ce": sorted(tags_of(ce_tb))},
                "tags_del": sorted(tags_of(del_tb)),
                "lm_loss": {"stock": stock_loss, "ce": ce_loss},
                "largest_relative_difference": worst,
            },
            indent=1,
        )
    )


@newest_tag
@pytest.mark.parametrize("name", ["ce", "del"])
def test_console_means_are_over_digit_targets_and_tensorboard_has_each_steps(trainers, tag, name):
    trainer = trainers(tag, DROP_IN)
    run, scalars = arm(trainer, name)
    tokens = dict(scalars["digit tokens"])
    empty = [step for step, value in tokens.items() if value < 1e-6]
    assert 0 < len(empty) < len(tokens), tokens  # teeth: some steps have no digit target
    intervals = log_intervals(list(run.iterations))
    keys = [key for key in DIGIT_KEYED if key in scalars]
    for key in keys:
        assert sorted(dict(scalars[key])) == sorted(set(tokens) - set(empty)), key
        for line, steps in intervals.items():
            want = console_value(key, steps, scalars)
            got = run.iterations[line][key]
            assert got == pytest.approx(want, rel=PRINTED, abs=1e-19), (key, line)
    # Teeth: an interval with an empty step, where the mean over iterations would differ.
    entropy = dict(scalars["digit entropy"])
    line = next(line for line, steps in intervals.items() if set(steps) & set(empty))
    over_steps = sum(entropy.get(step, 0.0) for step in intervals[line]) / len(intervals[line])
    assert run.iterations[line]["digit entropy"] != pytest.approx(over_steps, rel=1e-3)


@newest_tag
@pytest.mark.parametrize("name", ["ce", "del"])
def test_a_checkpoint_is_scored_as_the_run_validated_it(trainers, tag, name):
    """`--load CKPT --skip-train` with the arm's own flags prints the validation and test lines
    the run printed for the same weights and data: its validation at iteration 10 (the first
    batches of the validation set) and its test line."""
    trainer = trainers(tag, DROP_IN)
    run, _ = arm(trainer, name)
    ckpt = str(trainer.path(f"ckpt-{name}"))
    scored = trainer.run(
        f"score-{name}",
        ARM + ARMS[name] + ["--load", ckpt, "--skip-train", "--ckpt-format", "torch"],
    )
    assert scored.returncode == 0 and not scored.iterations, scored.log[-3000:]
    trained = validation_lines(run.log)  # at 10: in training, after it (validation, test)
    lines = validation_lines(scored.log)  # validation, test
    assert [i for i, _, _ in trained] == [10, 10, 10] and [i for i, _, _ in lines] == [10, 10]
    for (_, want, _), (_, got, _) in zip([trained[0], trained[2]], lines, strict=True):
        assert set(got) == set(want) and {"digit acc", "digit entropy"} <= set(got), got
        for key, value in want.items():
            assert got[key] == value, (key, got, want)
    (trainer.workdir / f"scored-{name}.json").write_text(
        json.dumps({"trained": trained, "scored": lines}, indent=1)
    )


def run_refused(trainer, name: str, flags) -> tuple:
    """torchrun of 2 ranks with each worker's stdout and stderr in its own file (torchrun
    --redirects 3): the exit code, the launcher's output, {rank: stdout} and {rank: stderr}."""
    logs = trainer.path(f"refused-{name}")
    first, *rest = trainer.launch
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--log-dir", str(logs), "--redirects", "3", first, *rest, *flags,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=trainer.tree, env=cpu_environment(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip

    def by_rank(stream: str) -> dict:
        return {int(f.parent.name): f.read_text() for f in Path(logs).rglob(f"{stream}.log")}

    return done.returncode, done.stdout + done.stderr, by_rank("stdout"), by_rank("stderr")


# case: (flags, what the one refusal line names)
REFUSED = {
    # decided by the flags alone: while Megatron-LM parses them
    "forgotten-loss": (["--del-alpha", "0.3"], ("--del-alpha set without --numerical-loss",)),
    # decided with the run's tokenizer (mock data's NullTokenizer has no text to read digit
    # ids from): before the model is built
    "no-digit-ids": (
        ["--numerical-loss", "del"],
        ("NullTokenizer has no text", "--del-digit-token-ids"),
    ),
}


@newest_tag
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refusal_is_one_line_on_rank_0_and_no_traceback(trainers, tag, variant, case):
    trainer = trainers(tag, variant)
    flags, named = REFUSED[case]
    returncode, launcher, stdout, stderr = run_refused(trainer, case, TINY_GPT + MOCK_DATA + flags)
    assert returncode != 0 and f"exitcode: {EXIT_CODE}" in launcher, launcher[-3000:]
    assert sorted(stderr) == sorted(stdout) == [0, 1], stderr
    assert not any("iteration        1/" in text for text in stdout.values())
    refusals = [
        line for line in stderr[0].splitlines() if line.startswith("del_megatron: refused:")
    ]
    assert len(refusals) == 1, stderr[0][-3000:]
    assert all(phrase in refusals[0] for phrase in named), refusals[0]
    for rank, text in stderr.items():
        assert "Traceback" not in text, (rank, text[-3000:])
    assert "del_megatron: refused" not in stderr[1]
    if case == "forgotten-loss":  # before Megatron-LM prints its arguments
        assert "------------------------ arguments ------------------------" not in stdout[0]
