"""Megatron-LM's development heads (main, dev): the drop-in trains, the control arm trains stock
pretrain_gpt.py's loss, a resume repeats the run, our patch applies where one does, and the MTP
loss-mask roll works with the head's own roll_tensor.

Per head (the snapshots of megatron_lm.HEADS_BY_CORE, in the Python 3.12 environment), through
the drop-in from an unpatched tree, TP 2 on gloo: a stock run (no DEL flag), the control arm
(--numerical-loss ce) and the DEL arm (digit reduction, saving at iterations 5 and 10), and the
DEL arm resumed from iteration 5; where one of our patches applies (main: core_v0.19.0's), the
patched script's DEL arm too. MTP itself cannot be built on either head without Transformer
Engine (stock pretrain_gpt.py fails in MultiTokenPredictionLayer: an upstream bug), so the roll
is tested on its own, with the head's roll_tensor as shipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .megatron_lm import (
    DIGIT_IDS,
    MOCK_DATA,
    TINY_GPT,
    applying_patch,
    cpu_environment,
    heads_for_this_environment,
    is_finite,
)
from .test_pretrain_gpt import PRINTED, TELEMETRY, TP2, assert_resumed_repeats

heads = pytest.mark.parametrize("head", heads_for_this_environment())

ALPHA = 0.3
IDS = ["--del-digit-token-ids", *DIGIT_IDS]
COMMON = TINY_GPT + MOCK_DATA + TP2
ARMS = {
    "stock": [],
    "ce": ["--numerical-loss", "ce", *IDS],
    "del": ["--numerical-loss", "del", "--del-alpha", str(ALPHA), *IDS],
}


def arm(trainer, name: str, extra=()):
    """One run of `trainer` (the drop-in, or the patched script) on the head; the DEL arm saves
    a torch checkpoint at 5 and 10."""
    saving = []
    if name == "del":
        saving = ["--save", str(trainer.path("ckpt")), "--save-interval", "5"]
        saving += ["--ckpt-format", "torch"]
    run = trainer.run(f"head-{name}", COMMON + ARMS[name] + saving + list(extra))
    assert run.returncode == 0 and sorted(run.iterations) == list(range(1, 11)), run.log[-3000:]
    return run


@heads
def test_the_drop_in_trains_the_del_arm_as_ce_plus_weight_times_term(trainers, head):
    trainer = trainers(head, "drop-in")
    stock, numerical = arm(trainer, "stock"), arm(trainer, "del")
    first = numerical.iterations[1]
    assert first["del weight"] == pytest.approx(ALPHA, rel=PRINTED)
    expected = first["ce loss"] + first["del weight"] * first["del term"]
    assert first["lm loss"] == pytest.approx(expected, rel=PRINTED)
    assert first["del term"] > 0 and first["lm loss"] > first["ce loss"]
    # the same weights and batch as the stock run: its CE is stock's loss
    assert first["ce loss"] == pytest.approx(stock.iterations[1]["lm loss"], rel=PRINTED)
    for entries in numerical.iterations.values():
        assert all(key in entries and is_finite(entries[key]) for key in TELEMETRY), entries


@heads
def test_the_control_arm_trains_stock_pretrain_gpts_loss(trainers, head):
    trainer = trainers(head, "drop-in")
    stock, control = arm(trainer, "stock"), arm(trainer, "ce")
    for step, entries in stock.iterations.items():
        assert control.iterations[step]["lm loss"] == pytest.approx(
            entries["lm loss"], rel=PRINTED
        ), step
        assert control.iterations[step]["ce loss"] == control.iterations[step]["lm loss"]
    assert "digit acc" in control.iterations[1] and "del term" not in control.iterations[1]


@heads
def test_a_resume_from_iteration_5_repeats_iterations_6_to_10(trainers, head):
    trainer = trainers(head, "drop-in")
    whole = arm(trainer, "del")
    load = ["--load", str(trainer.path("ckpt")), "--ckpt-step", "5", "--ckpt-format", "torch"]
    resumed = trainer.run("head-del-resumed", COMMON + ARMS["del"] + load)
    assert_resumed_repeats(whole, resumed, ("lm loss", "ce loss", "del term", "grad norm"))


@heads
def test_the_patch_applies_where_one_does_and_trains_what_the_drop_in_trains(trainers, head):
    """main: core_v0.19.0's patch applies (lines shifted) and its DEL arm prints what the
    drop-in prints, every line; dev: no patch applies (its __main__ changed), the drop-in is
    the route there, as README says."""
    tree = trainers(head, "drop-in").tree
    patch = applying_patch(tree, head)
    if head.startswith("dev-"):
        assert patch is None
        readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
        assert "dev` (2026-08-21): the drop-in" in readme
        return
    assert patch is not None and patch.name == "megatron-lm-core_v0.19.0-pretrain_gpt.patch"
    drop_in = arm(trainers(head, "drop-in"), "del")
    patched = trainers(head, "patched").run("head-del", COMMON + ARMS["del"])
    assert patched.returncode == 0, patched.log[-3000:]
    assert patched.iterations == drop_in.iterations


ROLL_PROBE = """
import json, sys, torch
from megatron.core.transformer import multi_token_prediction as mtp
from del_megatron.megatron.capture import MtpHeads, rolls_a_list
mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 0.0]])
labels = torch.zeros(2, 5, dtype=torch.long)
out = {"file": mtp.__file__, "takes_a_list": rolls_a_list(mtp.roll_tensor)}
try:
    mtp.roll_tensor(mask, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None)
    out["one_tensor"] = "accepted"
except Exception as error:
    out["one_tensor"] = f"{type(error).__name__}: {error}"
heads = MtpHeads(mask)
rolled = [heads.next_head(object(), labels)[1].tolist() for _ in range(2)]
out["rolled"], out["depth"] = rolled, heads.depth
print(json.dumps(out))
"""


@heads
def test_the_mtp_loss_mask_roll_uses_the_heads_own_roll_tensor(trainers, head):
    """MtpHeads.next_head with the head's megatron.core first on the path: each MTP head's
    loss mask is the last one rolled one position left, zero-filled, whichever signature the
    head's roll_tensor has (dev's takes a list: #6246, where one tensor is refused)."""
    tree = trainers(head, "drop-in").tree
    env = cpu_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", ROLL_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(tree))
    assert got["rolled"] == [
        [[1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]],
        [[0.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]],
    ]
    assert got["depth"] == 2
    assert got["takes_a_list"] is head.startswith("dev-")
    if head.startswith("dev-"):
        assert got["one_tensor"] != "accepted"  # the call our roll made before
    else:
        assert got["one_tensor"] == "accepted"
