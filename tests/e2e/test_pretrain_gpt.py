"""Megatron-LM's own pretrain() loop with the numerical losses, on every release we claim.

The tests run Megatron-LM's patched pretrain_gpt.py and the drop-in (from an unpatched tree:
`-m del_megatron.megatron.pretrain_gpt_del` of the installed package at the environment's
newest tag, examples/pretrain_gpt_del.py by path at the others; conftest.drop_in_launch) under
torchrun on CPU (gloo, 2 ranks, TP=2 unless said), and assert on the values Megatron-LM printed
in its own log (and wrote to TensorBoard, for the drop-in's digit run and the GPU flag set). The
two differ only in how they reach the plugin (a patch, or a module that wraps pretrain_gpt's
functions): both run the composition, telemetry, refusal and --help tests, and the drop-in must
print every value the patched script prints, on every line (also when it is launched from the
patched tree, as the Docker image allows, with the digit reduction). Resume, tensor/sequence
parallel and tokenizer runs go through the same plugin calls and run once, on the patched
script.

Every tag runs the composition, telemetry, drop-in and logits-free checks (TP 2 and sequence
parallel). Resume, TP 1 against TP 2, and the checks that stop before training or train with
another tokenizer (--help, the refusals, the tokenizer's digit ids) run at each environment's
newest tag, core_v0.16.1 and core_v0.19.0: between those two the plugin's calls into
checkpointing, parallel_state, parse_and_validate_args and build_tokenizer are the same code,
and core_v0.18.0's tokenizer classes differ from core_v0.19.0's only in special-token lookups.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from del_megatron.kernels.linear import NOT_PROPORTIONAL
from del_megatron.megatron.logits_free import core_supports

from .conftest import DROP_IN_OVER_PATCH, SCRIPT, VARIANTS
from .megatron_lm import (
    DIGIT_IDS,
    DIGIT_KEYED,
    MOCK_DATA,
    TINY_GPT,
    console_value,
    cpu_environment,
    is_finite,
    log_intervals,
    steps_with_digits,
    tensorboard_scalars,
    validation_lines,
)
from .megatron_lm import tags_for_this_environment as _tags

ALPHA = 0.01
TELEMETRY = ("ce loss", *DIGIT_KEYED, "digit tokens", "digit share")
# What a validation line reports of them (a validation pass has no step and no weight).
VALIDATED = tuple(key for key in TELEMETRY if key not in ("del weight", "digit tokens"))
# What the control arm (--numerical-loss ce) reports: all but the term and its weight.
CE_ARM = tuple(key for key in TELEMETRY if not key.startswith("del "))
# Megatron-LM prints 7 significant digits.
PRINTED = 2e-6

TP2 = ["--tensor-model-parallel-size", "2"]
DEL = ["--numerical-loss", "del", "--del-alpha", str(ALPHA), "--del-digit-token-ids", *DIGIT_IDS]
DIGIT = ["--del-reduction", "digit"]
# The mock data's digit share is about 0.02 where it has digits: the token run's given share is
# off by far more than 2x, so its log warns (once) that the weight is not alpha.
GIVEN_SHARE = 0.5
TOKEN = ["--del-reduction", "token", "--del-digit-share", str(GIVEN_SHARE)]
SHARE_WARNING = f"--del-digit-share is {GIVEN_SHARE:g}, but "
PATCHED = "patched"
# Megatron-LM's startup timing report: printed when the script registered its start-up times.
STARTUP_REPORT = "[after library-setup] datetime:"


def tensorboard(trainer, name: str) -> list:
    """Megatron-LM's TensorBoard flags, writing to the folder `tb-<name>` beside the runs."""
    folder = str(trainer.path(f"tb-{name}"))
    return ["--tensorboard-dir", folder, "--log-validation-ppl-to-tensorboard"]


def base_runs(trainer):
    """The shared runs: CE; DEL token; DEL digit. The patched script's DEL runs save at 5 (token:
    torch_dist, digit: torch) for the resume test; the drop-in's save nothing (a torch_dist save
    re-imports the script in a writer process: ~15 s a run that no test reads), and its digit
    run writes TensorBoard events (the TensorBoard test)."""
    common = TINY_GPT + MOCK_DATA + TP2

    def saving(fmt: str):
        flags = ["--save", str(trainer.path(f"ckpt-{fmt}")), "--save-interval", "5"]
        return flags + ["--ckpt-format", fmt] if trainer.variant == SCRIPT else []

    writing = tensorboard(trainer, "del-digit") if trainer.variant == "drop-in" else []
    ce = trainer.run("ce", common + ["--numerical-loss", "ce", "--del-digit-token-ids", *DIGIT_IDS])
    token = trainer.run("del-token", common + DEL + TOKEN + saving("torch_dist"))
    digit = trainer.run("del-digit", common + DEL + DIGIT + saving("torch") + writing)
    for run in (ce, token, digit):
        assert run.returncode == 0 and len(run.iterations) == 10, run.log[-3000:]
    return ce, token, digit


