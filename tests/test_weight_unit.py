"""alpha is the weight on the mean term over digit targets under either reduction (docs/DEL.md),
the ranges a weight and a digit share must lie in, and the check of a given digit share
against the measured one (accounting.py)."""

import argparse
import logging
import math

import numpy as np
import pytest
import torch

import del_megatron as dm
from del_megatron import megatron as dmm
from del_megatron.megatron.accounting import ShareWatch
from del_megatron.reference import reference_lm_loss

VOCAB = dm.DigitVocab(range(10), [10])  # ids 0..9 digits, 10 '.', vocab 16


def batch(seed: int):
    """labels [2, 12] with 8 of 24 targets digits (numbers 12, 345, 6.5 and 0), fp64 logits."""
    labels = torch.tensor(
        [[11, 1, 2, 13, 3, 4, 5, 14, 15, 11, 12, 13], [6, 10, 5, 11, 12, 0, 14, 13, 12, 15, 11, 12]]
    )
    logits = torch.randn(
        12, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    return labels, logits


def weight_on_the_mean_term(labels, logits, cfg) -> float:
    """(mean loss - mean CE) / mean term over digit targets, from the fp64 oracle."""
    loss = dm.numerical_lm_loss(labels, logits, cfg)
    ce, term = reference_lm_loss(labels, logits, VOCAB, loss=cfg.loss)
    digits = sum(int(t) in range(10) for t in labels.flatten())
    mean_term = term.sum().item() / digits
    return (loss.mean().item() - ce.mean().item()) / mean_term


@pytest.mark.parametrize("loss", ["del", "ntl_was", "dist2"])
def test_alpha_is_the_weight_on_the_mean_digit_term_under_both_reductions(loss):
    labels, logits = batch(seed=3)
    share = 8 / 24
    digit = dm.NumericalLossConfig(loss=loss, alpha=0.1, vocab=VOCAB)
    assert digit.reduction == "digit"  # the default
    assert weight_on_the_mean_term(labels, logits, digit) == pytest.approx(0.1, rel=1e-9)
    token = dm.NumericalLossConfig(
        loss=loss, alpha=0.1, vocab=VOCAB, reduction="token", digit_share=share
    )
    assert weight_on_the_mean_term(labels, logits, token) == pytest.approx(0.1, rel=1e-9)
    # a share given 2x too high halves the weight: the token reduction rests on the share
    half = dm.NumericalLossConfig(
        loss=loss, alpha=0.1, vocab=VOCAB, reduction="token", digit_share=2 * share
    )
    assert weight_on_the_mean_term(labels, logits, half) == pytest.approx(0.05, rel=1e-9)
    # del-megatron 0.1's default (alpha on every digit token) is digit_share=1: alpha x share
    old = dm.NumericalLossConfig(
        loss=loss, alpha=0.1, vocab=VOCAB, reduction="token", digit_share=1.0
    )
    assert weight_on_the_mean_term(labels, logits, old) == pytest.approx(0.1 * share, rel=1e-9)


def test_token_weight():
    assert dm.NumericalLossConfig(vocab=VOCAB, alpha=0.1).token_weight == 0.1
    token = dm.NumericalLossConfig(vocab=VOCAB, alpha=0.1, reduction="token", digit_share=0.25)
    assert token.token_weight == pytest.approx(0.4)
    assert dm.NumericalLossConfig(loss="ce", alpha=0.1).token_weight == 0.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(reduction="token"), ValueError, "needs digit_share.*check --data-path"),
        (dict(digit_share=0.3), ValueError, "digit_share is used by reduction='token' only"),
        (dict(reduction="token", digit_share=0.0), ValueError, r"in \(0, 1\]"),
        (dict(reduction="token", digit_share=1.5), ValueError, r"in \(0, 1\]"),
        (dict(reduction="token", digit_share=math.nan), ValueError, r"in \(0, 1\]"),
        (dict(alpha=-0.1), ValueError, "finite number >= 0"),
        (dict(alpha=math.nan), ValueError, "finite number >= 0"),
        (dict(alpha=math.inf), ValueError, "finite number >= 0"),
        (dict(alpha=True), TypeError, "real number"),
        (dict(alpha="0.1"), TypeError, "real number"),
        (dict(alpha=torch.tensor([0.1, 0.2])), TypeError, "one real number"),
    ],
)
def test_bad_weights_and_shares_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        dm.NumericalLossConfig(vocab=VOCAB, **kwargs)


