"""Megatron-LM's control arm (`--numerical-loss ce`), the forgotten flag, refusals as one line
while the flags are parsed, and which entries the console averages over digit targets."""

import argparse
import logging

import pytest

from del_megatron import megatron as dmm
from del_megatron.megatron import lm, refusals

from .test_refusals import one_refusal_line

IDS = ["--del-digit-token-ids", *map(str, range(10, 20))]


def parsed(argv, monkeypatch):
    """argv through lm.add_arguments (the flags checked as parsed), as Megatron-LM parses
    sys.argv."""
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    return lm.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_the_control_arm_takes_the_del_arms_command_line_and_says_the_weight_is_unused(
    monkeypatch, caplog
):
    argv = ["--numerical-loss", "ce", *IDS, "--del-alpha", "0.3", "--del-reduction", "token"]
    args = parsed(argv, monkeypatch)
    args.tokenizer_type = "NullTokenizer"
    with caplog.at_level(logging.INFO, logger="del_megatron"):
        cfg = lm.register_from_args(args, tokenizer=object())
    try:
        assert cfg.loss == "ce" and cfg.token_weight == 0.0
        assert list(cfg.vocab.digit_ids) == list(range(10, 20))
        unused = [r for r in caplog.records if "unused" in r.getMessage()]
        assert len(unused) == 1
        assert (
            unused[0]
            .getMessage()
            .startswith(
                "del_megatron: --del-alpha, --del-reduction unused: --numerical-loss ce trains "
                "Megatron's cross-entropy"
            )
        )
        assert "del_megatron: ce, the control arm" in caplog.text
    finally:
        dmm.unregister()


def test_without_numerical_loss_the_run_is_stock_and_del_flags_stop_it_as_they_are_parsed(
    monkeypatch, capsys
):
    assert parsed([], monkeypatch).numerical_loss is None
    assert lm.register_from_args(parsed([], monkeypatch), tokenizer=None) is None
    dmm.unregister()
    line = one_refusal_line(capsys, parsed, ["--del-alpha", "0.3"], monkeypatch)
    assert line.startswith("--del-alpha set without --numerical-loss")
    assert "ce for the control arm" in line
    line = one_refusal_line(
        capsys, parsed, ["--numerical-loss", "del", "--del-reduction", "token"], monkeypatch
    )
    assert line.startswith("--del-reduction token needs --del-digit-share,")
    line = one_refusal_line(
        capsys, parsed, ["--numerical-loss", "del", "--del-alpha", "-1"], monkeypatch
    )
    assert "--del-alpha must be a finite number >= 0" in line


def test_only_errors_del_megatron_raises_become_one_line():
    """A ValueError from other code (Megatron-LM's, torch's, here the test's) keeps its
    traceback: the conversion is for del_megatron's own refusals."""

    def theirs():
        raise ValueError("not ours")

    with pytest.raises(ValueError, match="not ours"):
        refusals.one_line(theirs)()
    assert refusals.refusal_line(ValueError("del_megatron: a\n  b")) == "del_megatron: refused: a b"


@pytest.mark.parametrize(
    "loss, reduction, keys, weighted",
    [
        (
            "del",
            "digit",
            ["lm loss", "ce loss", "del term", "del weight", "digit acc", "digit tokens"],
            {"del term": "digit tokens", "del weight": "digit tokens", "digit acc": "digit tokens"},
        ),
        ("del", "token", ["del term", "del weight", "digit tokens"], {"del term": "digit tokens"}),
        (
            "ce",
            "digit",
            ["ce loss", "digit entropy", "digit distance", "digit target prob", "digit tokens"],
            dict.fromkeys(["digit entropy", "digit distance", "digit target prob"], "digit tokens"),
        ),
        (
            "del",
            "digit",
            ["mtp_1 digit acc", "mtp_1 digit tokens", "digit tokens", "digit share"],
            {"mtp_1 digit acc": "mtp_1 digit tokens"},
        ),
        ("del", "digit", ["digit acc"], {}),  # no count to weigh by: Megatron's mean
    ],
)
def test_the_entries_averaged_over_digit_targets_and_their_counts(loss, reduction, keys, weighted):
    assert dict(lm.weighted_entries(keys, loss, reduction)) == weighted


def test_bridge_and_nemo_control_arm_says_its_weight_arguments_are_unused(caplog):
    """enable_numerical_loss(..., loss="ce", alpha=0.3) (Bridge and NeMo share this path): the
    control arm, and one line naming the arguments it does not use."""
    import del_megatron as dm
    from del_megatron.megatron.hook import config_of_arguments

    vocab = dm.DigitVocab(range(10), [10])
    dmm.register(None)
    try:
        with caplog.at_level(logging.INFO, logger="del_megatron"):
            settings = dict(loss="ce", alpha=0.3, reduction="token")
            cfg = config_of_arguments(None, vocab, False, settings)
            config_of_arguments(None, vocab, False, settings)
        assert cfg.loss == "ce" and cfg.token_weight == 0.0
        lines = [r.getMessage() for r in caplog.records if "unused" in r.getMessage()]
        assert lines == [
            "del_megatron: alpha, reduction unused: loss='ce' trains Megatron's cross-entropy "
            "(the control arm) and reports the digit entries beside it"
        ]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="del_megatron"):
            config_of_arguments(None, vocab, False, dict(loss="del", alpha=0.3))
        assert "unused" not in caplog.text
    finally:
        dmm.unregister()


def test_model_checks_at_the_first_forward_refuse_in_one_line_on_megatron_lms_command_line(capsys):
    """What only the model shows (its config, its output layer) is checked when the hook first
    sees it: one line and an exit where Megatron-LM's command line registered the loss, the
    ValueError elsewhere (Bridge, NeMo, the API)."""
    import types

    import del_megatron as dm
    from del_megatron.megatron import hook
    from del_megatron.megatron import registration as reg

    config = types.SimpleNamespace(
        cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear"
    )
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.1, vocab=dm.DigitVocab(range(10), [10]))
    dmm.register(cfg)
    try:
        with pytest.raises(ValueError, match="--cross-entropy-fusion-impl linear"):
            hook._check_model_once(types.SimpleNamespace(config=config))
        reg.current().one_line_refusals = True
        module = types.SimpleNamespace(config=config)
        line = one_refusal_line(capsys, hook._check_model_once, module)
        assert "--cross-entropy-fusion-impl linear" in line
    finally:
        dmm.unregister()