parametrize = pytest.mark.parametrize
tags = parametrize("tag", _tags())
newest_tag = parametrize("tag", _tags()[-1:])
variants = parametrize("variant", VARIANTS)
# Both ways in against each other: where a patch applies (every tag; not dev's head).
both_ways = parametrize("tag", _tags() if PATCHED in VARIANTS else [])
newest_both_ways = parametrize("tag", _tags()[-1:] if PATCHED in VARIANTS else [])


@tags
@variants
def test_iteration_one_is_ce_plus_alpha_times_the_term(trainers, tag, variant):
    ce, token, digit = base_runs(trainers(tag, variant))
    first_ce, first_token, first_digit = ce.iterations[1], token.iterations[1], digit.iterations[1]
    # --numerical-loss ce: the control arm reports the digit entries beside Megatron's CE
    assert set(CE_ARM) <= set(first_ce) and not {"del term", "del weight"} & set(first_ce)
    assert first_ce["ce loss"] == first_ce["lm loss"]
    assert first_token["digit tokens"] > 0
    # The pure CE that DEL runs report equals the CE run's loss: same weights, same batch.
    assert first_token["ce loss"] == pytest.approx(first_ce["lm loss"], rel=PRINTED)
    assert first_digit["ce loss"] == pytest.approx(first_ce["lm loss"], rel=PRINTED)
    # token: each digit's term weighs alpha / S, so the mean term weighs alpha x share / S
    weight = ALPHA / GIVEN_SHARE * first_token["digit share"]
    assert first_token["del weight"] == pytest.approx(weight, rel=PRINTED)
    expected = first_token["ce loss"] + weight * first_token["del term"]
    assert first_token["lm loss"] == pytest.approx(expected, rel=PRINTED)
    # digit (the default): the mean term weighs alpha
    assert first_digit["del weight"] == pytest.approx(ALPHA, rel=PRINTED)
    expected = first_digit["ce loss"] + ALPHA * first_digit["del term"]
    assert first_digit["lm loss"] == pytest.approx(expected, rel=PRINTED)
    assert first_digit["lm loss"] != pytest.approx(first_token["lm loss"], rel=PRINTED)


@both_ways
def test_the_drop_in_prints_what_the_patched_script_prints(trainers, tag):
    patched, drop_in = base_runs(trainers(tag, PATCHED)), base_runs(trainers(tag, "drop-in"))
    for ours, theirs in zip(drop_in, patched, strict=True):
        assert ours.iterations == theirs.iterations
        assert ours.validation == theirs.validation
        # the drop-in registers its start-up times, as pretrain_gpt.py's main does
        assert STARTUP_REPORT in theirs.log and STARTUP_REPORT in ours.log


@newest_both_ways
def test_the_drop_in_from_a_patched_tree_prints_what_the_patched_script_prints(trainers, tag):
    """The drop-in launched from a tree our patch already changed (the Docker image's): each
    wrapper acts once, so with the step-wide digit reduction it trains the 10 iterations the
    patched script trains, to the last printed digit."""
    _, _, patched = base_runs(trainers(tag, PATCHED))
    stacked = trainers(tag, DROP_IN_OVER_PATCH).run(
        "del-digit", TINY_GPT + MOCK_DATA + TP2 + DEL + DIGIT
    )
    assert stacked.returncode == 0 and len(stacked.iterations) == 10, stacked.log[-3000:]
    assert stacked.iterations == patched.iterations
    assert stacked.validation == patched.validation


@tags
@variants
def test_a_given_digit_share_far_from_the_measured_one_is_warned_about_once(trainers, tag, variant):
    _, token, digit = base_runs(trainers(tag, variant))
    assert token.log.count(SHARE_WARNING) == 1, token.log[-3000:]
    assert "Pass --del-digit-share" in token.log
    assert SHARE_WARNING not in digit.log


