"""What a Megatron-LM run checks and says once before iteration 1: digit ids given by flag held
against the run's tokenizer (digit_ids.py), --del-* flags without a loss, the startup report."""

import argparse
import logging
import re

import pytest
from tokenizers import Tokenizer

import del_megatron as dm
from del_megatron import megatron as dmm

from .test_refusals import one_refusal_line
from .test_tokenizers import LLAMA3_TOKENIZER, one_digit_bpe


def parse(argv):
    return dmm.add_arguments(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture(scope="module")
def one_digit():
    """A byte-level BPE with every digit its own token (trained here), and its DigitVocab."""
    tok = one_digit_bpe()
    return tok, dm.DigitVocab.from_tokenizer(tok)


def flags(*ids, points=None, extra=()):
    argv = ["--numerical-loss", "del", "--del-digit-token-ids", *map(str, ids), *extra]
    if points is not None:
        argv += ["--del-decimal-point-token-ids", *map(str, points)]
    return parse(argv)


def test_the_tokenizers_own_ids_are_accepted_and_said_to_match(one_digit, caplog):
    tok, vocab = one_digit
    with caplog.at_level(logging.INFO, logger="del_megatron"):
        cfg = dmm.config_from_args(flags(*vocab.digit_ids, points=vocab.decimal_point_ids), tok)
    assert cfg.vocab == vocab
    assert "the ids of --del-digit-token-ids match the run's tokenizer" in caplog.text


def test_ids_from_another_tokenizer_stop_the_run_naming_both_sets(one_digit):
    tok, vocab = one_digit
    wrong = [i + 1 for i in vocab.digit_ids]
    with pytest.raises(ValueError) as err:
        dmm.config_from_args(flags(*wrong), tok)
    mine, theirs = " ".join(map(str, wrong)), " ".join(map(str, vocab.digit_ids))
    assert f"gives digit ids {mine}, but the run's tokenizer has '0'..'9' at {theirs}" in str(
        err.value
    )


def test_a_decimal_point_id_that_is_not_a_point_is_refused(one_digit):
    tok, vocab = one_digit
    letter = tok.token_to_id("x")
    with pytest.raises(ValueError, match=rf"{letter} are not '\.' in the run's tokenizer"):
        dmm.config_from_args(flags(*vocab.digit_ids, points=[letter]), tok)
    with pytest.raises(ValueError, match="--del-decimal-point-token-ids gives decimal-point"):
        dmm.config_from_args(parse(["--numerical-loss", "del", "--del-decimal-point-token-ids",
                                    str(letter)]), tok)  # fmt: skip


def test_a_chunking_tokenizer_gets_single_digit_del_unless_a_slot_rule_is_asked(caplog):
    tok = Tokenizer.from_file(str(LLAMA3_TOKENIZER))
    vocab = dm.DigitVocab.from_tokenizer(tok)
    with caplog.at_level(logging.INFO, logger="del_megatron"):
        default = dmm.config_from_args(parse(["--numerical-loss", "del"]), tok)
    assert default.vocab == vocab.single_digits_only()
    assert "chunks of up to three digits; DEL acts on its ten single-digit tokens" in caplog.text
    slots = dmm.config_from_args(
        parse(["--numerical-loss", "del", "--del-slot-logits", "any"]), tok
    )
    assert slots.vocab == vocab and slots.slot_logits == "any"
    # the tokenizer's single-digit ids by hand are the default; with slots they cannot be
    by_hand = flags(*vocab.digit_ids, points=vocab.decimal_point_ids)
    assert dmm.config_from_args(by_hand, tok).vocab == vocab.single_digits_only()
    with pytest.raises(ValueError) as err:
        dmm.config_from_args(flags(*vocab.digit_ids, extra=["--del-slot-logits", "length"]), tok)
    assert "skip every digit of its 1,100 two- and three-digit tokens" in str(err.value)
    assert "drop --del-slot-logits to give the term to the single digits only" in str(err.value)
    both = parse(["--numerical-loss", "del", "--del-slot-logits", "length",
                  "--del-single-digits-only"])  # fmt: skip
    with pytest.raises(ValueError, match="--del-slot-logits length .* drop one"):
        dmm.config_from_args(both, tok)


def test_a_slot_rule_without_a_chunking_tokenizer_is_refused(one_digit):
    tok, _ = one_digit
    with pytest.raises(ValueError, match="digit ids have none .one digit a token.*drop --del-slot"):
        dmm.config_from_args(parse(["--numerical-loss", "del", "--del-slot-logits", "any"]), tok)
    args = flags(*range(10), extra=["--del-slot-logits", "length"])
    args.tokenizer_type = "NullTokenizer"
    with pytest.raises(ValueError, match="drop --del-slot-logits"):
        dmm.config_from_args(args, tokenizer=object())


@pytest.mark.parametrize("flag", ["--del-single-digits-only", "--del-allow-multi-digit-tokens"])
def test_flags_that_do_nothing_beside_explicit_ids_are_refused(flag):
    args = flags(*range(10), extra=[flag])
    args.tokenizer_type = "NullTokenizer"
    with pytest.raises(ValueError, match=f"{flag} does nothing beside --del-digit-token-ids"):
        dmm.config_from_args(args, tokenizer=object())


def test_without_a_tokenizer_with_text_the_ids_are_used_and_said_unchecked(caplog):
    args = flags(*range(10, 20), points=[3])
    args.tokenizer_type = "NullTokenizer"
    with caplog.at_level(logging.INFO, logger="del_megatron"):
        cfg = dmm.config_from_args(args, tokenizer=object())
    assert cfg.vocab == dm.DigitVocab(range(10, 20), [3])
    assert "10 11 12 13 14 15 16 17 18 19 used as given, not checked" in caplog.text


def test_a_merging_tokenizer_with_explicit_ids_still_needs_the_opt_in():
    from .test_megatron_glue import digit_grouping_bpe

    tok = digit_grouping_bpe()
    vocab = dm.DigitVocab.from_tokenizer(tok, allow_multi_digit_tokens=True)
    with pytest.raises(ValueError, match="merges digits.*--del-allow-multi-digit-tokens"):
        dmm.config_from_args(flags(*vocab.digit_ids), tok)
    opted = flags(*vocab.digit_ids, extra=["--del-allow-multi-digit-tokens"])
    assert dmm.config_from_args(opted, tok).vocab.digit_ids == vocab.digit_ids


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--del-alpha", "0.3", "--del-reduction", "token"], "--del-alpha, --del-reduction set"),
        (["--del-digit-token-ids", *map(str, range(10))], "--del-digit-token-ids set"),
        (["--del-slot-logits", "any" if dmm.add_arguments(argparse.ArgumentParser())
          .parse_args([]).del_slot_logits == "length" else "length"], "--del-slot-logits set"),
    ],
)  # fmt: skip
def test_del_flags_without_a_numerical_loss_are_refused_with_the_flag_to_add(argv, named, capsys):
    from del_megatron.megatron.lm import register_from_args

    args = parse(argv)
    line = one_refusal_line(capsys, register_from_args, args, tokenizer=None)
    assert re.search(f"{named} without --numerical-loss.*add --numerical-loss del", line), line
    with pytest.raises(ValueError, match="add --numerical-loss del"):
        dmm.config_from_args(args)
    # --del-logits-free acts on CE too; the defaults alone are plain CE
    assert dmm.config_from_args(parse(["--del-logits-free"])).loss == "ce"
    assert register_from_args(parse([]), tokenizer=None) is None


