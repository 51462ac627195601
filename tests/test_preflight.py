"""`del-megatron check`'s logic: ids, split or merged, and flags that Megatron-LM accepts."""

import argparse

import pytest

from del_megatron import megatron as dmm
from del_megatron.preflight import check_tokenizer, report

from .sentencepiece_models import train_sentencepiece_models
from .test_megatron_glue import digit_grouping_bpe


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
    with pytest.raises(ValueError, match="GPT2BPETokenizer"):
        check_tokenizer("x", "GPT2BPETokenizer")
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


def test_the_family_decides_the_recommended_alpha(sentencepiece_files, tmp_path):
    """SentencePiece (a .model, or converted to tokenizer.json): the DEL paper's 0.1; byte-level
    BPE (Qwen-2.5 / DeepSeek style tokenizer.json): its 0.01."""
    from del_megatron.preflight import BYTE_LEVEL_BPE, SENTENCEPIECE

    model = check_tokenizer(sentencepiece_files["split"])
    assert model.advice == SENTENCEPIECE and model.flags().startswith(
        "--numerical-loss del --del-alpha 0.1 "
    )
    converted = check_tokenizer(_metaspace_bpe(tmp_path / "tokenizer.json"))
    assert converted.ok and converted.advice == SENTENCEPIECE
    bpe_dir = tmp_path / "bpe"
    bpe_dir.mkdir()
    digit_grouping_bpe().save(str(bpe_dir / "tokenizer.json"))
    byte_level = check_tokenizer(str(bpe_dir), allow_multi_digit_tokens=True)
    assert byte_level.advice == BYTE_LEVEL_BPE
    assert "--del-alpha 0.01 " in byte_level.flags()
    assert "--del-alpha 0.3 " in byte_level.flags("ntl_was")  # NTL's authors' weight
    text = report(byte_level)
    assert "recommended --del-alpha 0.01 for del: the DEL paper's Qwen-2.5 and DeepSeek" in text
