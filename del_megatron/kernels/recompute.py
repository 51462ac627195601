"""The "recompute" and "compiled" kernels: keep the caller's logits, recompute the softmax in
backward.

Same collectives and results as the softmax kernel, but nothing of size [N, V/tp] is kept in
fp32. Forward reads the logits once, in row chunks converted to the compute dtype one at a time:
each chunk gives its row maxima and sums of exp relative to them, which are rescaled to the global
maxima after the MAX all-reduce. Backward converts each chunk again and writes the gradient in the
logits' dtype. Peak memory: the logits, their gradient and one chunk.

"recompute" runs the two passes eagerly on chunks of a few MiB (they stay in cache on a CPU);
"compiled" runs each pass as one torch.compile'd kernel over all rows (the CUDA default).
"""

from __future__ import annotations

from functools import cache
from typing import Callable, Optional, Tuple

import torch

from .common import (
    DIGITS,
    SUM_EXP,
    TARGET_LOGIT,
    KernelPlan,
    TargetRows,
    compute_dtype,
    global_row_max,
    new_maxima,
    new_packed,
    rows_per_chunk,
    sum_packed,
    target_logit,
)

# fp32 bytes of one eager chunk.
EAGER_CHUNK_BYTES = 8 * 2**20


def default_chunk_tokens(local_vocab: int) -> int:
    """Rows of an eager chunk when the caller gives no chunk size."""
    return rows_per_chunk(local_vocab, EAGER_CHUNK_BYTES)