@tags
@variants
def test_telemetry_is_present_and_finite_on_every_line(trainers, tag, variant):
    _, token, digit = base_runs(trainers(tag, variant))
    for run in (token, digit):
        for iteration, entries in run.iterations.items():
            for key in TELEMETRY:
                assert key in entries and is_finite(entries[key]), (iteration, entries)
        # Teeth: some steps have no digit target (their digit entries are 0, not NaN).
        assert min(entries["digit tokens"] for entries in run.iterations.values()) < 1e-6
        assert sorted(run.validation) == [5, 10]
        for iteration, entries in run.validation.items():
            for key in ("lm loss",) + VALIDATED:
                assert key in entries and is_finite(entries[key]), (iteration, entries)
            # a validation pass has no step: no step's digit tokens, no step's weight
            assert not {"digit tokens", "del weight"} & set(entries), entries


def assert_tensorboard_holds_the_logged_values(run, scalars: dict, keys) -> None:
    """TensorBoard against the console of the same run, for each report entry in `keys`:
    - training: one event a step under the entry's own name, the step's own sum / count (for
      the entries over digit targets, DIGIT_KEYED: one event a step that has digit targets),
      where the console prints the mean over the steps since its last line (console_value:
      the DIGIT_KEYED ones weighted by each step's digit targets);
    - validation: one event per validation line the console printed (every --eval-interval,
      then after training the validation and the test set), in order, under `<entry>
      validation` with the line's iteration as step, and with --log-validation-ppl-to-tensorboard
      its PPL (exp of the value, capped at e^20) under `<entry> validation ppl`."""
    lines = validation_lines(run.log)
    assert [iteration for iteration, _, _ in lines][:2] == [5, 10], lines
    with_digits = steps_with_digits("digit acc", scalars)
    assert 0 < len(with_digits) < len(run.iterations)  # teeth: some steps have none
    intervals = log_intervals(list(run.iterations))
    for key in keys:
        events = dict(scalars[key])
        held = steps_with_digits(key, scalars)
        assert len(events) == len(scalars[key]) and sorted(events) == held, key
        for step, entries in run.iterations.items():
            want = console_value(key, intervals[step], scalars)
            tolerance = PRINTED * abs(want) + 1e-19  # core <= 0.17 prints 0 as 1e-20
            assert entries[key] == pytest.approx(want, abs=tolerance), (key, step)
        if key in ("del weight", "digit tokens"):  # training only
            continue
        values, ppls = scalars[f"{key} validation"], scalars[f"{key} validation ppl"]
        assert (
            [step for step, _ in values]
            == [step for step, _ in ppls]
            == [iteration for iteration, _, _ in lines]
        ), key
        for (_, value), (_, ppl), (iteration, printed, printed_ppl) in zip(
            values, ppls, lines, strict=True
        ):
            assert value == pytest.approx(printed[key], rel=PRINTED, abs=1e-12), (key, iteration)
            assert ppl == pytest.approx(printed_ppl[key], rel=PRINTED), (key, iteration)


@tags
def test_tensorboard_gets_each_steps_telemetry_and_every_validation(trainers, tag):
    """The drop-in's DEL digit run with --tensorboard-dir and --log-validation-ppl-to-tensorboard:
    its event file, read with TensorBoard's own reader, holds every numerical-loss entry
    (`digit entropy` beside `digit acc`) for every training step and validation line, with the
    values the console printed (assert_tensorboard_holds_the_logged_values)."""
    _, _, digit = base_runs(trainers(tag, "drop-in"))
    scalars = tensorboard_scalars(trainers(tag, "drop-in").path("tb-del-digit"))
    assert_tensorboard_holds_the_logged_values(digit, scalars, ("lm loss",) + TELEMETRY)
    # Teeth: the digit entries are real values, and no validation line has a step's entries.
    entropy = [value for _, value in scalars["digit entropy"]]
    assert min(entropy) > 0.1, entropy
    assert "digit tokens validation" not in scalars and "del weight validation" not in scalars


@newest_tag
@parametrize("fmt", ["torch", "torch_dist"])
def test_resume_from_iteration_5_repeats_iterations_6_to_10(trainers, tag, fmt):
    trainer = trainers(tag, SCRIPT)
    _, token, digit = base_runs(trainer)
    uninterrupted, flags = (token, TOKEN) if fmt == "torch_dist" else (digit, DIGIT)
    resumed = trainer.run(
        f"resume-{fmt}",
        TINY_GPT + MOCK_DATA + TP2 + DEL + flags
        + ["--load", str(trainer.path(f"ckpt-{fmt}")), "--ckpt-step", "5", "--ckpt-format", fmt],
    )  # fmt: skip
    assert_resumed_repeats(uninterrupted, resumed, ("lm loss", "ce loss", "del term", "grad norm"))


