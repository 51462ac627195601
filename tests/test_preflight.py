"""`del-megatron check`'s logic: ids, split or merged, and flags that Megatron-LM accepts."""

import argparse

import pytest

from del_megatron import megatron as dmm
from del_megatron.digits.tokenizers import load_gpt2_bpe
from del_megatron.tools.preflight import check_tokenizer, report

from .sentencepiece_models import train_sentencepiece_models
from .test_megatron_glue import digit_grouping_bpe
from .test_tokenizers import gpt2_bpe_files


@pytest.fixture(scope="module")
def sentencepiece_files(tmp_path_factory):
    return train_sentencepiece_models(tmp_path_factory.mktemp("sp"))


def test_a_digit_splitting_tokenizer_gives_its_ids_and_flags(sentencepiece_files):
    import sentencepiece as spm

    path = sentencepiece_files["split"]
    result = check_tokenizer(path, "SentencePieceTokenizer")
    sp = spm.SentencePieceProcessor(model_file=path)
    # Independently: each digit's piece id, as SentencePiece itself names it.
    assert result.digit_ids == [sp.piece_to_id(str(d)) for d in range(10)]
    assert result.decimal_point_ids == [sp.piece_to_id(".")]
    assert result.ok and result.digits_split
    text = report(result, alpha=0.1)
    assert "one digit per token" in text
    flags = text.splitlines()[-1].split(": ", 1)[1].split()
    args = dmm.add_arguments(argparse.ArgumentParser()).parse_args(flags)
    cfg = dmm.config_from_args(args)
    assert (cfg.loss, cfg.alpha) == ("del", 0.1)
    assert list(cfg.vocab.digit_ids) == result.digit_ids
    assert list(cfg.vocab.decimal_point_ids) == result.decimal_point_ids


def test_a_merging_tokenizer_is_refused_unless_allowed(sentencepiece_files, tmp_path):
    refused = check_tokenizer(sentencepiece_files["merging"])
    assert not refused.ok and "merges digits" in refused.message
    assert "--del-allow-multi-digit-tokens" in refused.message
    # A Llama-3-style BPE (digits grouped by three) has single-digit tokens too.
    path = tmp_path / "tokenizer.json"
    bpe = digit_grouping_bpe()
    bpe.save(str(path))
    allowed = check_tokenizer(str(tmp_path), "HuggingFaceTokenizer", allow_multi_digit_tokens=True)
    assert allowed.ok and not allowed.digits_split
    assert [bpe.decode([i]) for i in allowed.digit_ids] == [str(d) for d in range(10)]
    assert allowed.flags().endswith("--del-allow-multi-digit-tokens")
    assert "MERGED" in report(allowed)


def test_null_tokenizer_and_bad_input_name_the_fix(tmp_path):
    null = check_tokenizer(None, "NullTokenizer")
    assert not null.ok and "--del-digit-token-ids" in null.message
    with pytest.raises(ValueError, match="'BertWordPieceLowerCase': this check reads .*GPT2BPE"):
        check_tokenizer("x", "BertWordPieceLowerCase")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_tokenizer(str(tmp_path / "missing.model"))


