"""`del-megatron` as a user runs it: a misconfigured command ends in one line naming the file or
flag and the fix, with check's exit codes (0 usable, 1 the tokenizer cannot serve DEL, 2 bad
input or usage), never in a traceback or a run. Each kind of ending is run once as a process of
its own (`cli`); their variants run in-process (`main`)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from del_megatron.tools.cli import main

from .test_tokenizers import gpt2_bpe_files

SENTENCEPIECE = str(
    Path(importlib.util.find_spec("mistral_common").origin).parent / "data/tokenizer.model.v1"
)
TOKENIZER_FIX = (
    'a tokenizer.json is a JSON object with a "model", as Tokenizer.save of the tokenizers '
    'library writes it (a tekken JSON one with a "config" and a "vocab"): give the file your '
    "run's tokenizer is saved in"
)
FILE_FIX = "a file, not a folder: name a new or existing folder"
NEEDS_BOTH = (
    "GPT2BPETokenizer needs both --vocab-file (its vocab.json) and --merge-file (its merges.txt)"
)


def cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`del-megatron ARGV` run in `cwd` as a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "del_megatron.tools.cli", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},  # the libraries' import warnings
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line on stderr (after argparse's usage lines, if any); no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    # torch's own log lines (glog style, e.g. the CUDA build's "W1204 ... No CUDA runtime is
    # found" on a machine without CUDA) are not ours
    lines = [
        line
        for line in proc.stderr.splitlines()
        if not line.startswith((" ", "usage:")) and not re.match(r"[IWEF]\d{4} ", line)
    ]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def main_error(argv, capsys) -> str:
    """The one stderr line of `del-megatron ARGV` run in-process, which must exit 2."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return captured.err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return gpt2_bpe_files(tmp_path_factory.mktemp("gpt2"))


def test_check_refuses_a_weight_that_is_not_finite(tmp_path):
    proc = cli(tmp_path, "check", "--tokenizer", SENTENCEPIECE, "--alpha", "nan")
    assert proc.returncode == 2 and proc.stdout == ""  # no flags to paste
    assert error_line(proc) == (
        "del-megatron check: error: argument --alpha: must be a finite number >= 0, got nan "
        "(a negative weight trains against the target)"
    )


def test_check_takes_a_weight_of_zero_and_refuses_inf(capsys):
    assert main(["check", "--tokenizer", SENTENCEPIECE, "--alpha", "0"]) == 0
    flags = capsys.readouterr().out.splitlines()[-1]
    assert flags.startswith(
        "add to pretrain_gpt.py or pretrain_hybrid.py: --numerical-loss del --del-alpha 0 --del-"
    )
    assert main_error(["check", "--tokenizer", SENTENCEPIECE, "--alpha", "inf"], capsys) == (
        "del-megatron check: error: argument --alpha: must be a finite number >= 0, got inf "
        "(a negative weight trains against the target)"
    )


def test_check_prints_the_digit_ce_controls_flags(capsys):
    assert main(["check", "--tokenizer", SENTENCEPIECE, "--loss", "digit_ce"]) == 0
    flags = capsys.readouterr().out.splitlines()[-1]
    assert flags.startswith(
        "add to pretrain_gpt.py or pretrain_hybrid.py: --numerical-loss digit_ce --del-alpha 0.1 "
    )


def test_demo_refuses_a_learning_rate_that_is_not_finite(tmp_path):
    """(The other weights and rates of demo, compare and train: tests/test_demo.py.)"""
    proc = cli(tmp_path, "demo", "--out", "out", "--lr", "inf")
    assert proc.returncode == 2
    assert error_line(proc) == (
        "del-megatron demo: error: argument --lr: must be a finite learning rate > 0, got inf"
    )
    assert list(tmp_path.iterdir()) == []  # nothing prepared, nothing trained


@pytest.mark.parametrize("command", ["prepare", "demo"])
def test_an_output_folder_that_is_a_file_is_refused(tmp_path, command):
    (tmp_path / "taken").write_text("keep me")
    proc = cli(tmp_path, command, "--out", "taken")
    assert proc.returncode == 2
    assert error_line(proc) == (
        f"del-megatron {command}: error: argument --out: output folder 'taken' is {FILE_FIX}"
    )
    assert (tmp_path / "taken").read_text() == "keep me"


def test_an_output_folder_inside_a_file_is_refused(tmp_path, capsys):
    from del_megatron.tools.demo.data import prepare

    taken = tmp_path / "taken"
    taken.write_text("keep me")
    for command in ("prepare", "compare"):
        assert main_error([command, "--out", f"{taken}/data"], capsys) == (
            f"del-megatron {command}: error: argument --out: output folder '{taken}/data' lies "
            f"in '{taken}', which is {FILE_FIX}"
        )
    with pytest.raises(ValueError, match=f"output folder '{taken}' is {FILE_FIX}"):
        prepare(str(taken))  # from Python too
    assert taken.read_text() == "keep me"


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("tokenizer.json", "[1, 2, 3]", "holds a JSON list at its top"),
        ("tokenizer.json", "{}", "is an empty JSON object"),
        ("empty.json", "", "is empty"),
    ],
)
def test_check_names_a_json_file_that_is_no_tokenizer(tmp_path, name, content, problem):
    (tmp_path / name).write_text(content)
    proc = cli(tmp_path, "check", "--tokenizer", name)
    assert proc.returncode == 2 and proc.stdout == ""
    assert error_line(proc) == f"del-megatron check: error: '{name}' {problem}: {TOKENIZER_FIX}"


