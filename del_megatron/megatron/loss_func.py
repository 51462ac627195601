"""The loss function side, and the weight a step puts on the term.

The model hands the framework's loss function a [b, s] per-token loss; the loss function has the
loss mask and, in a counted step, the step's digit targets. So the weight on the term is set
here, once (`term_weight`): alpha / digit_share for the "token" reduction, alpha x the scope's
loss.digit_term_scale for the "digit" one (the step's counts inside a DigitAccounting step,
else the micro-batch's own). The wrappers of Megatron-LM's, Bridge's and NeMo's loss functions
find the parts behind the model's loss (registration.find), compose CE + weight x term before the
framework's own masked sum (so its NaN/spike checks and 'lm loss' see the real loss) and add the
report entries (telemetry.py). A loss the hook did not compute stops a run that asks for a
numerical loss.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from ..config import NumericalLossConfig
from ..loss import LossParts, digit_term_scale
from . import accounting
from . import registration as reg
from .groups import unwrapped_model
from .telemetry import report_entries


def model_loss(parts: LossParts, cfg: NumericalLossConfig) -> torch.Tensor:
    """[b, s] the loss the model returns: CE_t + token_weight x term_t, the token form
    (NumericalLossConfig.token_weight). It is the trained loss where no loss function of ours
    sees it (the token reduction, MTP heads); the "digit" reduction's loss function trains
    `reduced_loss` from the same parts instead."""
    return parts.token_loss(cfg.token_weight)


def term_weight(
    mask: torch.Tensor, parts: LossParts, cfg: NumericalLossConfig
) -> Union[float, torch.Tensor]:
    """The weight the step puts on each digit target's term, set here once: alpha / digit_share
    for the "token" reduction, 0 for "ce", and for the "digit" one alpha x the scope's
    loss.digit_term_scale ([] on the device: the step's counts inside a DigitAccounting step,
    else this micro-batch's own). mask: [b, s] float, this micro-batch's loss tokens."""
    if not cfg.counts_digits:
        return cfg.term_weight()
    n_tokens = mask.sum()
    step = accounting.active()
    if step is not None:
        scale = step.term_scale(n_tokens).to(n_tokens)
    else:
        scale = digit_term_scale(n_tokens, (parts.digit_count * mask).sum())
    return cfg.term_weight(scale)


def reduced_loss(loss_mask: torch.Tensor, rec: reg.Record) -> torch.Tensor:
    """[b, s] the per-token loss the framework's masked sum and normalisation turn into the
    run's reduction: CE_t + term_weight x term_t. The token form the model returned already is
    that for every reduction but "digit"; for "digit" it is composed from the parts in its
    place."""
    cfg, output = rec.cfg, rec.output
    if not cfg.counts_digits:
        return output
    mask = loss_mask.reshape(output.shape).to(rec.parts.term.dtype)
    return rec.parts.token_loss(term_weight(mask, rec.parts, cfg)).to(output.dtype)


UNREDUCED = (
    "del_megatron: a training micro-batch's loss never reached del_megatron's loss function, so "
    "the 'digit' reduction was not applied (it trained alpha x the digit share on the mean "
    "term, not alpha). Pass forward_step_func=numerical_forward_step to Bridge's pretrain() / "
    "finetune() (or wrap your forward step with make_forward_step), call "
    "del_megatron.megatron.numerical_loss_func(loss_mask, output) in your own loop, or use "
    "reduction='token' with digit_share"
)


def expect_reduction(loss: torch.Tensor, cfg: NumericalLossConfig) -> None:
    """Where the registration requires our loss function, stop at a training micro-batch
    whose predecessor's loss it never saw (the "digit" reduction would go unapplied)."""
    registration = reg.current()
    if registration is None or not registration.loss_func_required:
        return
    if cfg.reduction != "digit" or not torch.is_grad_enabled():
        return
    if registration.unreduced is not None:
        registration.unreduced = None
        raise RuntimeError(UNREDUCED)
    registration.unreduced = loss


def reduced_by_loss_func(output: torch.Tensor) -> None:
    """Mark the model's `output` as seen by our loss function (expect_reduction's check)."""
    registration = reg.current()
    if registration is not None and registration.unreduced is output:
        registration.unreduced = None


# Marks the functions make_loss_func (and lm.install's forward_step wrapper) made.
WRAPPED = "_del_megatron"

NOT_RECORDED = (
    "del_megatron: the loss function got a loss del_megatron's hook did not compute, in a run "
    "for the numerical loss {loss!r} (a fused cross-entropy that bypasses "
    "LanguageModule.compute_language_model_loss, a schedule that hands the loss function a "
    "copy, or a model class the hook does not cover), so this step would train plain "
    "cross-entropy: stopped before it does. docs/support.md says what is supported"
)


def _expected_loss(model: Any) -> Optional[str]:
    if reg.current() is None:
        return None
    cfg = reg.of_model(unwrapped_model(model))
    return None if cfg is None else cfg.loss


def check_recorded(rec: Optional[reg.Record], loss: Optional[str]) -> None:
    """Stop a run whose loss function sees a loss del_megatron did not compute while the run
    asks for a numerical loss (`loss` other than None or "ce"). It raises rather than warns:
    such a step trains plain cross-entropy, and a run that does so silently wastes its compute;
    no supported configuration reaches the loss function with an unrecorded loss."""
    if rec is None and loss not in (None, "ce"):
        raise RuntimeError(NOT_RECORDED.format(loss=loss))


def reduce_recorded(loss_mask: torch.Tensor, rec: reg.Record) -> torch.Tensor:
    """reduced_loss, the recorded loss marked as seen by our loss function (expect_reduction's
    check)."""
    reduced_by_loss_func(rec.output)
    return reduced_loss(loss_mask, rec)


def apply_to_loss(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    base: Callable[[torch.Tensor], tuple],
    model: Any = None,
) -> tuple:
    """Run a framework loss `base(per_token_losses) -> (loss_sum, num_tokens, report)` on the
    "digit"-reduced losses and add the telemetry entries. Outputs the hook did not record go to
    `base` unchanged, unless the run asks for a numerical loss (the registration's, else
    `model`'s config): then it stops (check_recorded)."""
    rec = reg.find(output_tensor)
    if rec is None:  # the model computed its loss without del_megatron
        check_recorded(rec, _expected_loss(model))
        return base(output_tensor)
    result = base(reduce_recorded(loss_mask, rec))
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[2], dict)):
        raise ValueError(
            "del_megatron needs a loss function returning (loss_sum, num_tokens, report), as "
            "Megatron-LM's pretrain_gpt.py (core 0.12 on) and Megatron-Bridge's do"
        )
    loss, num_tokens, report = result
    entries = report_entries(loss_mask, rec)
    registration = reg.current()
    watch = registration.share_watch if registration is not None else None
    if watch is not None and torch.is_grad_enabled():  # training micro-batches only
        watch.observe(*entries["digit share"])
    return loss, num_tokens, {**report, **entries}


def make_loss_func(base_loss_func: Callable) -> Callable:
    """Wrap a Megatron-LM loss_func(loss_mask, output_tensor, model=None) -> (loss_sum,
    num_tokens, report) with the "digit" reduction and the telemetry (see apply_to_loss). A
    loss_func this function made is returned as it is: wrapped twice, the outer wrapper would
    hand the inner one a reduced loss that no record matches."""
    if getattr(base_loss_func, WRAPPED, False):
        return base_loss_func

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None, **kwargs):
        return apply_to_loss(
            loss_mask,
            output_tensor,
            lambda losses: base_loss_func(loss_mask, losses, model=model, **kwargs),
            model,
        )

    setattr(loss_func, WRAPPED, True)
    return loss_func


def _plain_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Megatron-LM's pretrain_gpt loss_func without its NaN/spike checks (those need args)."""
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


numerical_loss_func = make_loss_func(_plain_loss_func)
