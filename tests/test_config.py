"""NumericalLossConfig as the one carrier: its model-config fields read back once a config, its
one validation in either entry's names, and the weight a step puts on the term, set in one
place (megatron/loss_func.py)."""

import types

import pytest
import torch

import del_megatron as dm
from del_megatron.config import FLAG_NAMES, check_settings, field_of
from del_megatron.loss import LossParts
from del_megatron.megatron import loss_func
from del_megatron.megatron import registration as reg

VOCAB = dm.DigitVocab(range(10), [10], range(11, 1111))


def test_fields_round_trip_and_are_read_once_a_config():
    cfg = dm.NumericalLossConfig(loss="dist2", alpha=0.3, vocab=VOCAB, slot_logits="any")
    config = types.SimpleNamespace()
    cfg.record_on(config)
    assert config.del_alpha == 0.3 and config.del_multi_digit_token_ids == list(range(11, 1111))
    assert dm.NumericalLossConfig.from_fields(config) is cfg  # the one recorded, not rebuilt
    fields = types.SimpleNamespace(**cfg.to_fields())
    built = dm.NumericalLossConfig.from_fields(fields)
    assert built == cfg and dm.NumericalLossConfig.from_fields(fields) is built
    fields.del_alpha = 0.5  # a field changed: built again
    assert dm.NumericalLossConfig.from_fields(fields).alpha == 0.5
    assert dm.NumericalLossConfig.from_fields(types.SimpleNamespace()) is None
    defaults = types.SimpleNamespace(numerical_loss="del", del_digit_token_ids=list(range(10)))
    assert dm.NumericalLossConfig.from_fields(defaults) == dm.NumericalLossConfig(
        vocab=dm.DigitVocab(range(10))
    )
    with pytest.raises(ValueError, match="numerical_loss='del' without del_digit_token_ids"):
        dm.NumericalLossConfig.from_fields(types.SimpleNamespace(numerical_loss="del"))
    assert [field_of(s) for s in ("loss", "alpha")] == ["numerical_loss", "del_alpha"]


@pytest.mark.parametrize(
    "settings, api, flags",
    [
        (dict(alpha=-1.0), "alpha must be", "--del-alpha must be"),
        (dict(reduction="token"), "reduction='token' needs digit_share", None),
        (dict(digit_share=0.5), "digit_share is used by reduction='token' only", None),
        (dict(reduction="token", digit_share=2.0), "digit_share must be the share", None),
    ],
)
def test_one_validation_names_settings_as_the_entry_does(settings, api, flags):
    values = dict(loss="del", alpha=0.1, reduction="digit", digit_share=None, slot_logits="length")
    values.update(settings)
    with pytest.raises(ValueError, match=api):
        dm.NumericalLossConfig(vocab=VOCAB, **settings)
    flag_words = flags or api.replace("reduction='token'", "--del-reduction token").replace(
        "digit_share", "--del-digit-share"
    )
    with pytest.raises(ValueError, match=flag_words):
        check_settings(*values.values(), FLAG_NAMES)
    with pytest.raises(ValueError, match=flag_words):
        dm.NumericalLossConfig(vocab=VOCAB, names=FLAG_NAMES, **settings)
    # loss "ce" reads neither the reduction nor the share: they are not held against each other
    if "alpha" not in settings and settings.get("digit_share") != 2.0:
        assert dm.NumericalLossConfig(loss="ce", **settings).token_weight == 0.0


def _parts(term, digit_count) -> LossParts:
    ce = torch.tensor([[2.0, 3.0, 4.0, 5.0]])
    zeros = torch.zeros_like(ce)
    n = torch.tensor(4)
    is_digit = digit_count > 0
    return LossParts(ce, term, is_digit, zeros, zeros.long(), n, n, digit_count)


