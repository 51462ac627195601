"""The loss hook on a real GPTModel: the same loss as numerical_lm_loss on its logits,
gathered logits, MTP heads, register / unregister."""

from __future__ import annotations

import torch

import del_megatron as dm
from del_megatron import megatron as dmm

from ..cases import TOKEN_FORM
from ..gpt_helpers import GPT_VOCAB, build_gpt, number_batch
from .config import CFG


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def check_hook_equals_numerical_lm_loss(tp: int) -> None:
    """The registered model's per-token loss equals numerical_lm_loss on its own logits."""
    tokens, labels, positions = number_batch(2, seed=0)
    for sp in (False, True) if tp > 1 else (False,):
        model = build_gpt(tp, sequence_parallel=sp)
        dmm.register(CFG)
        try:
            loss = model(tokens, positions, None, labels=labels)
            logits = model(tokens, positions, None).transpose(0, 1)  # [s, b, V/tp]
            assert logits.size(-1) * tp == model.vocab_size
            expected = dm.numerical_lm_loss(
                labels, logits, CFG, dm.VocabParallelLayout(tp_group=_tp_group())
            )
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
            parts = dm.numerical_lm_loss(labels, logits, CFG, _tp_group(), return_parts=True)
            assert parts.is_digit.sum() > 10 and (parts.term > 0).sum() > 10
        finally:
            dmm.unregister()


def check_parallel_output_false(tp: int) -> None:
    """Gathered logits (parallel_output=False) are recognised: same loss as sharded ones."""
    tokens, labels, positions = number_batch(2, seed=1)
    dmm.register(CFG)
    try:
        sharded = build_gpt(tp)(tokens, positions, None, labels=labels)
        gathered = build_gpt(tp, parallel_output=False)(tokens, positions, None, labels=labels)
    finally:
        dmm.unregister()
    torch.testing.assert_close(gathered, sharded, rtol=1e-6, atol=1e-6)


def check_mtp_goes_through_del(tp: int) -> None:
    """With MTP, the MTP head's loss is computed by the hook too: its parameters' gradients
    change when the loss changes from 'ce' to 'del' (they see no other loss)."""
    tokens, labels, positions = number_batch(2, seed=2)
    grads = {}
    for loss in ("ce", "del"):
        model = build_gpt(tp, mtp_layers=1)
        model.train()
        dmm.register(dm.NumericalLossConfig(loss=loss, alpha=0.5, vocab=GPT_VOCAB, **TOKEN_FORM))
        try:
            out = model(tokens, positions, None, labels=labels)
            out.mean().backward()
        finally:
            dmm.unregister()
        grads[loss] = {n: p.grad.clone() for n, p in model.named_parameters() if "mtp" in n}
    assert grads["ce"], "model has no MTP parameters"
    differ = [n for n in grads["ce"] if not torch.allclose(grads["ce"][n], grads["del"][n])]
    assert differ, "MTP gradients do not depend on the numerical loss"


def check_register_cycle(tp: int) -> None:
    """register / unregister / register: the original method comes back exactly, and the
    loss is Megatron's own after unregister and ours after register again."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt import GPTModel

    original = LanguageModule.compute_language_model_loss
    original_forward = GPTModel.forward
    tokens, labels, positions = number_batch(2, seed=3)
    model = build_gpt(tp)
    megatron_loss = model(tokens, positions, None, labels=labels)
    dmm.register(CFG)
    dmm.register(CFG)  # idempotent
    assert dmm.is_registered()
    ours = model(tokens, positions, None, labels=labels)
    dmm.unregister()
    assert LanguageModule.compute_language_model_loss is original and not dmm.is_registered()
    assert GPTModel.forward is original_forward
    torch.testing.assert_close(model(tokens, positions, None, labels=labels), megatron_loss)
    dmm.register(CFG)
    again = model(tokens, positions, None, labels=labels)
    dmm.unregister()
    dmm.unregister()  # idempotent
    torch.testing.assert_close(again, ours)
    assert not torch.allclose(ours, megatron_loss)
    # loss="ce" through the hook equals Megatron's own CE
    dmm.register(dm.NumericalLossConfig(loss="ce"))
    try:
        torch.testing.assert_close(
            model(tokens, positions, None, labels=labels), megatron_loss, rtol=1e-6, atol=1e-6
        )
    finally:
        dmm.unregister()
