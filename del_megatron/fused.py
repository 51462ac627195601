"""The primitive for accelerators: each pass over the shard fused by torch.compile.

Same collectives and results as DigitCrossEntropy, but nothing of size [N, V/tp] is kept in
fp32: forward reads the caller's logits twice (row maxima, then sums of exponentials) without a
working copy, saves the logits and the log normaliser [N], and backward recomputes the softmax
while writing the gradient in the logits' dtype. Peak memory is the logits plus their gradient.
"""

from __future__ import annotations

from functools import cache
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .parallel import TargetRows, VocabShard, _check_shard_sizes, check_labels_in_vocab
from .vocab import NUM_DIGITS, DigitVocab


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def row_max(logits: torch.Tensor) -> torch.Tensor:
    """[N, V/tp] -> [N] in the compute dtype."""
    return logits.to(_compute_dtype(logits)).amax(dim=-1)


def sum_exp(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """[N, V/tp], [N] -> sum_v exp(logits - shift) [N]."""
    return torch.exp(logits.to(shift.dtype) - shift.unsqueeze(-1)).sum(dim=-1)


def softmax(logits: torch.Tensor, shift: torch.Tensor, log_sum_exp: torch.Tensor) -> torch.Tensor:
    """exp((logits - shift) - log_sum_exp): subtracting the row maximum first keeps it exact for
    logits of any size."""
    shifted = logits.to(shift.dtype) - shift.unsqueeze(-1)
    return torch.exp(shifted - log_sum_exp.unsqueeze(-1))


def softmax_minus_onehot(
    logits: torch.Tensor,
    shift: torch.Tensor,
    log_sum_exp: torch.Tensor,
    scale: torch.Tensor,
    local_target: torch.Tensor,
) -> torch.Tensor:
    """(softmax - onehot(local_target)) * scale [N, 1] in the logits' dtype; local_target -1: no
    onehot in this shard."""
    probs = softmax(logits, shift, log_sum_exp)
    columns = torch.arange(logits.size(-1), device=logits.device)
    hit = columns.unsqueeze(0) == local_target.unsqueeze(-1)
    return ((probs - hit.to(probs.dtype)) * scale.unsqueeze(-1)).to(logits.dtype)


@cache
def kernels(compiled: bool) -> Tuple[Callable, Callable, Callable]:
    """The three passes, torch.compile'd (dynamic shapes) or as plain eager functions."""
    fns = (row_max, sum_exp, softmax_minus_onehot)
    if not compiled:
        return fns
    return tuple(torch.compile(fn, dynamic=True) for fn in fns)


def _owned_digits(vocab: DigitVocab, shard: VocabShard) -> Tuple[List[int], List[int]]:
    """(digit positions 0..9, local columns) of the digits this shard holds."""
    pairs = [
        (k, i - shard.start) for k, i in enumerate(vocab.digit_ids) if shard.start <= i < shard.end
    ]
    return [k for k, _ in pairs], [c for _, c in pairs]


class FusedDigitCrossEntropy(torch.autograd.Function):
    """(logits [N, V/tp], target [N]) -> (ce [N], digit_logits [N, 10]), as DigitCrossEntropy."""

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
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        max_fn, sum_exp_fn, _ = kernels(compiled)
        dtype = _compute_dtype(logits)
        n = logits.size(0)
        rows = TargetRows.of(target, shard, ignore_index)
        if validate:
            check_labels_in_vocab(target, rows.valid, shard.full_size)
        positions, columns = _owned_digits(vocab, shard)

        maxima = torch.empty(n + 2, dtype=dtype, device=logits.device)
        maxima[:-2] = max_fn(logits)
        maxima[-2] = shard.local_size
        maxima[-1] = -shard.local_size
        shard.all_reduce(maxima, dist.ReduceOp.MAX)
        if validate and shard.world_size > 1:
            _check_shard_sizes(maxima, shard)
        shift = maxima[:-2]

        # [N, 12]: sum of exp | target logit | ten raw digit logits, one SUM all-reduce.
        packed = torch.zeros(n, 2 + NUM_DIGITS, dtype=dtype, device=logits.device)
        packed[:, 0] = sum_exp_fn(logits, shift)
        target_logit = logits.gather(-1, rows.local_target.unsqueeze(-1)).squeeze(-1)
        packed[:, 1] = torch.where(rows.in_shard, target_logit.to(dtype), 0.0)
        if columns:
            packed[:, [2 + k for k in positions]] = logits[:, columns].to(dtype)
        shard.all_reduce(packed, dist.ReduceOp.SUM)

        log_sum_exp = torch.log(packed[:, 0])
        ce = torch.where(rows.valid, (log_sum_exp + shift) - packed[:, 1], 0.0)
        ctx.save_for_backward(logits, shift, log_sum_exp, *rows)
        ctx.digits, ctx.compiled = (positions, columns), compiled
        ctx.set_materialize_grads(False)
        return ce, packed[:, 2:].contiguous()

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        logits, shift, log_sum_exp, valid, in_shard, local_target = ctx.saved_tensors
        positions, columns = ctx.digits
        scale = torch.zeros_like(shift) if grad_ce is None else torch.where(valid, grad_ce, 0.0)
        scale = scale.to(shift.dtype)
        onehot_column = torch.where(in_shard, local_target, -1)
        grad = kernels(ctx.compiled)[2](logits, shift, log_sum_exp, scale, onehot_column)
        if columns:
            # The digit columns get their whole gradient in the compute dtype, rounded once.
            probs = softmax(logits[:, columns], shift, log_sum_exp)
            hit = onehot_column.unsqueeze(-1) == torch.tensor(columns, device=logits.device)
            digit_grad = (probs - hit.to(probs.dtype)) * scale.unsqueeze(-1)
            if grad_digits is not None:
                digit_grad += grad_digits[:, positions].to(digit_grad.dtype)
            grad[:, columns] = digit_grad.to(grad.dtype)
        return grad, None, None, None, None, None, None
