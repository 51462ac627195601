"""A resume with other numerical-loss settings than the checkpoint's is announced, not refused."""

import logging
import sys
import types
from argparse import Namespace

import pytest

import del_megatron as dm
from del_megatron import megatron as dmm
from del_megatron.megatron import resume
from del_megatron.megatron.resume import Settings, announcements, settings_of_args

IDS = list(range(10, 20))
STATE_LOGGER = "del_megatron"


def saved(**flags) -> Namespace:
    """The args of a checkpoint saved by this version (every DEL flag present)."""
    args = dict(numerical_loss="del", del_alpha=0.01, del_reduction="digit")
    args.update(del_digit_share=None, del_digit_token_ids=IDS, num_layers=2)
    return Namespace(**{**args, **flags})


def saved_by_0_1(**flags) -> Namespace:
    """The args of a del-megatron 0.1 checkpoint: no del_digit_share."""
    args = vars(saved(**{"del_reduction": "token", **flags}))
    args.pop("del_digit_share")
    return Namespace(**args)


def test_identical_settings_announce_nothing():
    assert announcements(saved(), settings_of_args(saved())) == []
    token = saved(del_reduction="token", del_digit_share=0.05)
    assert announcements(token, settings_of_args(token)) == []
    assert announcements(Namespace(num_layers=2), Settings()) == []  # CE on CE


def test_a_changed_alpha_and_reduction_are_named_old_to_new():
    run = settings_of_args(saved(del_alpha=0.1, del_reduction="token", del_digit_share=0.05))
    (line,) = announcements(saved(), run)
    assert "--del-alpha 0.01 -> 0.1" in line
    assert "--del-reduction digit -> token" in line
    assert "--del-digit-share none -> 0.05" in line
    assert "--numerical-loss" not in line and "--del-digit-token-ids" not in line


def test_changed_digit_ids_are_named_and_unknown_ones_are_not():
    run = settings_of_args(saved(del_digit_token_ids=list(range(20, 30))))
    (line,) = announcements(saved(), run)
    assert "--del-digit-token-ids 10 11 12 13 14 15 16 17 18 19 -> 20 21" in line
    assert announcements(saved(del_digit_token_ids=None), run) == []  # read from its tokenizer


def test_a_changed_slot_rule_is_named_where_both_runs_name_one():
    run = settings_of_args(saved(del_slot_logits="length"))
    (line,) = announcements(saved(del_slot_logits="any"), run)
    assert "--del-slot-logits any -> length" in line
    # single digits (no rule), or a checkpoint from before the flag: nothing to compare
    assert announcements(saved(del_slot_logits=None), run) == []
    assert announcements(saved(), run) == []


def test_a_ce_checkpoint_continued_with_del_is_one_plain_line():
    run = settings_of_args(saved())
    for checkpoint in (Namespace(num_layers=2), saved(numerical_loss="ce")):  # plain Megatron-LM
        assert announcements(checkpoint, run) == [
            "del_megatron: this run continues a CE checkpoint with DEL (--numerical-loss del "
            "--del-alpha 0.01 --del-reduction digit)"
        ]


def test_a_del_checkpoint_continued_with_ce_says_the_term_is_off():
    (line,) = announcements(saved(), Settings())
    assert "continues a DEL checkpoint (--numerical-loss del --del-alpha 0.01" in line
    assert "with CE: no numerical term from here" in line


def test_a_0_1_token_checkpoint_explains_the_old_unit():
    (line,) = announcements(saved_by_0_1(del_alpha=0.1), settings_of_args(saved(del_alpha=0.1)))
    assert line == (
        "del_megatron: the checkpoint in --load was trained by del-megatron 0.1 with --del-alpha "
        "0.1 under the token reduction: a weight of 0.1 x its data's digit share on the mean "
        "digit term. This run's --del-alpha 0.1 is the weight on the mean digit term itself "
        "(docs/megatron-lm.md, 'Migrating from 0.1'); --del-reduction token --del-digit-share 1 "
        "--del-alpha 0.1 trains what the checkpoint trained"
    )


def test_a_0_1_checkpoint_names_the_other_changes_beside_the_old_unit():
    run = settings_of_args(saved(numerical_loss="ntl_was", del_alpha=0.05))
    old_unit, changed = announcements(saved_by_0_1(), run)
    assert "--del-alpha 0.01 under the token reduction" in old_unit
    assert "This run's --del-alpha 0.05" in old_unit
    assert "--numerical-loss del -> ntl_was" in changed and "--del-alpha" not in changed


def test_a_0_1_digit_checkpoint_is_in_todays_unit():
    old = saved_by_0_1(del_reduction="digit")
    assert not resume.is_old_unit(old)
    assert announcements(old, settings_of_args(saved())) == []


def test_the_run_side_is_the_registered_config():
    cfg = dm.NumericalLossConfig(alpha=0.1, vocab=dm.DigitVocab(IDS, []))
    dmm.register(cfg)
    try:
        assert resume.run_settings(saved()) == Settings("del", 0.1, "digit", None, tuple(IDS))
    finally:
        dmm.unregister()


@pytest.fixture
def checkpointing(monkeypatch):
    """A stand-in for megatron.training.checkpointing: check_checkpoint_args records its calls,
    get_args returns the run's args."""
    module = types.ModuleType(resume.MODULE)
    module.calls = []
    module.run_args = saved(del_alpha=0.1)

    def check_checkpoint_args(checkpoint_args, skip_args=None):
        module.calls.append((checkpoint_args, skip_args))

    module.check_checkpoint_args = check_checkpoint_args
    module.get_args = lambda: module.run_args
    monkeypatch.setitem(sys.modules, resume.MODULE, module)
    yield module
    dmm.unregister()


def test_the_seam_announces_once_after_megatrons_check_and_unregister_restores_it(
    checkpointing, caplog
):
    original = checkpointing.check_checkpoint_args
    resume.install()
    resume.install()  # idempotent
    assert checkpointing.check_checkpoint_args.__wrapped__ is original
    dmm.register(dm.NumericalLossConfig(alpha=0.1, vocab=dm.DigitVocab(IDS, [])))
    try:
        with caplog.at_level(logging.INFO, logger=STATE_LOGGER):
            checkpointing.check_checkpoint_args(saved(), skip_args={"num_layers"})
            checkpointing.check_checkpoint_args(saved())
    finally:
        dmm.unregister()
    assert checkpointing.calls == [(saved(), {"num_layers"}), (saved(), None)]
    lines = [r.getMessage() for r in caplog.records if "--del-alpha 0.01 -> 0.1" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("del_megatron: the checkpoint in --load")
    assert checkpointing.check_checkpoint_args is original
    dmm.unregister()  # idempotent
    assert checkpointing.check_checkpoint_args is original


def test_register_from_args_installs_the_seam_also_for_stock_ce(checkpointing):
    from del_megatron.megatron import lm

    assert lm.register_from_args(Namespace(numerical_loss=None), None) is None
    assert hasattr(checkpointing.check_checkpoint_args, "__wrapped__")
    dmm.unregister()
    assert not hasattr(checkpointing.check_checkpoint_args, "__wrapped__")


def test_without_megatron_lm_the_seam_is_a_no_op(monkeypatch):
    monkeypatch.setitem(sys.modules, resume.MODULE, None)  # import raises ImportError
    resume.install()
    dmm.unregister()