def test_the_weight_on_the_term_is_set_in_one_place():
    """term_weight: alpha / share (token), 0 (ce), alpha x loss tokens / digit targets of the
    micro-batch (digit, outside a counted step); reduced_loss composes CE + weight x term."""
    term = torch.tensor([[0.0, 0.5, 0.0, 1.5]])
    parts = _parts(term, torch.tensor([[0, 1, 0, 1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # 3 loss tokens, 2 digit targets
    digit = dm.NumericalLossConfig(alpha=0.2, vocab=VOCAB)
    token = dm.NumericalLossConfig(alpha=0.2, vocab=VOCAB, reduction="token", digit_share=0.25)
    ce = dm.NumericalLossConfig(loss="ce", alpha=0.2)
    assert float(loss_func.term_weight(mask, parts, digit)) == pytest.approx(0.2 * 3 / 2)
    assert loss_func.term_weight(mask, parts, token) == pytest.approx(0.8)
    assert loss_func.term_weight(mask, parts, ce) == 0.0
    for cfg, weight in ((digit, 0.3), (token, 0.8), (ce, 0.0)):
        output = loss_func.model_loss(parts, cfg)
        reduced = loss_func.reduced_loss(mask, reg.Record(output, parts, cfg))
        torch.testing.assert_close(reduced, parts.ce + weight * term)
        if cfg is not digit:  # the model's token form is already what trains
            assert reduced is output


def test_a_digit_loss_that_skips_our_loss_function_is_stopped_at_the_next_micro_batch():
    """Where the registration needs our loss function (the "digit" reduction's weight is set
    there), a training loss it never saw stops the run at the next micro-batch."""
    from del_megatron import megatron as dmm

    cfg = dm.NumericalLossConfig(alpha=0.2, vocab=VOCAB)
    dmm.register(cfg)
    reg.current().loss_func_required = True
    try:
        seen, skipped = torch.zeros(1), torch.zeros(1)
        loss_func.expect_reduction(seen, cfg)
        loss_func.reduced_by_loss_func(seen)
        loss_func.expect_reduction(skipped, cfg)
        with pytest.raises(RuntimeError, match="never reached del_megatron's loss function"):
            loss_func.expect_reduction(torch.zeros(1), cfg)
        with torch.no_grad():  # evaluation passes are not held to it
            loss_func.expect_reduction(torch.zeros(1), cfg)
            loss_func.expect_reduction(torch.zeros(1), cfg)
    finally:
        dmm.unregister()


def test_enable_numerical_loss_checks_its_settings_before_it_reads_the_tokenizer():
    """Bridge's and NeMo's shared path: an unknown setting or a bad value is refused by name
    before the tokenizer (here one that cannot be read) is touched."""
    from del_megatron.megatron.hook import config_of_arguments

    unreadable = object()
    with pytest.raises(TypeError, match="enable_numerical_loss got alpah: its settings are loss"):
        config_of_arguments(unreadable, None, False, {"alpah": 0.1})
    with pytest.raises(ValueError, match="slot_logits must be one of"):
        config_of_arguments(unreadable, None, False, {"slot_logits": "bogus"})


@pytest.fixture
def settings_checks(monkeypatch):
    """Every call of config.check_settings, wherever an entry imported it from."""
    from del_megatron import config
    from del_megatron.automodel import loss as automodel_loss
    from del_megatron.megatron import flags, hook

    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return check_settings(*args, **kwargs)

    for module in (config, flags, hook, automodel_loss):
        monkeypatch.setattr(module, "check_settings", counting)
    return calls


def test_each_entry_checks_the_settings_once(settings_checks, monkeypatch):
    """The flags (parsed by Megatron-LM's parser with ours, then the run's config), Bridge's and
    NeMo's enable_numerical_loss, the API and AutoModel's YAML loss: one check_settings each."""
    import argparse

    from del_megatron.automodel.loss import NumericalLoss
    from del_megatron.megatron import hook, lm

    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py"])
    ids = ["--del-digit-token-ids", *map(str, range(10))]
    argv = ["--numerical-loss", "del", "--del-alpha", "0.3", *ids]
    args = lm.add_arguments(argparse.ArgumentParser()).parse_args(argv)
    args.tokenizer_type = "NullTokenizer"
    cfg = lm.register_from_args(args, tokenizer=object())
    try:
        assert cfg.alpha == 0.3 and len(settings_checks) == 1
    finally:
        dm.megatron.unregister()
    settings_checks.clear()
    cfg = hook.config_of_arguments(None, dm.DigitVocab(range(10)), False, {"alpha": 0.3})
    assert cfg.alpha == 0.3 and len(settings_checks) == 1
    settings_checks.clear()
    assert dm.NumericalLossConfig(alpha=0.3, vocab=VOCAB).alpha == 0.3
    assert len(settings_checks) == 1
    settings_checks.clear()
    loss = NumericalLoss(alpha=0.3, digit_ids=range(10))
    assert loss.cfg.alpha == 0.3 and len(settings_checks) == 1


def test_a_keyword_given_to_enable_without_a_loss_is_the_forgotten_loss():
    """enable_numerical_loss(loss=None, alpha=...): the forgotten loss, whatever the value
    (alpha at its default too), worded as the keywords were given."""
    from del_megatron.megatron import hook

    vocab = dm.DigitVocab(range(10))
    for given in ({"alpha": 0.1}, {"reduction": "digit", "alpha": 0.3}):
        with pytest.raises(ValueError, match=r"set without loss, so the run trains stock"):
            hook.config_of_arguments(None, vocab, False, {"loss": None, **given})
    with pytest.raises(ValueError, match=r"^alpha set without loss.*add loss='del'"):
        hook.config_of_arguments(None, vocab, False, {"loss": None, "alpha": 0.1})


def test_the_term_weight_is_one_rule():
    """token_weight for the token reduction and for ce; alpha x the scope's scale for the
    digit reduction, which needs the scale."""
    digit = dm.NumericalLossConfig(alpha=0.3, vocab=VOCAB)
    assert digit.counts_digits and digit.term_weight(2.5) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="digit count"):
        digit.term_weight()
    token = dm.NumericalLossConfig(alpha=0.3, vocab=VOCAB, reduction="token", digit_share=0.5)
    assert not token.counts_digits and token.term_weight() == pytest.approx(0.6)
    assert dm.NumericalLossConfig(loss="ce").term_weight() == 0.0