def assert_resumed_repeats(uninterrupted, resumed, keys) -> None:
    """A run resumed from iteration 5 prints iterations 6 to 10 of the uninterrupted run."""
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert sorted(resumed.iterations) == list(range(6, 11)), resumed.log[-3000:]
    for key in keys:
        before, after = uninterrupted.series(key, 6, 10), resumed.series(key, 6, 10)
        assert after[0] == before[0] and after[2:] == before[2:], key
        # Megatron-LM does not reset its log accumulators after a run's first iteration, so
        # the resumed run's line 7 (like every run's line 2) is the mean of its steps 6 and 7
        # (over their digit targets for the digit entries).
        weights = [1.0, 1.0]
        if key in DIGIT_KEYED:
            weights = uninterrupted.series("digit tokens", 6, 7)
            weights = [w if w > 1e-6 else 0.0 for w in weights]
        if key != "grad norm":
            want = (before[0] * weights[0] + before[1] * weights[1]) / max(sum(weights), 1e-30)
            assert after[1] == pytest.approx(want, rel=PRINTED), key


# The same initial weights need the same padded vocab: 1023 ids (core 0.16's NullTokenizer adds
# one for EOD) pad to 1024 at TP 1 and 2, where 1025 would pad to 1152 and 1280. Dropout is off:
# its masks depend on the tensor- and sequence-parallel layout.
NO_DROPOUT = TINY_GPT + MOCK_DATA + ["--vocab-size", "1023"] + DEL
NO_DROPOUT += ["--hidden-dropout", "0", "--attention-dropout", "0"]
SP = ["--sequence-parallel"]
LOGITS_FREE = ["--del-logits-free"]


@newest_tag
def test_tensor_parallel_1_and_2_and_sequence_parallel_agree(trainers, tag):
    trainer = trainers(tag, SCRIPT)
    common = NO_DROPOUT
    tp2 = trainer.run("del-tp2-nodropout", common + TP2)
    tp1 = trainer.run("del-tp1-nodropout", common + ["--tensor-model-parallel-size", "1"], 1)
    sp = trainer.run("del-tp2-sp-nodropout", common + TP2 + SP)
    for run in (tp2, tp1, sp):
        assert run.returncode == 0 and len(run.iterations) == 10, run.log[-3000:]
    for run in (tp1, sp):
        for key in ("lm loss", "ce loss", "del term"):
            assert run.series(key) == pytest.approx(tp2.series(key), rel=1e-5), key


def _assert_logits_free_refused(trainer) -> None:
    run = trainer.run("logits-free-refused", NO_DROPOUT + TP2 + LOGITS_FREE)
    assert run.returncode != 0 and not run.iterations, run.log[-3000:]
    assert "--del-logits-free needs megatron-core >= 0.18" in run.log, run.log[-3000:]


@tags
def test_logits_free_runs_equal_the_materialised_runs(trainers, tag):
    """--del-logits-free at TP=2, with and without sequence parallelism (at the environment's
    newest tag; at an older one without): every logged value of the 10 iterations equals the
    materialised run's (the materialised SP run equals the TP 2 one here too). Without SP the
    weight gradient takes the "auto" route ("forward" here: the run is in fp32), with SP the
    "backward" one. Cores without GPTModel's output_processor stop before training, naming the
    version."""
    trainer = trainers(tag, SCRIPT)
    if not core_supports():
        _assert_logits_free_refused(trainer)
        return
    runs = {}
    layouts = [("tp2", TP2, [])]  # at an older tag, the "auto" route alone
    if tag == _tags()[-1]:
        layouts.append(("tp2-sp", TP2 + SP, ["backward"]))
    for name, layout, route in layouts:
        materialised = runs[name] = trainer.run(f"del-{name}-nodropout", NO_DROPOUT + layout)
        flags = NO_DROPOUT + layout + LOGITS_FREE + route
        logits_free = trainer.run(f"del-{name}-logits-free", flags)
        for run in (materialised, logits_free):
            assert run.returncode == 0 and len(run.iterations) == 10, run.log[-3000:]
        # Megatron's loss_func reduces the loss as sum(loss * loss_mask): on the forward route
        # the gradients are formed in forward, never recomputed
        assert NOT_PROPORTIONAL not in logits_free.log
        taken = route[0] if route else "forward"
        assert f"the output layer's gradients take the '{taken}' route" in logits_free.log, taken
        for key in ("lm loss", "ce loss", "del term", "digit acc", "grad norm"):
            want = materialised.series(key)
            assert logits_free.series(key) == pytest.approx(want, rel=1e-5, abs=1e-7), key
        assert sorted(logits_free.validation) == sorted(materialised.validation) == [5, 10]
        for iteration, entries in materialised.validation.items():
            got = logits_free.validation[iteration]
            assert got == pytest.approx(entries, rel=1e-5, abs=1e-7), iteration
    if "tp2-sp" in runs:  # the TP test's SP check, once more
        for key in ("lm loss", "ce loss", "del term"):
            want = runs["tp2"].series(key)
            assert runs["tp2-sp"].series(key) == pytest.approx(want, rel=1e-5), key