# Every --del-* flag that needs a loss, given at its default value where it has one to give
# (the others with a value: their defaults are None or off, so any given value differs).
GIVEN_AT_DEFAULT = [
    ["--del-alpha", "0.1"],
    ["--del-alpha=0.1"],
    ["--del-reduction", "digit"],
    ["--del-digit-share", "0.5"],
    ["--del-digit-token-ids", *map(str, range(10))],
    ["--del-decimal-point-token-ids"],
    ["--del-allow-multi-digit-tokens"],
    ["--del-slot-logits", "length"],
    ["--del-single-digits-only"],
]


@pytest.mark.parametrize("argv", GIVEN_AT_DEFAULT, ids=lambda argv: argv[0].split("=")[0])
def test_a_del_flag_given_without_a_loss_is_refused_whatever_its_value(argv, monkeypatch, capsys):
    """The forgotten --numerical-loss: a --del-* flag on the command line is refused, also at
    its default value (--del-alpha 0.1, --del-reduction digit), as Megatron-LM's parser
    (lm.add_arguments) parses it, whatever sys.argv holds; the defaults alone are stock."""
    from del_megatron.megatron import lm

    monkeypatch.setattr("sys.argv", ["pytest"])  # what was given is what the parser saw
    flag = argv[0].split("=")[0]
    parser = lm.add_arguments(argparse.ArgumentParser())
    line = one_refusal_line(capsys, parser.parse_args, argv)
    assert line.startswith(f"{flag} set without --numerical-loss"), line
    with pytest.raises(ValueError, match=f"{flag} set without --numerical-loss"):
        dmm.config_from_args(parse(argv))
    assert dmm.config_from_args(parse([])).loss == "ce"  # nothing given: stock CE


