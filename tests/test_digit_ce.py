"""digit_ce, the control for "any extra weight on digits" (docs/DEL.md): mean CE + alpha x the
mean CE over the digit targets, against a hand sum in fp64 Python floats (value and gradient,
both reductions), at TP 2 against TP 1 on gloo, through the linear kernel, and in the report."""

import math

import pytest
import torch

import del_megatron as dm
from del_megatron import megatron as dmm
from del_megatron.loss import loss_parts
from del_megatron.megatron import registration as reg

from . import digit_ce_workers as workers


def hand_sum(labels, logits, alpha: float):
    """(loss, d loss / d logits) by hand: loss = sum CE / n_tokens + alpha x sum of the digit
    targets' CE / n_digits; at a digit target the gradient is CE's, softmax - onehot, times
    (1 + alpha x n_tokens / n_digits), divided by n_tokens like every other row's."""
    rows = [(t, b) for b in range(labels.size(0)) for t in range(labels.size(1))]
    kept = [(t, b) for t, b in rows if int(labels[b, t]) != workers.IGNORE]
    digits = [(t, b) for t, b in kept if int(labels[b, t]) in workers.DIGITS]
    n_tokens, n_digits = len(kept), len(digits)
    grad = torch.zeros_like(logits, dtype=torch.float64)
    loss = 0.0
    for t, b in kept:
        z = logits[t, b].tolist()
        top = max(z)
        total = sum(math.exp(v - top) for v in z)
        label = int(labels[b, t])
        ce = top + math.log(total) - z[label]
        factor = 1.0 + (alpha * n_tokens / n_digits if (t, b) in digits else 0.0)
        loss += ce * factor / n_tokens
        for k, v in enumerate(z):
            grad[t, b, k] = (math.exp(v - top) / total - (k == label)) * factor / n_tokens
    return loss, grad, n_tokens, n_digits


@pytest.mark.parametrize("reduction", ["digit", "token"])
def test_value_and_gradient_are_the_hand_sum(reduction):
    labels, logits = workers.batch(seed=4)
    alpha = 0.38
    want, want_grad, n_tokens, n_digits = hand_sum(labels, logits, alpha)
    assert 0 < n_digits < n_tokens
    share = {"digit_share": n_digits / n_tokens} if reduction == "token" else {}
    cfg = dm.NumericalLossConfig(
        loss="digit_ce",
        alpha=alpha,
        vocab=workers.VOCAB,
        reduction=reduction,
        ignore_index=workers.IGNORE,
        **share,
    )
    x = logits.clone().requires_grad_(True)
    per_token = dm.numerical_lm_loss(labels, x, cfg)
    got = per_token.sum() / n_tokens
    got.backward()
    assert got.item() == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(x.grad, want_grad, rtol=1e-12, atol=1e-15)
    # at a digit target: CE's gradient x (1 + alpha x tokens / digit targets)
    parts = loss_parts(labels, logits, cfg)
    t, b = next(
        (t, b)
        for b in range(labels.size(0))
        for t in range(labels.size(1))
        if bool(parts.is_digit[b, t])
    )
    ce_grad = torch.softmax(logits[t, b], -1) - torch.nn.functional.one_hot(
        labels[b, t], logits.size(-1)
    )
    torch.testing.assert_close(
        x.grad[t, b], ce_grad * (1 + alpha * n_tokens / n_digits) / n_tokens, rtol=1e-12, atol=0
    )
    # the term is CE itself at the digit targets, 0 elsewhere
    torch.testing.assert_close(parts.term, parts.ce * parts.is_digit, rtol=0, atol=0)


def test_alpha_0_is_cross_entropy_and_the_linear_kernel_agrees():
    labels, logits = workers.batch(seed=6)
    hidden, weight = workers.hidden_and_weight(labels, seed=6)
    mask = (labels != workers.IGNORE).double()
    cfg = dm.NumericalLossConfig(
        loss="digit_ce", alpha=0.5, vocab=workers.VOCAB, ignore_index=workers.IGNORE
    )
    plain = dm.NumericalLossConfig(
        loss="digit_ce", alpha=0.0, vocab=workers.VOCAB, ignore_index=workers.IGNORE
    )
    ce = torch.nn.functional.cross_entropy(
        logits.transpose(0, 1).reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        ignore_index=workers.IGNORE,
        reduction="none",
    ).view(labels.shape)
    torch.testing.assert_close(dm.numerical_lm_loss(labels, logits, plain), ce, rtol=1e-12, atol=0)
    # the linear kernel with a loss mask forms digit_ce's gradients in backward: the same as
    # the materialised logits' (its forward route would need CE's gradient proportional to it)
    grads = []
    for linear in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if linear:
            out = dm.numerical_linear_loss(
                h, w, labels, cfg, loss_mask=mask, weight_gradient="forward"
            )
        else:
            out = dm.numerical_lm_loss(labels, h @ w.T, cfg)
        (out * mask).sum().backward()
        grads.append((out.detach(), h.grad, w.grad))
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_tensor_parallel_2_equals_1(gloo):
    gloo(2).run(workers.tp_equals_whole_vocab, 0.38)


def test_the_report_names_its_term_and_weight():
    """Megatron-LM's report entries under digit_ce: `digit_ce term` is the mean CE over the
    digit targets and `digit_ce weight` alpha; `lm loss` = `ce loss` + weight x term."""
    labels, logits = workers.batch(seed=8)
    mask = (labels != workers.IGNORE).float()
    cfg = dm.NumericalLossConfig(
        loss="digit_ce", alpha=0.38, vocab=workers.VOCAB, ignore_index=workers.IGNORE
    )
    parts = loss_parts(labels, logits, cfg)
    dmm.register(cfg)
    try:
        output = parts.token_loss(cfg.token_weight)
        reg.record(output, parts, cfg)
        report = dmm.numerical_loss_func(mask, output)[2]
    finally:
        dmm.unregister()
    digit = parts.is_digit & (mask > 0)
    mean = lambda entry: (report[entry][0] / report[entry][1]).item()  # noqa: E731
    assert mean("digit_ce term") == pytest.approx(parts.ce[digit].mean().item(), rel=1e-6)
    assert mean("digit_ce weight") == pytest.approx(0.38, rel=1e-6)
    assert mean("lm loss") == pytest.approx(
        mean("ce loss") + 0.38 * mean("digit_ce term"), rel=1e-6
    )
