"""The token and digit reductions of the loss Megatron trains, for Megatron-LM, Bridge and NeMo.

Megatron's model returns a per-token loss [b, s] and the framework's loss function reduces it
(masked sum, normalised by loss tokens). So the reduction comes in two halves:

- the model's (`model_loss`): CE_t + token_weight * term_t, the whole "token" reduction
  (token_weight = alpha / digit_share) and the "digit" one's first half (token_weight = alpha);
- the loss function's (`digit_reduced`), which has the loss mask: for the "digit" reduction
  the term is rescaled by loss.digit_term_scale over the scope it is averaged on, the step's
  global counts inside a DigitAccounting step (accounting.py), else the micro-batch's.

`expect_reduction` stops a run whose loss never reaches our loss function when the registration
needs it there.
"""

from __future__ import annotations

import torch

from ..loss import LossParts, NumericalLossConfig, digit_term_scale
from . import accounting, state


def model_loss(parts: LossParts, cfg: NumericalLossConfig) -> torch.Tensor:
    """[b, s] CE_t + token_weight * term_t: the loss the model returns."""
    return parts.token_loss(cfg.token_weight)


def microbatch_term_scale(mask: torch.Tensor, parts: LossParts) -> torch.Tensor:
    """[] the "digit" reduction's scale on this micro-batch's term (mask [b, s] float: its loss
    tokens): the step's, inside a DigitAccounting step, else the micro-batch's own."""
    n_tokens = mask.sum()
    step = accounting.active()
    if step is not None:
        return step.term_scale(n_tokens).to(n_tokens)
    return digit_term_scale(n_tokens, (parts.digit_count * mask).sum())


def digit_reduced(
    loss_mask: torch.Tensor, output: torch.Tensor, parts: LossParts, cfg: NumericalLossConfig
) -> torch.Tensor:
    """The per-token loss [b, s] that the framework's masked sum and normalisation turn into
    cfg's reduction, from the model's `output` (model_loss of `parts`): unchanged for the
    "token" reduction; for the "digit" one CE_t + alpha * term_t * term_scale."""
    if cfg.reduction != "digit":
        return output
    mask = loss_mask.reshape(output.shape).to(parts.term.dtype)
    extra = cfg.alpha * parts.term * (microbatch_term_scale(mask, parts) - 1.0)
    return output + extra.to(output.dtype)


UNREDUCED = (
    "del_megatron: the last training micro-batch's loss never reached del_megatron's loss "
    "function, so the 'digit' reduction (the default) was not applied to it: it trained alpha "
    "x the digit share on the mean digit term instead of alpha. With Megatron-Bridge pass "
    "forward_step_func=numerical_forward_step to pretrain() / finetune() (or wrap your forward "
    "step with make_forward_step); in your own loop call "
    "del_megatron.megatron.numerical_loss_func(loss_mask, output); or use reduction='token' "
    "with digit_share (no loss function of ours needed)"
)


def expect_reduction(loss: torch.Tensor, cfg: NumericalLossConfig) -> None:
    """Where the registration requires our loss function, stop at a training micro-batch
    whose predecessor's loss it never saw (the "digit" reduction would go unapplied)."""
    registration = state.current()
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
    registration = state.current()
    if registration is not None and registration.unreduced is output:
        registration.unreduced = None
