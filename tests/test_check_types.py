"""`del-megatron check` reads a tokenizer as Megatron-LM's --tokenizer-type does: the ids and the
split are those of Megatron-Core's own tokenizer class for that type (built here with
MegatronTokenizer.from_pretrained, as build_tokenizer does); a file the type does not read, a
tiktoken rank file (Meta's Llama-3 tokenizer.model is one) and data written by another
tokenizer are refused in one line, exit 2. The Hugging Face type is held to Megatron's class in
tests/test_megatron_tokenizers.py (transformers, Python 3.12)."""

import base64
import json

import numpy as np
import pytest

import del_megatron as dm
from del_megatron.tools.cli import main

from .sentencepiece_models import train_sentencepiece_models
from .test_check_data_path import _write
from .test_tokenizers import LLAMA3_TOKENIZER, MISTRAL_DATA


def megatron_class(path: str, library: str, **kwargs):
    """Megatron-Core's tokenizer for `library`, as its build_tokenizer makes it."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=path, metadata_path={"library": library}, **kwargs
    )


def check(capsys, *argv) -> tuple:
    """(exit status, stdout, stderr) of `del-megatron check ARGV`."""
    try:
        code = main(["check", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def ids_line(out: str) -> list:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("digit ids")]
    return [int(i) for i in line.split(": ")[1].split()]


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    return train_sentencepiece_models(tmp_path_factory.mktemp("sp"))["split"]


@pytest.fixture(scope="module")
def megatron_tiktoken_json(tmp_path_factory):
    """Mistral's tekken vocabulary (the list under its "vocab" key, 150,000 ranks) as the JSON
    file Megatron-LM's TikTokenizer reads: (path, tekken file, entries)."""
    tekken = MISTRAL_DATA / "tekken_240911.json"
    entries = json.loads(tekken.read_text())["vocab"]
    path = tmp_path_factory.mktemp("tik") / "tekken_vocab.json"
    path.write_text(json.dumps(entries))
    return str(path), str(tekken), len(entries)


@pytest.fixture(scope="module")
def llama3_rank_file(tmp_path_factory):
    """Meta's Llama-3 tokenizer.model made from Llama-3.2's tokenizer.json: its 128,000 BPE
    tokens, byte-decoded, as '<base64> <rank>' lines."""
    vocab = json.loads(LLAMA3_TOKENIZER.read_text())["model"]["vocab"]
    byte_level = {c: b for b, c in _bytes_to_unicode().items()}
    lines = []
    for token, rank in sorted(vocab.items(), key=lambda x: x[1]):
        raw = bytes(byte_level[c] for c in token)
        lines.append(f"{base64.b64encode(raw).decode()} {rank}\n")
    assert len(lines) == 128_000
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.model"
    path.write_text("".join(lines))
    return path


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies are written in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@pytest.mark.parametrize(
    "tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
)
def test_sentencepiece_types_give_megatrons_ids(capsys, sentencepiece_model, tokenizer_type):
    code, out, _ = check(
        capsys, "--tokenizer-type", tokenizer_type, "--tokenizer-model", sentencepiece_model
    )
    theirs = dm.DigitVocab.from_tokenizer(megatron_class(sentencepiece_model, "sentencepiece"))
    assert code == 0 and "one digit per token" in out
    assert ids_line(out) == list(theirs.digit_ids)


