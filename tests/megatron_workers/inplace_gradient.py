"""fp32 logits take their gradient in place, where nothing else reads them after the loss."""

from __future__ import annotations

import torch

from del_megatron import megatron as dmm

from ..gpt_helpers import build_gpt, number_batch
from .config import CFG


def _logits_and_their_gradients(model, args, labels, upstream, cfg=CFG):
    """One forward/backward of `model` with the hook registered: the loss, every parameter's
    gradient, and for each call of the output layer its logits and (data_ptr, copy) of the
    gradient autograd handed them."""
    calls = []
    layer_forward = model.output_layer.forward

    def capturing(*a, **kw):
        logits, bias = layer_forward(*a, **kw)
        call = {"logits": logits}
        logits.register_hook(lambda grad: call.update(grad=(grad.data_ptr(), grad.clone())))
        calls.append(call)
        return logits, bias

    model.output_layer.forward = capturing
    dmm.register(cfg)
    try:
        loss = model(*args, labels=labels)
        (loss * upstream).sum().backward()
    finally:
        dmm.unregister()
        model.output_layer.forward = layer_forward
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, calls


def _in_place(call) -> bool:
    return call["grad"][0] == call["logits"].data_ptr()


def check_fp32_logits_take_their_gradient_in_place(tp: int) -> None:
    """Audit G5: the main head's fp32 logits (an fp32 run; Megatron-LM dev's
    --output-logit-dtype fp32) get their gradient written over them, one [s, b, V/tp] fp32
    buffer as in Megatron's own cross-entropy, not a second one; loss, logits' gradient and
    every parameter's gradient equal the loss's without inplace. Logits something else reads
    after the loss keep theirs: an MTP head's (Megatron counts its accepted tokens from them),
    and any under a forward hook of the output layer (distillation's logit capture)."""
    from del_megatron.megatron import hook

    tokens, labels, positions = number_batch(2, seed=41)
    args, upstream = (tokens, positions, None), torch.rand(labels.shape)
    ours = _logits_and_their_gradients(build_gpt(tp), args, labels, upstream)
    spent = getattr(hook, "_logits_spent_by_the_loss", None)
    hook._logits_spent_by_the_loss = lambda *a: False
    try:
        want = _logits_and_their_gradients(build_gpt(tp), args, labels, upstream)
    finally:
        if spent is None:
            del hook._logits_spent_by_the_loss
        else:
            hook._logits_spent_by_the_loss = spent
    assert [_in_place(c) for c in ours[2]] == [True], "main head's gradient not in place"
    assert [_in_place(c) for c in want[2]] == [False]
    torch.testing.assert_close(ours[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[2][0]["grad"][1], want[2][0]["grad"][1], rtol=1e-6, atol=1e-7)
    assert ours[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # MTP: one call of the output layer for the MTP head, then the main head's
    mtp = _logits_and_their_gradients(build_gpt(tp, mtp_layers=1), args, labels, upstream)
    assert [_in_place(c) for c in mtp[2]] == [False, True], "MTP logits overwritten"
    model = build_gpt(tp)
    captured = []
    model.output_layer.register_forward_hook(lambda module, i, out: captured.append(out[0]))
    hooked = _logits_and_their_gradients(model, args, labels, upstream)
    assert [_in_place(c) for c in hooked[2]] == [False], "logits a forward hook holds overwritten"
    torch.testing.assert_close(hooked[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(captured[0], want[2][0]["logits"], rtol=0, atol=0)