def test_the_startup_report_names_loss_weight_reduction_slot_rule_and_ids(caplog):
    from del_megatron.megatron.registration import settings_line

    chunked = dm.DigitVocab.from_tokenizer(Tokenizer.from_file(str(LLAMA3_TOKENIZER)))
    cfg = dm.NumericalLossConfig(alpha=0.1, vocab=chunked, slot_logits="length")
    line = settings_line(cfg)
    assert line.startswith(
        "del_megatron: del (alpha 0.1 on the mean term over digit targets, digit reduction) on "
        f"digit ids {list(chunked.digit_ids)}, decimal points {list(chunked.decimal_point_ids)}"
    )
    assert line.endswith("1100 multi-digit tokens, slot rule length")
    one = dm.NumericalLossConfig(
        loss="dist2", alpha=0.3, vocab=dm.DigitVocab(range(10), [12]), reduction="token",
        digit_share=0.25,
    )  # fmt: skip
    assert settings_line(one) == (
        "del_megatron: dist2 (alpha 0.3 on the mean term over digit targets, token reduction, "
        "digit share 0.25) on digit ids [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], decimal points [12]"
    )


def test_a_zero_weight_is_accepted_with_a_note_and_bad_weights_are_refused(caplog):
    import numpy as np
    import torch

    args = flags(*range(10), extra=["--del-alpha", "0"])
    args.tokenizer_type = "NullTokenizer"
    with caplog.at_level(logging.INFO, logger="del_megatron"):
        cfg = dmm.config_from_args(args, tokenizer=object())
        dmm.register(cfg)
        dmm.unregister()
    assert cfg.alpha == 0.0 and "alpha is 0: the del term is computed" in caplog.text
    for bad in ("nan", "inf", "-0.1"):
        args.del_alpha = float(bad)
        with pytest.raises(ValueError, match="--del-alpha must be a finite number >= 0"):
            dmm.config_from_args(args, tokenizer=object())
    for weight in (np.float32(0.25), torch.tensor(0.25), 1):  # any real number type
        assert dm.NumericalLossConfig(alpha=weight, vocab=cfg.vocab).alpha == float(weight)


def test_bridge_and_nemo_hold_a_vocab_given_against_their_tokenizer(one_digit, caplog):
    """digit_ids.resolve_vocab as both enable_numerical_loss calls make it (API names)."""
    from del_megatron.config import API_NAMES
    from del_megatron.megatron.digit_ids import resolve_vocab

    def api_vocab(vocab, tokenizer, allow_multi_digit_tokens, slot_rule):
        return resolve_vocab(
            tokenizer,
            vocab,
            API_NAMES,
            allow_multi_digit_tokens=allow_multi_digit_tokens,
            slot_rule=slot_rule,
        )

    tok, vocab = one_digit
    assert api_vocab(vocab, tok, False, None) == vocab
    assert api_vocab(None, tok, False, None) == vocab
    with pytest.raises(ValueError, match="ids have none .one digit a token.*: drop slot_logits"):
        api_vocab(None, tok, False, "length")
    wrong = dm.DigitVocab([i + 1 for i in vocab.digit_ids], vocab.decimal_point_ids)
    with pytest.raises(ValueError, match="vocab= gives digit ids .* the ids are from another"):
        api_vocab(wrong, tok, False, None)
    llama3 = Tokenizer.from_file(str(LLAMA3_TOKENIZER))
    chunked = dm.DigitVocab.from_tokenizer(llama3)
    assert api_vocab(None, llama3, False, None) == chunked.single_digits_only()
    assert api_vocab(None, llama3, False, "length") == chunked
    assert api_vocab(chunked, llama3, False, "length") == chunked
    assert api_vocab(chunked.single_digits_only(), llama3, False, None) == (
        chunked.single_digits_only()
    )
    other = dm.DigitVocab(chunked.digit_ids, [], [i + 1 for i in chunked.multi_digit_ids])
    with pytest.raises(ValueError, match="multi-digit ids that are not the run's tokenizer's"):
        api_vocab(other, llama3, False, "length")
    with caplog.at_level(logging.INFO, logger="del_megatron"):
        assert api_vocab(wrong, None, False, None) == wrong  # no tokenizer: as given, said
    assert "used as given, not checked" in caplog.text


def test_a_sequence_of_length_0_is_refused_by_name():
    import torch

    cfg = dm.NumericalLossConfig(alpha=0.1, vocab=dm.DigitVocab(range(10), [12]))
    labels = torch.zeros(2, 0, dtype=torch.long)
    for loss in (dm.loss_parts, dm.numerical_lm_loss):
        with pytest.raises(ValueError, match=r"logits \[seq, batch, vocab_local\] is \[0, 2, 32\]"):
            loss(labels, torch.zeros(0, 2, 32), cfg)
    with pytest.raises(ValueError, match=r"hidden \[seq, batch, hidden\] is \[0, 2, 8\]: a seq"):
        dm.numerical_linear_loss(torch.zeros(0, 2, 8), torch.zeros(32, 8), labels, cfg)
