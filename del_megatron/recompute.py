"""The primitive without a saved softmax: keep the caller's logits, recompute in backward.

Same collectives and results as DigitCrossEntropy (parallel.py), but nothing of size [N, V/tp]
is kept in fp32. Forward reads the logits once, in row chunks converted to the compute dtype one
at a time: each chunk gives its row maxima and sums of exp relative to them, which are rescaled to
the global maxima after the MAX all-reduce. Backward converts each chunk again and writes the
gradient in the logits' dtype. Peak memory: the logits, their gradient and one chunk.

Eagerly (CPU), chunks of a few MiB stay in cache. Under torch.compile (CUDA), each pass is one
fused kernel over all rows.
"""

from __future__ import annotations

from functools import cache
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .parallel import TargetRows, VocabShard, compute_dtype, global_row_max
from .vocab import NUM_DIGITS, DigitVocab

# Elements of one eager chunk (8 MiB of fp32).
EAGER_CHUNK_ELEMENTS = 2**21


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
def kernels(compiled: bool) -> Tuple[Callable, Callable]:
    """The two passes, torch.compile'd (dynamic shapes) or as plain eager functions."""
    fns = (max_and_sum_exp, softmax_minus_onehot)
    if not compiled:
        return fns
    return tuple(torch.compile(fn, dynamic=True) for fn in fns)


def chunk_rows(n: int, local_vocab: int, compiled: bool) -> int:
    return n if compiled else max(1, EAGER_CHUNK_ELEMENTS // local_vocab)


def _owned_digits(vocab: DigitVocab, shard: VocabShard) -> Tuple[List[int], List[int]]:
    """(digit positions 0..9, local columns) of the digits this shard holds."""
    pairs = [
        (k, i - shard.start) for k, i in enumerate(vocab.digit_ids) if shard.start <= i < shard.end
    ]
    return [k for k, _ in pairs], [c for _, c in pairs]


class RecomputeDigitCrossEntropy(torch.autograd.Function):
    """(logits [N, V/tp], target [N]) -> (ce [N], digit_logits [N, 10]), as DigitCrossEntropy.
    Saves the logits; the caller must not change them before backward (autograd checks). With
    `inplace`, backward writes the gradient over them, chunk by chunk, instead of a new buffer."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab: DigitVocab,
        shard: VocabShard,
        ignore_index: int,
        validate: bool,
        compiled: bool,
        inplace: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        first_pass, _ = kernels(compiled)
        dtype = compute_dtype(logits)
        n = logits.size(0)
        rows = TargetRows.of(target, shard, ignore_index, validate)
        positions, columns = _owned_digits(vocab, shard)

        maxima = torch.empty(n + 2, dtype=dtype, device=logits.device)  # + the +-size check
        local_max, local_sum = maxima[:-2], torch.empty(n, dtype=dtype, device=logits.device)
        step = chunk_rows(n, shard.local_size, compiled)
        for start in range(0, n, step):
            part = slice(start, start + step)
            local_max[part], local_sum[part] = first_pass(logits[part])
        local_max = local_max.clone()
        shift = global_row_max(maxima, shard, validate)

        # [N, 12]: sum of exp | target logit | ten raw digit logits, one SUM all-reduce.
        packed = torch.zeros(n, 2 + NUM_DIGITS, dtype=dtype, device=logits.device)
        torch.mul(local_sum, torch.exp(local_max - shift), out=packed[:, 0])
        target_logit = logits.gather(-1, rows.local_target.unsqueeze(-1)).squeeze(-1)
        packed[:, 1] = torch.where(rows.in_shard, target_logit.to(dtype), 0.0)
        if columns:
            packed[:, [2 + k for k in positions]] = logits[:, columns].to(dtype)
        shard.all_reduce(packed, dist.ReduceOp.SUM)

        log_sum_exp = torch.log(packed[:, 0])
        ce = torch.where(rows.valid, log_sum_exp - (packed[:, 1] - shift), 0.0)
        ctx.save_for_backward(logits, shift, log_sum_exp, *rows)
        ctx.digits, ctx.compiled, ctx.inplace = (positions, columns), compiled, inplace
        ctx.set_materialize_grads(False)
        return ce, packed[:, 2:].contiguous()

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        logits, shift, log_sum_exp, valid, in_shard, local_target = ctx.saved_tensors
        positions, columns = ctx.digits
        _, second_pass = kernels(ctx.compiled)
        scale = torch.zeros_like(shift) if grad_ce is None else torch.where(valid, grad_ce, 0.0)
        scale = scale.to(shift.dtype)
        onehot_column = torch.where(in_shard, local_target, -1)
        n = logits.size(0)
        step = chunk_rows(n, logits.size(1), ctx.compiled)
        # Digit logits [N, 10] are read before an in-place gradient overwrites them.
        digit_logits = logits[:, columns].to(shift.dtype) if columns else None
        if step >= n and not ctx.inplace:
            grad = second_pass(logits, shift, log_sum_exp, scale, onehot_column)
        else:
            grad = logits if ctx.inplace else torch.empty_like(logits)
            for start in range(0, n, step):
                part = slice(start, start + step)
                grad[part] = second_pass(
                    logits[part], shift[part], log_sum_exp[part], scale[part], onehot_column[part]
                )
        if columns:
            # The digit columns get their whole gradient in the compute dtype, rounded once.
            shifted = digit_logits - shift.unsqueeze(-1)
            probs = torch.exp(shifted - log_sum_exp.unsqueeze(-1))
            hit = onehot_column.unsqueeze(-1) == torch.tensor(columns, device=logits.device)
            digit_grad = (probs - hit.to(probs.dtype)) * scale.unsqueeze(-1)
            if grad_digits is not None:
                digit_grad += grad_digits[:, positions].to(digit_grad.dtype)
            grad[:, columns] = digit_grad.to(grad.dtype)
        return grad, None, None, None, None, None, None, None
