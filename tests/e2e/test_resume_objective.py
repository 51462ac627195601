"""A resume with another --del-alpha than the checkpoint's, through Megatron-LM's pretrain_gpt.py:
announced once before training goes on, never refused.

It resumes the digit reduction's torch checkpoint that test_pretrain_gpt.base_runs saves at
iteration 5 (patched script, the environment's newest tag), with that run's flags read from
test_pretrain_gpt's constants when the test runs, and --del-alpha ten times theirs: one
pretrain_gpt run more.
"""

from __future__ import annotations

import argparse
import re
from typing import Sequence

import pytest

from del_megatron.megatron import lm
from del_megatron.megatron.resume import announcements, settings_of_args

from . import test_pretrain_gpt as base
from .megatron_lm import MOCK_DATA, TINY_GPT, is_finite
from .megatron_lm import tags_for_this_environment as _tags

FIRST_RESUMED = re.compile(r"iteration\s+6/")


def del_flags(flags: Sequence[str]) -> argparse.Namespace:
    """The DEL flags of a command line, parsed as Megatron-LM parses them (the rest ignored)."""
    parser = lm.add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return parser.parse_known_args(list(flags))[0]


@pytest.mark.parametrize("tag", _tags()[-1:])
def test_resuming_with_another_alpha_announces_old_and_new_and_trains(trainers, tag):
    trainer = trainers(tag, base.SCRIPT)
    base.base_runs(trainer)
    saved = TINY_GPT + MOCK_DATA + base.TP2 + base.DEL + base.DIGIT
    alpha = 10 * base.ALPHA
    load = ["--load", str(trainer.path("ckpt-torch")), "--ckpt-step", "5", "--ckpt-format", "torch"]
    run_flags = saved + ["--del-alpha", str(alpha)]
    resumed = trainer.run("resume-other-alpha", run_flags + load)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert sorted(resumed.iterations) == list(range(6, 11)), resumed.log[-3000:]

    (line,) = announcements(del_flags(saved), settings_of_args(del_flags(run_flags)))
    assert f"--del-alpha {base.ALPHA:g} -> {alpha:g}" in line
    log = resumed.log
    assert log.count(line) == 1, log[-3000:]  # rank 0, once
    assert log.index(line) < FIRST_RESUMED.search(log).start()
    # It trains with its own alpha: lm loss = ce loss + alpha x del term on a step with digits.
    # (Line 7 averages steps 6 and 7, its del term over their digit targets only: left out.)
    steps = [resumed.iterations[i] for i in (6, 8, 9, 10)]
    assert all(is_finite(step[key]) for step in steps for key in ("lm loss", "del term"))
    step = max(steps, key=lambda entries: entries["del term"])
    assert step["del term"] > 0
    expected = step["ce loss"] + alpha * step["del term"]
    assert step["lm loss"] == pytest.approx(expected, rel=base.PRINTED)
