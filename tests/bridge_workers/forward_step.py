"""Bridge's forward step with DEL: the token reduction (materialised and logits-free), the digit
reduction over a step of two micro-batches (our forward steps stacked too), and the refusal of a
model whose config names no loss."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .fixtures import ALPHA, batches, reference_parts


def _floats(report: dict) -> dict:
    return {k: [float(x) for x in v] for k, v in report.items()}


def token_reduction(state, model, batch, vocab) -> Dict[str, Any]:
    """One micro-batch through the real forward_step, with the fp64 reference's sums."""
    from del_megatron.megatron.bridge import numerical_forward_step

    ref = reference_parts(model, batch, vocab)
    output, loss_function = numerical_forward_step(state, iter([dict(batch)]), model)
    loss_sum, num_tokens, report = loss_function(output)
    mask = batch["loss_mask"].double()
    return {
        "loss_sum": float(loss_sum),
        "num_tokens": int(num_tokens),
        "report": _floats(report),
        "ref_ce_sum": float((ref["ce"] * mask).sum()),
        "ref_term_sum": float((ref["term"] * mask).sum()),
        "ref_digits": float(
            ((batch["labels"] >= 2) & (batch["labels"] <= 11)).double().mul(mask).sum()
        ),
        "ref_tokens": float(mask.sum()),
    }


def logits_free_token_reduction(state, model, batch, provider, tokenizer) -> Dict[str, Any]:
    """The same micro-batch logits-free (enable_numerical_loss(logits_free=True)): the output
    layer forms no logits; loss and telemetry as in token_reduction. The provider is set back
    to the materialised loss after."""
    from del_megatron.megatron.bridge import enable_numerical_loss, numerical_forward_step
    from del_megatron.megatron.groups import unwrapped_model

    enable_numerical_loss(
        provider,
        tokenizer,
        loss="del",
        alpha=ALPHA,
        reduction="token",
        digit_share=1.0,
        logits_free=True,
    )
    output_layer = unwrapped_model(model).output_layer
    calls, layer_forward = [], output_layer.forward
    output_layer.forward = lambda *a, **kw: calls.append(1) or layer_forward(*a, **kw)
    try:
        output, loss_function = numerical_forward_step(state, iter([dict(batch)]), model)
        loss_sum, num_tokens, report = loss_function(output)
    finally:
        output_layer.forward = layer_forward
    result = {
        "loss_sum": float(loss_sum),
        "report": _floats(report),
        "logits_formed": len(calls),
        "config_field": getattr(unwrapped_model(model).config, "del_logits_free", None),
    }
    enable_numerical_loss(
        provider, tokenizer, loss="del", alpha=ALPHA, reduction="token", digit_share=1.0
    )
    return result


def digit_reduction_step(
    state, model, provider, tokenizer, vocab
) -> Tuple[Dict[str, Any], Dict[str, float], Dict[str, Any]]:
    """The digit reduction over a step of 2 micro-batches (step accounting made on the first
    forward step, from the model's process groups; Megatron normalises each micro-batch by its
    tokens and the number of micro-batches), against the reference: (digit, stacked,
    digit_ce), where stacked is the same step through forward steps of ours stacked and
    digit_ce the step with the control loss."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from del_megatron.megatron.bridge import enable_numerical_loss

    init_num_microbatches_calculator(0, None, 4, 2, 1)  # 2 micro-batches of 2
    enable_numerical_loss(provider, tokenizer, loss="del", alpha=ALPHA, reduction="digit")
    step = batches(2, seed=1)
    digit = _digit_step_loss(state, model, step, vocab)
    stacked = stacked_forward_steps(state, model, step)
    enable_numerical_loss(provider, tokenizer, loss="digit_ce", alpha=ALPHA, reduction="digit")
    digit_ce = _digit_step_loss(state, model, step, vocab, "digit_ce")
    enable_numerical_loss(provider, tokenizer, loss="del", alpha=ALPHA, reduction="digit")
    destroy_num_microbatches_calculator()
    return digit, stacked, digit_ce


def _digit_step_loss(state, model, step, vocab, loss: str = "del") -> Dict[str, float]:
    from del_megatron.megatron.bridge import numerical_forward_step

    iterator = iter([dict(b) for b in step])
    normalised = 0.0
    for _ in step:
        output, loss_function = numerical_forward_step(state, iterator, model)
        loss_sum, num_tokens, report = loss_function(output)
        normalised += float(loss_sum) / float(num_tokens) / 2
    refs = [reference_parts(model, b, vocab, loss) for b in step]
    masks = [b["loss_mask"].double() for b in step]
    digits = sum(
        float((((b["labels"] >= 2) & (b["labels"] <= 11)).double() * m).sum())
        for b, m in zip(step, masks, strict=True)
    )
    ce_means = [float((r["ce"] * m).sum() / m.sum()) for r, m in zip(refs, masks, strict=True)]
    term_sum = sum(float((r["term"] * m).sum()) for r, m in zip(refs, masks, strict=True))
    return {
        "step_loss": normalised,
        "ref_step_loss": sum(ce_means) / 2 + ALPHA * term_sum / digits,
        "report_keys": sorted(report),
    }


def stacked_forward_steps(state, model, step) -> Dict[str, float]:
    """The step through forward steps of ours stacked: wrapped again, and called inside a
    user's forward step that is wrapped in turn. Each step is counted once and the loss
    function wrapped once, as Megatron-LM's drop-in over a patched pretrain_gpt.py."""
    from del_megatron.megatron.bridge import make_forward_step, numerical_forward_step

    def users_forward_step(state, data_iterator, model, return_schedule_plan=False):
        return numerical_forward_step(state, data_iterator, model, return_schedule_plan)

    stacked_losses = {}
    for name, stacked in (
        ("ours wrapped again", make_forward_step(numerical_forward_step)),
        ("inside a user's, wrapped", make_forward_step(users_forward_step)),
    ):
        iterator, total = iter([dict(b) for b in step]), 0.0
        for _ in step:
            output, loss_function = stacked(state, iterator, model)
            loss_sum, num_tokens, report = loss_function(output)
            total += float(loss_sum) / float(num_tokens) / 2
        stacked_losses[name] = total
    return stacked_losses


def refused_without_registration(state, model, batch) -> Optional[str]:
    """A model whose config names no loss is refused by the forward step (not run as CE): the
    message, or None where it ran."""
    from del_megatron.megatron import unregister
    from del_megatron.megatron.bridge import numerical_forward_step

    unregister()
    try:
        numerical_forward_step(state, iter([dict(batch)]), model)
        return None
    except RuntimeError as err:
        return str(err)
