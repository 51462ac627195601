"""The Megatron-LM drop-in pieces: the model-provider wrapper, loss_func install, the patches."""

import argparse
import re
import types
from functools import partial
from pathlib import Path

import pytest
import torch

import del_megatron as dm
from del_megatron import megatron as dmm
from del_megatron.loss import loss_parts
from del_megatron.megatron import lm
from del_megatron.megatron import loss_func as dm_loss_func
from del_megatron.megatron import registration as reg
from del_megatron.megatron.accounting import DigitAccounting
from del_megatron.reference import reference_lm_loss

from .gpt_helpers import GPT_VOCAB, build_gpt, number_batch
from .megatron_workers.toy_tokenizer import _ToyDigitTokenizer

PATCHES = sorted((Path(__file__).parents[1] / "patches").glob("*.patch"))


def _args(argv):
    parser = argparse.ArgumentParser()
    dmm.add_arguments(parser)
    args = parser.parse_args(argv)
    args.padded_vocab_size = 128
    return args


def check_wrapped_model_provider():
    """The wrapped provider reads the flags and the run's tokenizer and registers the loss; the
    model reads its settings from the registration (nothing is written on its config), and
    its loss is then DEL."""
    args = _args(["--numerical-loss", "del", "--del-alpha", "0.5"])
    provider = lm.wrap_model_provider(lambda: build_gpt(1), lambda: args, _ToyDigitTokenizer)
    model = provider()
    try:
        assert dmm.is_registered()
        assert not hasattr(model.config, "numerical_loss")
        assert reg.of_model(model) is reg.current().cfg
        assert reg.of_model(model).vocab.digit_ids == GPT_VOCAB.digit_ids
        tokens, labels, positions = number_batch(2, seed=5)
        loss = model(tokens, positions, None, labels=labels)
        logits = model(tokens, positions, None).transpose(0, 1)
        cfg = dm.NumericalLossConfig(alpha=0.5, vocab=GPT_VOCAB)
        # the model returns the per-token form; the loss function averages the term
        expected = dm.loss_parts(labels, logits, cfg).token_loss(cfg.token_weight)
        torch.testing.assert_close(loss, expected)
    finally:
        dmm.unregister()
    plain = lm.wrap_model_provider(lambda: build_gpt(1), lambda: _args([]), _ToyDigitTokenizer)
    plain()
    assert not dmm.is_registered()


def test_wrapped_model_provider(gloo):
    gloo(1).run(check_wrapped_model_provider)


def test_install_wraps_loss_func_and_forward_step_once():
    calls = []

    def loss_func(loss_mask, output_tensor, model=None):
        calls.append(output_tensor)
        return output_tensor.sum(), loss_mask.sum(), {"lm loss": torch.zeros(2)}

    def forward_step(data_iterator, model, return_schedule_plan=False):
        return next(data_iterator), model

    module = types.SimpleNamespace(loss_func=loss_func, forward_step=forward_step)
    lm.install(module)
    first, first_forward_step = module.loss_func, module.forward_step
    lm.install(module)
    assert module.loss_func is first and first is not loss_func
    assert module.forward_step is first_forward_step and first_forward_step is not forward_step
    out = torch.ones(1, 2)
    assert first(torch.ones(1, 2), out)[0].item() == 2 and calls == [out]
    # Without a step-wide "digit" reduction the iterator passes through untouched.
    assert module.forward_step(iter([7]), "model") == (7, "model")


# ids 0..9 digits, 10 '.', vocab 16
VOCAB = dm.DigitVocab(range(10), [10])


