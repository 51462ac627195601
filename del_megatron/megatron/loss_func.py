"""The loss function side: Megatron-LM's, Bridge's and NeMo's loss functions, wrapped.

The wrapper finds the parts behind the loss the hook returned (records.py), applies the "digit"
reduction's second half (reduction.py) before the framework's own masked sum, so that its
NaN/spike checks and 'lm loss' see the real loss, and adds the telemetry entries (telemetry.py).
A loss the hook did not compute stops a run that asks for a numerical loss.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import reduction, settings, state
from .groups import unwrapped_model
from .records import Record, find
from .telemetry import report_entries

# Marks the functions make_loss_func (and lm.install's forward_step wrapper) made.
WRAPPED = "_del_megatron"

NOT_RECORDED = (
    "del_megatron: the loss function got a loss that del_megatron's hook did not compute, in a "
    "run registered for the numerical loss {loss!r}: the model computed it another way (a fused "
    "cross-entropy that bypasses LanguageModule.compute_language_model_loss, a schedule that "
    "hands the loss function a copy, a model class the hook does not cover), so this step would "
    "train plain cross-entropy. Stopped before it does; see docs/support.md for what is supported"
)


def _expected_loss(model: Any) -> Optional[str]:
    """The numerical loss the current registration (else `model`'s config) asks for, if any."""
    if state.current() is None:
        return None
    cfg = settings.of_model(unwrapped_model(model))
    return None if cfg is None else cfg.loss


def check_recorded(rec: Optional[Record], loss: Optional[str]) -> None:
    """Stop a run whose loss function sees a loss del_megatron did not compute while the run
    asks for a numerical loss (`loss` other than None or "ce"). It raises rather than warns:
    such a step trains plain cross-entropy, and a run that does so silently wastes its compute;
    no supported configuration reaches the loss function with an unrecorded loss."""
    if rec is None and loss not in (None, "ce"):
        raise RuntimeError(NOT_RECORDED.format(loss=loss))


def reduce_recorded(loss_mask: torch.Tensor, rec: Record) -> torch.Tensor:
    """The recorded loss with its reduction applied (reduction.digit_reduced); marks it as
    seen by our loss function (reduction.expect_reduction's check)."""
    reduction.reduced_by_loss_func(rec.output)
    return reduction.digit_reduced(loss_mask, rec.output, rec.parts, rec.cfg)


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
    rec = find(output_tensor)
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
    registration = state.current()
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