# The flags GPU users train with, on 2 CPU ranks as DP 2: bf16 (the masked-softmax fusion is
# a CUDA kernel), the distributed optimizer with overlapped gradient reduce-scatter and
# parameter all-gather, DDP buckets small enough that the untied output weight fills one of its
# own, MTP (which needs RoPE). Gradient-accumulation fusion stays off (apex's CUDA extension);
# its protocol is tested in tests/test_megatron_ddp.py, with a stand-in for the extension.
GPU_FLAGS = TINY_GPT + MOCK_DATA + DEL + ["--bf16", "--no-masked-softmax-fusion"]
GPU_FLAGS += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
GPU_FLAGS += ["--ddp-bucket-size", "1000", "--untie-embeddings-and-output-weights"]
GPU_FLAGS += ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
BF16_EPS = 2**-8
# The MTP head's entries beside Megatron-LM's own `mtp_1 loss`.
MTP_TELEMETRY = ("mtp_1 digit acc", "mtp_1 digit entropy")


@newest_tag
def test_the_gpu_flag_set_trains_logits_free_as_it_trains_materialised(trainers, tag):
    """GPU_FLAGS with and without --del-logits-free through Megatron-LM's own pretrain(): both
    train 10 iterations, and every value Megatron-LM logs (lm loss, the DEL telemetry, mtp_1
    loss, grad norm, ..., every iteration and both validations) agrees. The MTP head reports its
    own `mtp_1 digit acc` and `mtp_1 digit entropy`, in training and validation, and the
    materialised run's TensorBoard events hold them as its console does.

    Tolerance. Iteration 1 starts from the same weights on the same batch: every loss and
    telemetry value to Megatron-LM's 7 printed digits. From iteration 2 on, to one bf16 epsilon
    (2^-8) relative: the run is in bf16, and the two paths round the same bf16 gradients at
    different points (the logits-free weight gradient sums chunks or vocab tiles in fp32, the
    materialised GEMM rounds once), so the weights differ by bf16 roundings after the first
    update; the grad norm, a sum of those gradients, likewise from iteration 1. The digit
    accuracy may differ by one digit target (an argmax between two digit logits within bf16
    rounding of each other; 10 or more digit targets a step here)."""
    trainer = trainers(tag, SCRIPT)
    if not core_supports():
        _assert_logits_free_refused(trainer)
        return
    materialised = trainer.run("gpu-flags", GPU_FLAGS + tensorboard(trainer, "gpu-flags"))
    logits_free = trainer.run("gpu-flags-logits-free", GPU_FLAGS + LOGITS_FREE)
    for run in (materialised, logits_free):
        assert run.returncode == 0 and len(run.iterations) == 10, run.log[-3000:]
    assert "mtp_1 loss" in materialised.iterations[1]
    # The MTP head's own digit entries, training and validation, in the log and TensorBoard.
    for entries in [*materialised.iterations.values(), *materialised.validation.values()]:
        for key in MTP_TELEMETRY:
            assert key in entries and is_finite(entries[key]), (key, entries)
    assert max(e["mtp_1 digit entropy"] for e in materialised.iterations.values()) > 0.1
    scalars = tensorboard_scalars(trainer.path("tb-gpu-flags"))
    assert_tensorboard_holds_the_logged_values(materialised, scalars, MTP_TELEMETRY)
    steps = [(i, materialised.iterations[i], logits_free.iterations[i]) for i in range(1, 11)]
    steps += [(f"validation {i}", want, logits_free.validation[i]) for i, want in
              materialised.validation.items()]  # fmt: skip
    assert sorted(materialised.validation) == sorted(logits_free.validation) == [5, 10]
    for step, want, got in steps:
        assert got.keys() == want.keys(), step
        for key, value in want.items():
            exact = step == 1 and key != "grad norm"
            tolerance = dict(rel=PRINTED) if exact else dict(rel=BF16_EPS, abs=1e-6)
            if key.endswith("digit acc") and not exact:
                tolerance = dict(abs=0.1 + 1e-6)
            assert got[key] == pytest.approx(value, **tolerance), (step, key, got[key], value)