def test_prepare_names_a_json_file_that_is_no_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("[]")
    proc = cli(tmp_path, "prepare", "--out", "data", "--tokenizer", "tokenizer.json")
    assert proc.returncode == 2
    assert error_line(proc) == (
        "del-megatron prepare: error: 'tokenizer.json' holds a JSON list at its top: "
        f"{TOKENIZER_FIX}"
    )
    assert not (tmp_path / "data").exists()


def test_check_reads_gpt2bpetokenizer_files_with_exit_codes_1_and_0(tmp_path, gpt2_files):
    vocab_file, merge_file = gpt2_files
    files = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file]
    files += ["--merge-file", merge_file]
    refused = cli(tmp_path, "check", *files)
    assert refused.returncode == 1
    assert refused.stdout.startswith("this Tokenizer merges digits into multi-digit tokens")
    assert "add to pretrain_gpt.py or pretrain_hybrid.py" not in refused.stdout
    allowed = cli(tmp_path, "check", *files, "--allow-multi-digit-tokens")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.startswith(
        f"{vocab_file} + {merge_file}: numbers tokenize MERGED into multi-digit tokens"
    )
    assert allowed.stdout.rstrip().endswith(" --del-allow-multi-digit-tokens")


def test_check_takes_megatrons_spelling_of_the_opt_in(gpt2_files, capsys):
    vocab_file, merge_file = gpt2_files
    argv = ["check", "--vocab-file", vocab_file, "--merge-file", merge_file]
    assert main(argv + ["--del-allow-multi-digit-tokens"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(" --del-allow-multi-digit-tokens")


def test_check_refuses_gpt2bpetokenizer_without_its_files(tmp_path):
    proc = cli(tmp_path, "check", "--tokenizer-type", "GPT2BPETokenizer")
    assert proc.returncode == 2 and proc.stdout == ""
    assert error_line(proc) == f"del-megatron check: error: {NEEDS_BOTH}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{vocab}"], NEEDS_BOTH),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--tokenizer", "{vocab}"],
            "GPT2BPETokenizer reads --vocab-file and --merge-file, not --tokenizer-model: drop "
            "--tokenizer-model {vocab}",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--vocab-file", "{vocab}"],
            "--vocab-file and --merge-file are GPT2BPETokenizer's files; --tokenizer-type "
            "HuggingFaceTokenizer reads --tokenizer-model only: drop them, or pass "
            "--tokenizer-type GPT2BPETokenizer",
        ),
        (
            ["--tokenizer", "{vocab}"],
            "'{vocab}' is a vocab.json (token -> id), not a tokenizer.json: for GPT-2's BPE pass "
            "--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} --merge-file merges.txt (the "
            "merges.txt saved with it)",
        ),
        (
            ["--vocab-file", "{merges}", "--merge-file", "{vocab}"],
            "--vocab-file '{merges}' is not JSON (Expecting value: line 1 column 1 (char 0)): a "
            "GPT-2 vocab.json is a JSON object of token -> id (--vocab-file; --merge-file takes "
            "the merges.txt saved with it)",
        ),
        (
            ["--tokenizer-type", "NoSuchTokenizer", "--tokenizer", "{vocab}"],
            "--tokenizer-type 'NoSuchTokenizer': this check reads SentencePieceTokenizer, "
            "GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer, TikTokenizer, "
            "GPT2BPETokenizer, NullTokenizer, NullMultimodalTokenizer",
        ),
    ],
)
def test_check_refuses_tokenizer_flags_that_do_not_fit(gpt2_files, capsys, argv, message):
    vocab, merges = gpt2_files
    argv = ["check", *(a.format(vocab=vocab, merges=merges) for a in argv)]
    expected = message.format(vocab=vocab, merges=merges)
    assert main_error(argv, capsys) == f"del-megatron check: error: {expected}"


def test_a_crash_reading_a_tokenizer_is_one_line_with_exit_2(tmp_path):
    """A tokenizer.json that loads but cannot encode (a WordLevel model without its unknown
    token): the library's own exception, caught and named."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    proc = cli(tmp_path, "check", "--tokenizer", "tokenizer.json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert error_line(proc) == (
        "del-megatron check: error: 'tokenizer.json' cannot be read (Exception: WordLevel error: "
        "Missing [UNK] token from the vocabulary): give the tokenizer your run loads, as "
        "Megatron-LM's flags name it"
    )


def test_check_help_documents_the_exit_codes(capsys):
    assert main(["check", "--help"]) == 0
    assert (
        "Exit status: 0 the tokenizer can serve DEL (its flags printed); 1 it cannot (the reason "
        "printed); 2 bad input or usage (a flag, a missing file, a file that is not the "
        "tokenizer it should be: one line on stderr naming it)."
    ) in " ".join(capsys.readouterr().out.split())