def _micro_batch(labels, mask, seed):
    logits = torch.randn(
        len(labels[0]), 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    return {"labels": torch.tensor(labels), "loss_mask": torch.tensor(mask), "logits": logits}


def test_the_drop_in_over_a_patched_pretrain_gpt_wraps_and_counts_once():
    """lm.install over a pretrain_gpt.py our patch already wrapped (the Docker image's tree, run
    with the drop-in): loss_func keeps its one wrapper, forward_step's iterator is counted once a
    step, and the "digit" reduction gives mean CE + alpha x the step's term / its digits."""
    cfg = dm.NumericalLossConfig(loss="del", alpha=0.2, vocab=VOCAB, reduction="digit")
    counts = []

    class Counting(DigitAccounting):
        def count(self, batches, microbatches=None):
            counts.append(len(batches))  # one all-reduce of the step's counts each
            super().count(batches, microbatches)

    module = types.SimpleNamespace()

    def forward_step(data_iterator, model):  # the patched pretrain_gpt.forward_step
        data_iterator = lm.counted(data_iterator, model)
        batch = next(data_iterator)
        parts = loss_parts(batch["labels"], batch["logits"], dm.NumericalLossConfig(vocab=VOCAB))
        output = parts.token_loss(cfg.alpha)
        reg.record(output, parts, cfg)  # as the loss hook does
        return output, partial(module.loss_func, batch["loss_mask"], model=model)

    patched_loss_func = lm.make_loss_func(dm_loss_func._plain_loss_func)
    module.loss_func, module.forward_step = patched_loss_func, forward_step
    lm.install(module)

    # '3', '1', 'x', '7' (7 masked): 3 tokens, 2 digits; 'x', '5', 'y', 'z': 4 tokens, 1 digit.
    batches = [
        _micro_batch([[3, 1, 12, 7]], [[1.0, 1.0, 1.0, 0.0]], seed=1),
        _micro_batch([[12, 5, 13, 14]], [[1.0, 1.0, 1.0, 1.0]], seed=2),
    ]
    groups = types.SimpleNamespace(dp=None, dp_cp=None, tp=None)
    model = types.SimpleNamespace(pg_collection=groups)
    dmm.register(cfg, step_accounting=lambda model: Counting(VOCAB, num_microbatches=2))
    try:
        data, step_loss = iter(batches), 0.0
        for _ in batches:
            output, loss_func = module.forward_step(data, model)
            loss, num_tokens, _ = loss_func(output)
            step_loss += loss.item() / num_tokens.item() / len(batches)  # Megatron's normaliser
    finally:
        dmm.unregister()
    assert module.loss_func is patched_loss_func and module.forward_step is not forward_step
    assert counts == [2]

    # By hand: Megatron's mean CE of each micro-batch over 2 micro-batches, plus alpha times
    # the step's summed term over its 3 digit targets.
    ce_part, term_sum = 0.0, 0.0
    for batch in batches:
        ce, term = reference_lm_loss(batch["labels"], batch["logits"], VOCAB, loss="del")
        mask = batch["loss_mask"].double()
        ce_part += (ce * mask).sum().item() / mask.sum().item() / len(batches)
        term_sum += (term * mask).sum().item()
    assert term_sum > 0
    assert step_loss == pytest.approx(ce_part + cfg.alpha * term_sum / 3, rel=1e-6)


def check_counted_makes_the_step_accounting_on_the_first_step_only():
    made = []

    class Counting:
        def wrap(self, iterator, microbatches=None):
            return (("counted", x) for x in iterator)

    def make_accounting(model):
        made.append(model)
        return Counting()

    cfg = dm.NumericalLossConfig(loss="del", vocab=dm.DigitVocab(range(10)), reduction="digit")
    dmm.register(cfg, step_accounting=make_accounting)
    try:
        assert lm.counted(None, "model") is None and made == ["model"]  # rank without data
        data = iter([1, 2])
        counted = lm.counted(data, "model")
        assert lm.counted(data, "model") is counted and made == ["model"]
        assert lm.counted(counted, "model") is counted  # counted once, however often passed
        assert list(counted) == [("counted", 1), ("counted", 2)]
    finally:
        dmm.unregister()
    assert lm.counted(data, "model") is data  # nothing left behind


def test_counted_makes_the_step_accounting_on_the_first_step_only(gloo):
    gloo(1).run(check_counted_makes_the_step_accounting_on_the_first_step_only)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patches_are_well_formed_and_use_only_the_public_plugin_api(patch):
    text = patch.read_text()
    assert re.search(r"core_v0\.1[6-9]\.\d", patch.name)
    assert text.startswith("diff --git a/pretrain_gpt.py b/pretrain_gpt.py\n")
    hunks = re.findall(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@", text, flags=re.M)
    assert hunks
    # every hunk's line counts match its body
    bodies = re.split(r"^@@ .* @@.*\n", text, flags=re.M)[1:]
    for (_, old_n, _, new_n), body in zip(hunks, bodies, strict=True):
        lines = [ln for ln in body.splitlines() if not ln.startswith("diff --git")]
        old = sum(1 for ln in lines if ln[:1] in (" ", "-"))
        new = sum(1 for ln in lines if ln[:1] in (" ", "+"))
        assert (old, new) == (int(old_n), int(new_n)), patch.name
    # the patch imports one module of ours and uses only names it exports
    assert re.findall(r"^\+from del_megatron\S* import .*$", text, flags=re.M) == [
        "+from del_megatron.megatron import lm as del_lm"
    ]
    for name in set(re.findall(r"del_lm\.(\w+)", text)):
        assert name in lm.__all__, name
    assert "loss_func = del_lm.make_loss_func(loss_func)" in text
    assert "data_iterator = del_lm.counted(data_iterator, model)" in text
    assert "del_lm.help_with_flags(extra_args_provider)" in text
    assert text.rstrip().endswith("+    del_lm.destroy_process_groups()"), "after pretrain()"


def test_destroy_process_groups_destroys_every_group(tmp_path):
    """After pretrain() returns, the scripts destroy the process groups (gloo's threads left to
    interpreter exit can abort a finished run): with a subgroup alive, the default group ends up
    destroyed (torch.distributed has no public check on the subgroups); with none, a no-op."""
    dist = torch.distributed
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        subgroup = dist.new_group([0])
        assert dist.get_world_size(subgroup) == 1
        lm.destroy_process_groups()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    lm.destroy_process_groups()


def test_loss_func_wrapper_signature_matches_megatron_lm():
    # pretrain_gpt's forward_step returns partial(loss_func, loss_mask, model=model)
    wrapped = dm_loss_func.make_loss_func(dm_loss_func._plain_loss_func)
    out = torch.ones(1, 3)
    loss, num_tokens, report = partial(wrapped, torch.ones(1, 3), model=None)(out)
    assert loss.item() == 3 and num_tokens.item() == 3 and "lm loss" in report