# Large enough for the logits to show in the peak memory: 2048 tokens a micro-batch x 65536
# vocab columns a rank = 512 MiB of fp32 logits a copy; the logits-free run's chunks are 256 MiB.
BIG_VOCAB = TINY_GPT + MOCK_DATA + DEL + ["--vocab-size", "131071", "--seq-length", "512"]
BIG_VOCAB += ["--max-position-embeddings", "512", "--micro-batch-size", "4"]
BIG_VOCAB += ["--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "0"]


@newest_tag
def test_logits_free_peak_memory_is_below_the_materialised_runs(trainers, tag):
    """The same 2 steps at TP=2, peak RSS of the largest rank: the logits-free run's is lower
    by at least one copy of the logits less one of its chunks. (The run is in fp32, so the
    materialised loss takes its gradient in place, over its one copy of the logits, as
    Megatron's CE does; the logits-free run holds a chunk and its gradient at a time.) Both
    figures go to memory.json beside the runs."""
    trainer = trainers(tag, SCRIPT)
    if not core_supports():
        _assert_logits_free_refused(trainer)
        return
    materialised = trainer.run("big-vocab", BIG_VOCAB + TP2)
    logits_free = trainer.run("big-vocab-logits-free", BIG_VOCAB + TP2 + LOGITS_FREE)
    for run in (materialised, logits_free):
        assert run.returncode == 0 and len(run.iterations) == 2, run.log[-3000:]
        assert run.peak_rss_mib is not None, run.log[-3000:]
    assert logits_free.series("lm loss", 1, 2) == pytest.approx(
        materialised.series("lm loss", 1, 2), rel=1e-5
    )
    figures = {
        "materialised_peak_rss_mib": materialised.peak_rss_mib,
        "logits_free_peak_rss_mib": logits_free.peak_rss_mib,
        "logits_copy_mib": 2048 * 65536 * 4 / 2**20,
        "logits_free_chunk_mib": 256,
    }
    (trainer.workdir / "memory.json").write_text(json.dumps(figures, indent=1))
    saved = materialised.peak_rss_mib - logits_free.peak_rss_mib
    assert saved >= figures["logits_copy_mib"] - figures["logits_free_chunk_mib"], figures


@newest_tag
def test_digit_ids_come_from_the_runs_tokenizer_and_merging_ones_are_refused(
    trainers, sentencepiece_models, tag
):
    trainer = trainers(tag, SCRIPT)
    common = TINY_GPT + ["--mock-data", "--tokenizer-type", "SentencePieceTokenizer"]
    common = common + ["--numerical-loss", "del", "--train-iters", "2", "--eval-iters", "0"]
    merging = trainer.run(
        "merging-tokenizer", common + ["--tokenizer-model", sentencepiece_models["merging"]], 1
    )
    assert merging.returncode != 0 and not merging.iterations
    assert "merges digits" in merging.log and "--del-allow-multi-digit-tokens" in merging.log
    splitting = trainer.run(
        "splitting-tokenizer", common + ["--tokenizer-model", sentencepiece_models["split"]], 1
    )
    assert splitting.returncode == 0 and sorted(splitting.iterations) == [1, 2], splitting.log
    assert all(is_finite(e["del term"]) for e in splitting.iterations.values())


@newest_tag
@variants
def test_help_lists_the_del_flags(trainers, tag, variant):
    trainer = trainers(tag, variant)
    done = subprocess.run(
        [sys.executable, *trainer.launch, "--help"],
        cwd=trainer.tree,
        env=cpu_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    flags = ("--numerical-loss", "--del-alpha", "--del-reduction", "--del-digit-token-ids")
    for flag in flags + ("--del-logits-free",):
        assert flag in done.stdout, flag
