"""The logits-free primitive: output-layer matmul and DigitCrossEntropy, chunked over tokens.

Never holds the [N, V/tp] logits: each chunk of rows is multiplied out, reduced to its
cross-entropy, digit logits and log normaliser, and dropped. Backward multiplies each chunk out
again (one extra matmul) and turns it into the gradients of hidden and weight. Per chunk the
collectives are those of DigitCrossEntropy; backward adds one SUM all-reduce of grad_hidden
[N, h] over the tensor-parallel group, as Megatron's ColumnParallelLinear does.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .parallel import (
    DigitColumns,
    TargetRows,
    VocabShard,
    compute_dtype,
    softmax_cross_entropy_,
    softmax_gradient_,
)
from .vocab import NUM_DIGITS, DigitVocab

# fp32 bytes of one chunk's logits when the caller gives no chunk size.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def default_chunk_rows(local_vocab: int) -> int:
    return max(1, DEFAULT_CHUNK_BYTES // (4 * local_vocab))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[c, h] x [V/tp, h] -> [c, V/tp] in compute dtype, rounded through the input dtype as the
    materialised output layer would give them."""
    return torch.matmul(hidden, weight.t()).to(dtype)


class LinearDigitCrossEntropy(torch.autograd.Function):
    """(hidden [N, h], weight [V/tp, h], target [N]) -> (ce [N], digit_logits [N, 10])."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        vocab: DigitVocab,
        shard: VocabShard,
        ignore_index: int,
        chunk_rows: int,
        validate: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(hidden)
        n = hidden.size(0)
        rows = TargetRows.of(target, shard, ignore_index, validate)
        digits = DigitColumns.of(vocab, shard, hidden.device)
        ce = torch.empty(n, dtype=dtype, device=hidden.device)
        digit_logits = torch.empty(n, NUM_DIGITS, dtype=dtype, device=hidden.device)
        # The softmax is exp((logits - shift) - log_sum_exp): exact for logits of any size.
        shift = torch.empty(n, dtype=dtype, device=hidden.device)
        log_sum_exp = torch.empty_like(shift)
        for start in range(0, n, chunk_rows):
            part = slice(start, start + chunk_rows)
            work = _chunk_logits(hidden[part], weight, dtype)
            ce[part], digit_logits[part], shift[part], log_sum_exp[part] = softmax_cross_entropy_(
                work, rows.rows(part), digits, shard, check_sizes=validate and start == 0
            )
            del work
        ctx.save_for_backward(hidden, weight, shift, log_sum_exp, *rows, *digits)
        ctx.shard, ctx.chunk_rows = shard, chunk_rows
        ctx.set_materialize_grads(False)
        return ce, digit_logits

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        hidden, weight, shift, log_sum_exp, valid, in_shard, local_target, columns, owned = (
            ctx.saved_tensors
        )
        rows, digits = TargetRows(valid, in_shard, local_target), DigitColumns(columns, owned)
        shard, chunk_rows = ctx.shard, ctx.chunk_rows
        dtype = shift.dtype
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        for start in range(0, hidden.size(0), chunk_rows):
            part = slice(start, start + chunk_rows)
            grad = _chunk_logits(hidden[part], weight, dtype)
            grad.sub_(shift[part].unsqueeze(-1)).sub_(log_sum_exp[part].unsqueeze(-1)).exp_()
            softmax_gradient_(
                grad,
                rows.rows(part),
                digits,
                None if grad_ce is None else grad_ce[part],
                None if grad_digits is None else grad_digits[part],
            )
            # The materialised path hands the output layer a gradient in the logits' dtype.
            grad = grad.to(hidden.dtype)
            torch.matmul(grad, weight, out=grad_hidden[part])
            grad_weight.add_(torch.matmul(grad.t(), hidden[part]))
            del grad
        shard.all_reduce(grad_hidden, dist.ReduceOp.SUM)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None