def _metaspace_bpe(path):
    """A tokenizer.json as a SentencePiece model converts to (Llama-2's): Metaspace '▁' word
    starts, digits split one per token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Metaspace()]
    )
    tok.decoder = decoders.Metaspace()
    corpus = [f"{i} + {i * 7} = {i * 8}. pi is 3.14159, x = 42.5" for i in range(500)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    tok.save(str(path))
    return str(path)


def _byte_level_digits(path, special: str):
    """A Qwen-2.5-style tokenizer.json (byte-level BPE, digits one per token: Qwen's \\p{N}) with
    `special` as an added token (Qwen's <|im_start|>, DeepSeek's BOS)."""
    path.parent.mkdir(exist_ok=True)
    digit_grouping_bpe(r"\p{N}", [special]).save(str(path))
    return str(path)


def _tekken_split(folder, specials):
    """A byte-level tokenizer.json split by tekken's pattern (Megatron-LM's TikTokenizer v2),
    after <unk>, <s>, </s> and `specials`."""
    from del_megatron.digits.tokenizers import MEGATRON_TIKTOKEN_PATTERNS

    folder.mkdir()
    tok = digit_grouping_bpe(MEGATRON_TIKTOKEN_PATTERNS["v2"], ["<unk>", "<s>", "</s>", *specials])
    tok.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


def test_the_family_decides_the_weight_the_papers_run_applied(sentencepiece_files, tmp_path):
    """SentencePiece (a .model, or converted to tokenizer.json): 0.1, as the CodeLlama and
    Mistral runs applied; Qwen (its qwen.tiktoken, or a byte-level tokenizer.json with Qwen's
    chat markers): 1.28; DeepSeek (its BOS, one digit a token): 2.56; chunking, tekken and other
    tokenizers: --del-alpha's default, 0.1. Each line says what the script wrote."""
    from del_megatron.config import DEFAULT_ALPHA
    from del_megatron.tools import preflight as pf

    from .test_tokenizers import DEEPSEEK_TOKENIZER, MISTRAL_DATA, QWEN_TIKTOKEN

    assert DEFAULT_ALPHA == pf.SENTENCEPIECE.alpha == 0.1
    cases = {
        sentencepiece_files["split"]: (pf.SENTENCEPIECE, 0.1),
        _metaspace_bpe(tmp_path / "tokenizer.json"): (pf.SENTENCEPIECE, 0.1),
        str(QWEN_TIKTOKEN): (pf.QWEN, 1.28),
        _byte_level_digits(tmp_path / "qwen" / "tokenizer.json", "<|im_start|>"): (pf.QWEN, 1.28),
        _byte_level_digits(
            tmp_path / "deepseek" / "tokenizer.json", "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
        ): (pf.DEEPSEEK, 2.56),
        _byte_level_digits(tmp_path / "other" / "tokenizer.json", "<|endoftext|>"): (
            pf.BYTE_LEVEL_BPE,
            0.1,
        ),
        str(DEEPSEEK_TOKENIZER): (pf.CHUNKING, 0.1),  # DeepSeek-V3's: chunks, no paper run
        str(MISTRAL_DATA / "tekken_240911.json"): (pf.TEKKEN, 0.1),
        # tekken's split in a tokenizer.json, as NVIDIA's Nemotron-H tokenizer (<SPECIAL_n>
        # names) and Nemotron 3 (ids 10 and 11 named as Qwen's chat markers) have it
        _tekken_split(tmp_path / "nemotron-h", [f"<SPECIAL_{i}>" for i in range(3, 12)]): (
            pf.TEKKEN,
            0.1,
        ),
        _tekken_split(tmp_path / "nemotron-3", ["<|im_start|>", "<|im_end|>"]): (pf.TEKKEN, 0.1),
    }
    for path, (family, alpha) in cases.items():
        result = check_tokenizer(path)
        assert result.ok and result.advice == family, path
        assert result.flags().startswith(f"--numerical-loss del --del-alpha {alpha:g} ")
        assert "--del-alpha 0.3 " in result.flags("ntl_was")  # NTL's authors' weight
    qwen = report(check_tokenizer(str(QWEN_TIKTOKEN)))
    assert (
        "recommended --del-alpha 1.28 for del: the weight the DEL paper's Qwen2.5 run applied: "
        "its script wrote 0.01" in qwen
    )
    deepseek = report(check_tokenizer(list(cases)[4]))
    assert "0.01 x 32 x 8" in deepseek and "2.56" in deepseek


def megatron_config(flags: str, tokenizer):
    """The NumericalLossConfig a Megatron-LM run with `tokenizer` makes of `flags`."""
    args = dmm.add_arguments(argparse.ArgumentParser()).parse_args(flags.split())
    return dmm.config_from_args(args, tokenizer=tokenizer)


def test_gpt2bpetokenizer_is_read_from_its_vocab_and_merge_files(tmp_path):
    """Megatron-LM's GPT2BPETokenizer (--vocab-file, --merge-file): refused as it merges digits,
    and with the opt-in the bare digits' ids of its vocab.json, its 'Ġ4' ones named as no digit
    targets, in flags Megatron-LM parses back to those ids."""
    import json

    vocab_file, merge_file = gpt2_bpe_files(tmp_path)
    ids = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
    files = dict(vocab_file=vocab_file, merge_file=merge_file)
    refused = check_tokenizer(None, "GPT2BPETokenizer", **files)
    assert not refused.ok and "merges digits" in refused.message
    allowed = check_tokenizer(None, "GPT2BPETokenizer", allow_multi_digit_tokens=True, **files)
    assert allowed == check_tokenizer(None, None, allow_multi_digit_tokens=True, **files)
    assert allowed.digit_ids == [ids[str(d)] for d in range(10)]
    assert allowed.decimal_point_ids == [ids["."]]
    assert allowed.message.startswith(
        f"{vocab_file} + {merge_file}: numbers tokenize MERGED into multi-digit tokens (DEL: "
        "single-digit tokens only); its tokens for a digit after a space (' 0', ' 1', "
    )
    assert allowed.advice.alpha == 0.1 and not allowed.digits_split
    cfg = megatron_config(allowed.flags(), load_gpt2_bpe(vocab_file, merge_file))
    assert list(cfg.vocab.digit_ids) == allowed.digit_ids and cfg.alpha == 0.1
    assert allowed.flags().endswith(" --del-allow-multi-digit-tokens")


def test_gpt2bpetokenizer_flags_that_do_not_fit_are_refused(tmp_path):
    vocab_file, merge_file = gpt2_bpe_files(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2BPETokenizer needs both --vocab-file \(its "):
        check_tokenizer(None, "GPT2BPETokenizer", vocab_file=vocab_file)
    with pytest.raises(ValueError, match="not --tokenizer-model: drop --tokenizer-model x.model"):
        check_tokenizer("x.model", "GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    with pytest.raises(ValueError, match="--tokenizer-type HuggingFaceTokenizer reads "):
        check_tokenizer(str(tmp_path), "HuggingFaceTokenizer", vocab_file=vocab_file)
