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
    KernelPlan,
    NumberColumns,
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
    numbers: NumberColumns,
    shard: VocabShard,
    check_sizes: bool,
) -> Tuple[torch.Tensor, ...]:
    """Overwrites `work` [N, V/tp] (fp32/fp64 logits) with the softmax over the full vocab.

    Returns ce [N] (0 on ignored rows), the number columns' output [N, W] (the raw digit logits,
    or a chunking vocab's slot logits), the row maxima [N], the log-sum-exp of the logits minus
    those maxima [N], and the number columns' values [N, K] as read before `work` became the
    softmax (None where they read none). numbers: bound to the rows' labels (for_labels).
    """
    n, dtype = work.size(0), work.dtype
    values = numbers.values(work, dtype)

    maxima, row_max, number_max = new_maxima(n, dtype, work.device, numbers.maxima_width)
    torch.amax(work, dim=-1, out=row_max)
    numbers.write_local_maxima_(number_max, values)
    global_row_max(maxima, shard, check_sizes)

    packed = new_packed(n, numbers.out_width, dtype, work.device)
    numbers.write_partials_(packed[:, DIGITS], values, number_max)
    work.sub_(row_max.unsqueeze(-1))
    packed[:, TARGET_LOGIT] = target_logit(work, rows, dtype)
    work.exp_()
    torch.sum(work, dim=-1, out=packed[:, SUM_EXP])
    sum_packed(packed, shard)

    sum_exp = packed[:, SUM_EXP]
    log_sum_exp = torch.log(sum_exp)
    ce = torch.where(rows.valid, log_sum_exp - packed[:, TARGET_LOGIT], 0.0)
    work.div_(sum_exp.unsqueeze(-1))
    out = numbers.finish(packed[:, DIGITS], number_max)
    return ce, out, row_max, log_sum_exp, values


def softmax_gradient_(
    grad: torch.Tensor,
    rows: TargetRows,
    numbers: NumberColumns,
    grad_ce: Optional[torch.Tensor],
    grad_out: Optional[torch.Tensor],
) -> torch.Tensor:
    """Turns the softmax `grad` [N, V/tp] in place into d(loss)/d(logits) given the upstream
    gradients of ce [N] and of the number columns' output [N, W] (None: zero). numbers: bound
    to forward's (with_forward)."""
    if grad_ce is None:
        grad.zero_()
    else:
        onehot = rows.in_shard.to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, rows.local_target.unsqueeze(-1), -onehot)
        grad.mul_(torch.where(rows.valid, grad_ce, 0.0).to(grad.dtype).unsqueeze(-1))
    if grad_out is not None:
        numbers.add_term_gradient_(grad, grad_out)
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
        numbers = plan.numbers.for_labels(target)
        ce, out, _, _, values = softmax_cross_entropy_(
            work, rows, numbers, plan.shard, plan.validate
        )
        numbers = numbers.with_forward(values, out)
        ctx.save_for_backward(work, *rows, *numbers.saved())
        ctx.numbers = plan.numbers
        ctx.set_materialize_grads(False)
        return ce, out

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_out: Optional[torch.Tensor]):
        softmax, valid, in_shard, local_target, *number_tensors = ctx.saved_tensors
        grad = softmax.clone() if softmax.dtype == torch.float64 else softmax
        rows = TargetRows(valid, in_shard, local_target)
        numbers = ctx.numbers.from_saved(tuple(number_tensors))
        softmax_gradient_(grad, rows, numbers, grad_ce, grad_out)
        return grad, None, None
