"""The "softmax" kernel: Megatron's scheme, an fp32 softmax of the shard kept for backward.

Forward turns a working copy of the logits (or, with inplace, fp32 logits themselves) into the
softmax over the full vocabulary; backward turns that buffer into the gradient in place, with no
collective.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .common import (
    DIGITS,
    SUM_EXP,
    TARGET_LOGIT,
    DigitColumns,
    KernelPlan,
    TargetRows,
    VocabShard,
    compute_dtype,
    global_row_max,
    new_maxima,
    new_packed,
    sum_packed,
    target_logit,
)


def softmax_cross_entropy_(
    work: torch.Tensor,
    rows: TargetRows,
    digits: DigitColumns,
    shard: VocabShard,
    check_sizes: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Overwrites `work` [N, V/tp] (fp32/fp64 logits) with the softmax over the full vocab.

    Returns ce [N] (0 on ignored rows), the raw digit logits [N, W], the row maxima [N] and
    the log-sum-exp of the logits minus those maxima [N].
    """
    n, dtype = work.size(0), work.dtype
    packed = new_packed(n, digits.width, dtype, work.device)
    digits.write_into(packed[:, DIGITS], work)

    maxima = new_maxima(n, dtype, work.device)
    torch.amax(work, dim=-1, out=maxima[:-2])
    row_max = global_row_max(maxima, shard, check_sizes)

    work.sub_(row_max.unsqueeze(-1))
    packed[:, TARGET_LOGIT] = target_logit(work, rows, dtype)
    work.exp_()
    torch.sum(work, dim=-1, out=packed[:, SUM_EXP])
    sum_packed(packed, shard)

    sum_exp = packed[:, SUM_EXP]
    log_sum_exp = torch.log(sum_exp)
    ce = torch.where(rows.valid, log_sum_exp - packed[:, TARGET_LOGIT], 0.0)
    work.div_(sum_exp.unsqueeze(-1))
    return ce, packed[:, DIGITS].contiguous(), row_max, log_sum_exp


def softmax_gradient_(
    grad: torch.Tensor,
    rows: TargetRows,
    digits: DigitColumns,
    grad_ce: Optional[torch.Tensor],
    grad_digits: Optional[torch.Tensor],
) -> torch.Tensor:
    """Turns the softmax `grad` [N, V/tp] in place into d(loss)/d(logits) given the upstream
    gradients of ce [N] and of the digit logits [N, W] (None: zero)."""
    if grad_ce is None:
        grad.zero_()
    else:
        onehot = rows.in_shard.to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, rows.local_target.unsqueeze(-1), -onehot)
        grad.mul_(torch.where(rows.valid, grad_ce, 0.0).to(grad.dtype).unsqueeze(-1))
    if grad_digits is not None:
        digits.add_gradient_(grad, grad_digits)
    return grad


class SoftmaxDigitCrossEntropy(torch.autograd.Function):
    """(logits [N, V/tp], target [N], plan) -> (ce [N], digit_logits [N, W]).

    Keeps an fp32 softmax [N, V/tp] for backward (fp64 for fp64 logits). Unless plan.inplace,
    fp32/fp64 logits are copied once; bf16/fp16 logits always are (the copy becomes the saved
    softmax, as in Megatron). Backward overwrites the saved softmax with the gradient, so it runs
    once (fp64 excepted: it keeps the softmax, so that gradcheck can run backward again).
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, plan: KernelPlan
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(logits)
        if logits.dtype == dtype:
            work = logits if plan.inplace else logits.clone()
        else:
            work = logits.to(dtype)
        rows = TargetRows.of(target, plan.shard, plan.ignore_index, plan.validate)
        ce, digit_logits, _, _ = softmax_cross_entropy_(
            work, rows, plan.digits, plan.shard, plan.validate
        )
        ctx.save_for_backward(work, *rows)
        ctx.digits = plan.digits
        ctx.set_materialize_grads(False)
        return ce, digit_logits

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        softmax, *rows = ctx.saved_tensors
        grad = softmax.clone() if softmax.dtype == torch.float64 else softmax
        softmax_gradient_(grad, TargetRows(*rows), ctx.digits, grad_ce, grad_digits)
        return grad, None, None