@pytest.mark.parametrize("alpha", [np.float32(0.25), np.float64(0.25), torch.tensor(0.25), 0])
def test_weights_of_any_real_type_are_accepted_as_floats(alpha):
    cfg = dm.NumericalLossConfig(vocab=VOCAB, alpha=alpha)
    assert type(cfg.alpha) is float and cfg.alpha == float(alpha)


def parse(argv):
    parser = argparse.ArgumentParser()
    dmm.add_arguments(parser)
    return parser.parse_args(argv)


IDS = ["--del-digit-token-ids", *map(str, range(10))]


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--del-reduction", "token"], "--del-reduction token needs --del-digit-share,"),
        (["--del-digit-share", "0.3"], "--del-digit-share is used by --del-reduction token only"),
        (["--del-reduction", "token", "--del-digit-share", "2"], r"in \(0, 1\]"),
        (["--del-alpha", "nan"], "--del-alpha must be a finite number >= 0"),
        (["--del-alpha", "-1"], "--del-alpha must be a finite number >= 0"),
    ],
)
def test_the_flags_refuse_a_reduction_without_its_share_and_bad_weights(flags, match):
    with pytest.raises(ValueError, match=match):
        dmm.config_from_args(parse(["--numerical-loss", "del", *IDS, *flags]))


def test_the_flags_carry_the_share_to_the_config():
    args = parse(["--numerical-loss", "del", *IDS, "--del-reduction", "token"])
    args.del_digit_share = 0.2
    cfg = dmm.config_from_args(args)
    assert (cfg.reduction, cfg.digit_share) == ("token", 0.2)
    assert cfg.token_weight == pytest.approx(0.5)  # alpha 0.1 (the default) / 0.2
    assert dmm.config_from_args(parse(["--numerical-loss", "del", *IDS])).reduction == "digit"


class Watched:
    """A ShareWatch over intervals of 3 micro-batches whose warnings are collected."""

    def __init__(self, given, reports=True):
        self.watch = ShareWatch(given, 0.1, lambda: 3, lambda: reports)

    def feed(self, *batches):
        for digits, tokens in batches:
            self.watch.observe(torch.tensor(float(digits)), torch.tensor(float(tokens)))


def test_a_share_within_2x_of_the_given_one_is_not_warned_about(caplog):
    caplog.set_level(logging.WARNING, logger="del_megatron")
    watched = Watched(0.3)
    watched.feed((10, 100), (30, 100), (20, 100), (15, 100), (59, 100), (60, 100))
    assert watched.watch.measured == pytest.approx(134 / 300)  # the last interval
    assert not watched.watch.warned and not caplog.records


def test_a_share_off_by_more_than_2x_is_warned_about_once_per_run(caplog):
    caplog.set_level(logging.WARNING, logger="del_megatron")
    watched = Watched(0.3)
    watched.feed((10, 100), (5, 100))  # mid-interval: nothing read yet
    assert watched.watch.measured is None
    watched.feed((14, 100))  # 29 / 300 = 0.0967 < 0.3 / 2
    assert watched.watch.warned and len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "--del-digit-share is 0.3, but 0.09667 of the loss tokens" in text
    assert "alpha x 0.09667 / 0.3 = 0.03222, not alpha 0.1" in text
    assert "Pass --del-digit-share 0.0967" in text
    watched.feed((1, 100), (1, 100), (1, 100))
    assert len(caplog.records) == 1


def test_only_the_reporting_rank_logs_the_warning(caplog):
    caplog.set_level(logging.WARNING, logger="del_megatron")
    watched = Watched(0.01, reports=False)
    watched.feed((50, 100), (50, 100), (50, 100))
    assert watched.watch.warned and not caplog.records