def test_tiktokenizer_gives_megatrons_shifted_ids_and_one_digit_a_token(
    capsys, megatron_tiktoken_json
):
    path, tekken, n = megatron_tiktoken_json
    argv = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path]
    code, out, _ = check(capsys, *argv)  # Megatron's defaults: vocab 131,072, 1,000 specials
    theirs = megatron_class(path, "tiktoken", vocab_size=131072, pattern="v2")
    vocab = dm.DigitVocab.from_tokenizer(theirs)
    assert code == 0 and "one digit per token" in out and not vocab.chunked
    assert ids_line(out) == list(vocab.digit_ids)
    # The tekken file read as Mistral reads it: the same ids (the same ranks, offset, pattern).
    code, mistral, _ = check(capsys, "--tokenizer", tekken)
    assert code == 0 and ids_line(mistral) == ids_line(out)
    # v1, and another offset, as Megatron's class gives them.
    argv += [
        "--tiktoken-pattern",
        "v1",
        "--tiktoken-num-special-tokens",
        "2000",
        "--vocab-size",
        "132072",
    ]
    code, out, _ = check(capsys, *argv)
    theirs = megatron_class(
        path, "tiktoken", vocab_size=132072, pattern="v1", num_special_tokens=2000
    )
    assert code == 0 and ids_line(out) == list(dm.DigitVocab.from_tokenizer(theirs).digit_ids)
    assert ids_line(out) == [i + 1000 for i in ids_line(mistral)]
    # A --vocab-size beyond the file stops Megatron on an assertion, and check names the flag.
    code, _, err = check(capsys, *argv[:-1], str(n + 5000))
    assert code == 2 and "pass the run's --vocab-size" in err and err.count("\n") == 1
    # The tekken file itself is not what TikTokenizer reads; its "vocab" list is.
    code, _, err = check(capsys, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", tekken)
    assert (
        code == 2
        and "is a Mistral tekken JSON: for it, pass --tokenizer-type TikTokenizer with the "
        'list under its "vocab" key'
        in err
    )


def test_a_rank_file_is_refused_with_the_route_megatron_reads_llama3_by(
    capsys, llama3_rank_file, tmp_path
):
    renamed = tmp_path / "llama3.tiktoken"
    renamed.write_bytes(llama3_rank_file.read_bytes())
    for argv in (["--tokenizer", str(llama3_rank_file)], ["--tokenizer", str(renamed)]):
        code, out, err = check(capsys, *argv)
        assert code == 2 and not out and err.count("\n") == 1
        assert "128,000 ranks, as Meta's Llama-3 tokenizer.model is" in err
        assert "HuggingFaceTokenizer and the folder holding its tokenizer.json" in err
    code, _, err = check(
        capsys, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(llama3_rank_file)
    )
    assert code == 2 and "is a tiktoken rank file" in err and "JSON list" in err
    # The route it names: Llama-3.2's folder, in chunks of up to three.
    code, out, _ = check(
        capsys,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(LLAMA3_TOKENIZER.parent),
    )
    assert code == 0 and "in chunks of up to three digits" in out


@pytest.mark.parametrize(
    "tokenizer_type, file, names",
    [
        ("Llama2Tokenizer", "tokenizer.json", "is a Hugging Face tokenizer.json: for it, pass "
         "--tokenizer-type HuggingFaceTokenizer"),
        ("HuggingFaceTokenizer", "sentencepiece", "is a SentencePiece model: for it, pass "
         "--tokenizer-type Llama2Tokenizer"),
        ("TikTokenizer", "tokenizer.json", "reads a JSON list of {rank, token_bytes, token_str}"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_what_its_type_reads_is_refused_naming_both(
    capsys, sentencepiece_model, tokenizer_type, file, names
):
    path = str(LLAMA3_TOKENIZER) if file == "tokenizer.json" else sentencepiece_model
    code, out, err = check(capsys, "--tokenizer-type", tokenizer_type, "--tokenizer-model", path)
    assert code == 2 and not out and err.count("\n") == 1
    assert f"--tokenizer-type {tokenizer_type} reads" in err and names in err


def test_data_another_tokenizer_wrote_is_refused(capsys, sentencepiece_model, tmp_path):
    """Ids at or above the tokenizer's vocabulary, and no digit in a large sample of a
    tokenizer that has digits: exit 2, naming the dataset and the likely cause."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sentencepiece_model)
    digits = {sp.piece_to_id(str(d)) for d in range(10)}
    words = np.array([i for i in range(3, sp.get_piece_size()) if i not in digits])
    rng = np.random.default_rng(0)
    wide = str(tmp_path / "wide")
    _write(wide, [rng.integers(0, sp.get_piece_size() + 500, 50) for _ in range(40)])
    code, _, err = check(capsys, "--tokenizer", sentencepiece_model, "--data-path", wide)
    assert (
        code == 2
        and err.count("\n") == 1
        and f"and the tokenizer has {sp.get_piece_size():,} ids" in err
    )
    no_digits = str(tmp_path / "no_digits")
    _write(no_digits, [rng.choice(words, 100) for _ in range(120)])
    code, _, err = check(capsys, "--tokenizer", sentencepiece_model, "--data-path", no_digits)
    assert code == 2 and "no digit target in 12,000 tokens" in err and "another tokenizer" in err
