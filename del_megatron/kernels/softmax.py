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
    digits: NumberColumns,
    shard: VocabShard,
    check_sizes: bool,
    prefix: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, ...]:
    """Overwrites `work` [N, V/tp] (fp32/fp64 logits) with the softmax over the full vocab.

    Returns ce [N] (0 on ignored rows), the number columns' output [N, W] (the raw digit logits,
    or a chunking vocab's slot logits), the row maxima [N], the log-sum-exp of the logits minus
    those maxima [N], and the number columns' values (None for digits; a chunking vocab's layout
    values [N, 1110], which backward needs once `work` is the softmax). prefix:
    digits.prefix(target).
    """
    n, dtype = work.size(0), work.dtype
    extra = digits.maxima_width
    values = digits.values(work, dtype) if digits.columns or extra else None

    maxima = new_maxima(n, dtype, work.device, extra)
    torch.amax(work, dim=-1, out=maxima[:n])
    if extra:
        maxima[n:-2].view(n, extra).copy_(digits.local_maxima(values, prefix))
    reduced = global_row_max(maxima, shard, check_sizes)
    row_max, group_max = reduced[:n], reduced[n:].view(n, extra) if extra else None

    packed = new_packed(n, digits.out_width, dtype, work.device)
    if values is not None:
        digits.write_partials_(packed[:, DIGITS], values, prefix, group_max)
    work.sub_(row_max.unsqueeze(-1))
    packed[:, TARGET_LOGIT] = target_logit(work, rows, dtype)
    work.exp_()
    torch.sum(work, dim=-1, out=packed[:, SUM_EXP])
    sum_packed(packed, shard)

    sum_exp = packed[:, SUM_EXP]
    log_sum_exp = torch.log(sum_exp)
    ce = torch.where(rows.valid, log_sum_exp - packed[:, TARGET_LOGIT], 0.0)
    work.div_(sum_exp.unsqueeze(-1))
    out = digits.finish(packed[:, DIGITS], group_max)
    return ce, out, row_max, log_sum_exp, values if extra else None


def softmax_gradient_(
    grad: torch.Tensor,
    rows: TargetRows,
    digits: NumberColumns,
    grad_ce: Optional[torch.Tensor],
    grad_digits: Optional[torch.Tensor],
    term_inputs: Tuple[Optional[torch.Tensor], ...] = (None, None, None),
) -> torch.Tensor:
    """Turns the softmax `grad` [N, V/tp] in place into d(loss)/d(logits) given the upstream
    gradients of ce [N] and of the number columns' output [N, W] (None: zero). term_inputs:
    (values, prefix, output) of a chunking vocab's forward."""
    if grad_ce is None:
        grad.zero_()
    else:
        onehot = rows.in_shard.to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, rows.local_target.unsqueeze(-1), -onehot)
        grad.mul_(torch.where(rows.valid, grad_ce, 0.0).to(grad.dtype).unsqueeze(-1))
    if grad_digits is not None:
        digits.add_term_gradient_(grad, *term_inputs, grad_digits)
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
        prefix = plan.digits.prefix(target)
        ce, out, _, _, values = softmax_cross_entropy_(
            work, rows, plan.digits, plan.shard, plan.validate, prefix
        )
        slot_out = out if prefix is not None else None
        ctx.save_for_backward(work, values, prefix, slot_out, *rows)
        ctx.digits = plan.digits
        ctx.set_materialize_grads(False)
        return ce, out

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        softmax, values, prefix, out, *rows = ctx.saved_tensors
        grad = softmax.clone() if softmax.dtype == torch.float64 else softmax
        softmax_gradient_(
            grad, TargetRows(*rows), ctx.digits, grad_ce, grad_digits, (values, prefix, out)
        )
        return grad, None, None