def max_and_sum_exp(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[c, V/tp] -> row maxima [c] and sum_v exp(logits - maxima) [c], in the compute dtype."""
    work = logits.to(compute_dtype(logits), copy=True)
    row_max = work.amax(dim=-1)
    return row_max, work.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)


def softmax_minus_onehot(
    logits: torch.Tensor,
    shift: torch.Tensor,
    log_sum_exp: torch.Tensor,
    scale: torch.Tensor,
    onehot_column: torch.Tensor,
) -> torch.Tensor:
    """(softmax - onehot) * scale for [c, V/tp] logits, in their dtype. The softmax is
    exp((logits - shift) - log_sum_exp), exact for logits of any size; onehot_column [c] is the
    local target column, -1 where this shard holds none."""
    work = logits.to(shift.dtype, copy=True)
    work.sub_(shift.unsqueeze(-1)).sub_(log_sum_exp.unsqueeze(-1)).exp_()
    work.mul_(scale.unsqueeze(-1))
    minus = torch.where(onehot_column >= 0, -scale, 0.0).unsqueeze(-1)
    work.scatter_add_(-1, onehot_column.clamp(min=0).unsqueeze(-1), minus)
    return work.to(logits.dtype)


@cache
def passes(compiled: bool) -> Tuple[Callable, Callable]:
    """The forward and backward passes, torch.compile'd (dynamic shapes) or eager."""
    fns = (max_and_sum_exp, softmax_minus_onehot)
    if not compiled:
        return fns
    return tuple(torch.compile(fn, dynamic=True) for fn in fns)


def statistics(
    logits: torch.Tensor,
    rows: TargetRows,
    plan: KernelPlan,
    first_pass: Callable,
    step: int,
    check_sizes: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward over logits [n, V/tp], `step` rows converted at a time, with the MAX and SUM
    all-reduces: ce [n] (0 on ignored rows), digit logits [n, 10], the row maxima (shift) [n]
    and the log-sum-exp of the logits minus them [n], all in the compute dtype."""
    dtype, device, n = compute_dtype(logits), logits.device, logits.size(0)
    maxima = new_maxima(n, dtype, device)
    local_max, local_sum = maxima[:-2], torch.empty(n, dtype=dtype, device=device)
    for start in range(0, n, step):
        part = slice(start, start + step)
        local_max[part], local_sum[part] = first_pass(logits[part])
    local_max = local_max.clone()
    shift = global_row_max(maxima, plan.shard, check_sizes)

    packed = new_packed(n, dtype, device)
    torch.mul(local_sum, torch.exp(local_max - shift), out=packed[:, SUM_EXP])
    packed[:, TARGET_LOGIT] = target_logit(logits, rows, dtype)
    plan.digits.write_into(packed[:, DIGITS], logits)
    sum_packed(packed, plan.shard)

    log_sum_exp = torch.log(packed[:, SUM_EXP])
    ce = torch.where(rows.valid, log_sum_exp - (packed[:, TARGET_LOGIT] - shift), 0.0)
    return ce, packed[:, DIGITS].contiguous(), shift, log_sum_exp


def gradient_into(
    grad: Optional[torch.Tensor],
    logits: torch.Tensor,
    shift: torch.Tensor,
    log_sum_exp: torch.Tensor,
    rows: TargetRows,
    plan: KernelPlan,
    second_pass: Callable,
    step: int,
    grad_ce: Optional[torch.Tensor],
    grad_digits: Optional[torch.Tensor],
    forward_values: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """d(loss)/d(logits) [n, V/tp] in the logits' dtype, `step` rows at a time, given the
    upstream gradients of ce [n] and of the digit logits [n, 10] (None: zero). Written into
    `grad` (which may be `logits` itself); grad None: a new buffer. Returns it.

    forward_values (target probability exp(-ce) [n], digit logits [n, 10]), as forward formed
    them: the target and digit columns take their gradient from these, not from `logits`, when
    `logits` were multiplied out again by another matmul (a vocab tile's may differ from
    forward's in the last bits, and a saturated target's gradient p - 1 is all rounding)."""
    scale = torch.zeros_like(shift) if grad_ce is None else torch.where(rows.valid, grad_ce, 0.0)
    scale = scale.to(shift.dtype)
    onehot_column = rows.onehot_column()
    n = logits.size(0)
    digits, columns = list(plan.digits.digits), list(plan.digits.columns)
    # Digit logits are read before an in-place gradient overwrites them.
    digit_logits = None
    if columns and forward_values is not None:
        digit_logits = forward_values[1][:, digits].to(shift.dtype)
    elif columns:
        digit_logits = logits[:, columns].to(shift.dtype)
    if grad is None and step >= n:
        grad = second_pass(logits, shift, log_sum_exp, scale, onehot_column)
    else:
        grad = torch.empty_like(logits) if grad is None else grad
        for start in range(0, n, step):
            part = slice(start, start + step)
            grad[part] = second_pass(
                logits[part], shift[part], log_sum_exp[part], scale[part], onehot_column[part]
            )
    if forward_values is not None:
        _set_target_gradient_(grad, forward_values[0], scale, onehot_column)
    if columns:
        # The digit columns get their whole gradient in the compute dtype, rounded once.
        probs = torch.exp(digit_logits - shift.unsqueeze(-1) - log_sum_exp.unsqueeze(-1))
        hit = onehot_column.unsqueeze(-1) == torch.tensor(columns, device=logits.device)
        digit_grad = (probs - hit.to(probs.dtype)) * scale.unsqueeze(-1)
        if grad_digits is not None:
            digit_grad += grad_digits[:, digits].to(digit_grad.dtype)
        grad[:, columns] = digit_grad.to(grad.dtype)
    return grad


def _set_target_gradient_(
    grad: torch.Tensor, target_prob: torch.Tensor, scale: torch.Tensor, onehot_column: torch.Tensor
) -> None:
    """grad [n, V/tp] at each row's target column (where this block holds it) becomes
    (target_prob - 1) * scale, rounded once to grad's dtype. (index_put_: a CPU scatter_ makes
    two copies of grad.)"""
    index = (torch.arange(grad.size(0), device=grad.device), onehot_column.clamp(min=0))
    exact = ((target_prob - 1) * scale).to(grad.dtype)
    grad.index_put_(index, torch.where(onehot_column >= 0, exact, grad[index]))


def _forward(
    ctx, logits: torch.Tensor, target: torch.Tensor, plan: KernelPlan, compiled: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    rows = TargetRows.of(target, plan.shard, plan.ignore_index, plan.validate)
    first_pass, _ = passes(compiled)
    ce, digit_logits, shift, log_sum_exp = statistics(
        logits, rows, plan, first_pass, plan.chunk_tokens, plan.validate
    )
    ctx.save_for_backward(logits, shift, log_sum_exp, *rows)
    ctx.plan, ctx.compiled = plan, compiled
    ctx.set_materialize_grads(False)
    return ce, digit_logits


def _backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
    logits, shift, log_sum_exp, *saved_rows = ctx.saved_tensors
    plan = ctx.plan
    _, second_pass = passes(ctx.compiled)
    grad = gradient_into(
        logits if plan.inplace else None,
        logits,
        shift,
        log_sum_exp,
        TargetRows(*saved_rows),
        plan,
        second_pass,
        plan.chunk_tokens,
        grad_ce,
        grad_digits,
    )
    return grad, None, None


class RecomputeDigitCrossEntropy(torch.autograd.Function):
    """(logits [N, V/tp], target [N], plan) -> (ce [N], digit_logits [N, 10]), as the softmax
    kernel, eager passes over plan.chunk_tokens rows at a time. Saves the logits; the caller must
    not change them before backward (autograd checks). With plan.inplace, backward writes the
    gradient over them, chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, plan: KernelPlan):
        return _forward(ctx, logits, target, plan, compiled=False)

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        return _backward(ctx, grad_ce, grad_digits)


class CompiledDigitCrossEntropy(RecomputeDigitCrossEntropy):
    """The recompute kernel with each pass torch.compile'd (by default over all rows at once)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, plan: KernelPlan):
        return _forward(ctx, logits, target, plan, compiled=True)
