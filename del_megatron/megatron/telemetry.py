"""Per-step DEL telemetry and the "digit" reduction, in Megatron-LM's loss_func.

The loss hook records, per micro-batch, the pieces behind the [b, s] loss it returns. The
loss_func wrapper (it has the loss mask) finds them by the output tensor and reports
`[sum, count]` pairs, which Megatron-LM sums over micro-batches and data-parallel ranks and logs
as sum / count (log, TensorBoard, W&B).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple, Optional

import torch

from ..loss import LossPieces, NumericalLossConfig


class _Record(NamedTuple):
    output: torch.Tensor
    pieces: LossPieces
    cfg: NumericalLossConfig


# A micro-batch's loss_func runs right after its forward (MTP calls the hook once per MTP layer
# first), so a few entries suffice.
_records: deque = deque(maxlen=16)


def record(output: torch.Tensor, pieces: LossPieces, cfg: NumericalLossConfig) -> None:
    _records.append(_Record(output, pieces, cfg))


def clear() -> None:
    _records.clear()


def find(output: torch.Tensor) -> Optional[_Record]:
    for rec in reversed(_records):
        if rec.output is output:
            return rec
    return None


def numerical_terms(
    loss_mask: torch.Tensor, rec: _Record, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """(correction, report): `correction` turns the summed "token" loss into the "digit"
    reduction (0 for "token"); `report` holds the [sum, count] telemetry entries."""
    mask = loss_mask.reshape(rec.pieces.term.shape).float()
    digit_mask = rec.pieces.is_digit.float() * mask
    n_digits = digit_mask.sum()
    term_sum = (rec.pieces.term.float() * mask).sum()
    correct = rec.pieces.digit_logits.argmax(dim=-1) == rec.pieces.digit
    correct_sum = (correct.float() * digit_mask).sum()
    correction = torch.zeros((), dtype=term_sum.dtype, device=term_sum.device)
    if rec.cfg.reduction == "digit":
        scale = num_tokens.float() / n_digits.clamp(min=1.0)
        correction = rec.cfg.alpha * term_sum * (scale - 1.0)
    one = torch.ones((), device=n_digits.device)
    pair = lambda total, count: torch.stack([total.detach().float(), count.float()])  # noqa: E731
    ce_sum = (rec.pieces.ce.float() * mask).sum()
    report = {
        "ce loss": pair(ce_sum, mask.sum()),
        f"{rec.cfg.loss} term": pair(term_sum, n_digits),
        "digit acc": pair(correct_sum, n_digits),
        "digit tokens": pair(n_digits, one),
        "digit share": pair(n_digits, num_tokens),
    }
    return correction, report


def make_loss_func(base_loss_func: Callable) -> Callable:
    """Wrap a Megatron-LM loss_func(loss_mask, output_tensor, model=None) -> (loss_sum,
    num_tokens, report): adds the telemetry entries and applies the "digit" reduction."""

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None, **kwargs):
        result = base_loss_func(loss_mask, output_tensor, model=model, **kwargs)
        rec = find(output_tensor)
        if rec is None:
            return result  # the model computed its loss without del_megatron (loss "ce" off)
        if len(result) != 3:
            raise ValueError(
                "del_megatron needs a loss_func returning (loss_sum, num_tokens, report), as "
                "Megatron-LM's pretrain_gpt.py does from core 0.12 on"
            )
        loss, num_tokens, report = result
        correction, extra = numerical_terms(loss_mask, rec, num_tokens)
        loss = loss + correction
        report = {**report, **extra}
        report["lm loss"] = torch.stack([loss.detach().float(), num_tokens.float()])
        return loss, num_tokens, report

    return loss_func


def _plain_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Megatron-LM's pretrain_gpt loss_func without its NaN/spike checks (those need args)."""
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return (
        loss,
        num_tokens,
        {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])},
    )


numerical_loss_func = make_loss_func(_plain_loss_func)
