"""The "linear" kernel: the output-layer matmul and the softmax kernel's steps, chunked over
tokens, so that the [N, V/tp] logits never exist.

Each chunk of rows is multiplied out, reduced to its cross-entropy, digit logits and log
normaliser, and dropped. Backward multiplies each chunk out again (one extra matmul) and turns it
into the gradients of hidden and weight. Per chunk the collectives are those of the softmax kernel
(the shard-size check rides on the first chunk's MAX); backward adds one SUM all-reduce of
grad_hidden [N, h] over the tensor-parallel group, as Megatron's ColumnParallelLinear does.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..vocab import NUM_DIGITS
from .common import KernelPlan, TargetRows, compute_dtype, rows_per_chunk
from .softmax import softmax_cross_entropy_, softmax_gradient_

# fp32 bytes of one chunk's logits when the caller gives no chunk size.
LINEAR_CHUNK_BYTES = 256 * 2**20


def default_chunk_tokens(local_vocab: int) -> int:
    """Rows of a chunk when the caller gives no chunk size."""
    return rows_per_chunk(local_vocab, LINEAR_CHUNK_BYTES)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[c, h] x [V/tp, h] -> [c, V/tp] in compute dtype, rounded through the input dtype as the
    materialised output layer would give them."""
    return torch.matmul(hidden, weight.t()).to(dtype)


class LinearDigitCrossEntropy(torch.autograd.Function):
    """(hidden [N, h], weight [V/tp, h], target [N], plan) -> (ce [N], digit_logits [N, 10]).

    Saves hidden, weight and two [N] vectors; nothing [N, V/tp]. plan.inplace must be False
    (there are no logits to overwrite)."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, plan: KernelPlan
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        dtype, device, n = compute_dtype(hidden), hidden.device, hidden.size(0)
        rows = TargetRows.of(target, plan.shard, plan.ignore_index, plan.validate)
        ce = torch.empty(n, dtype=dtype, device=device)
        digit_logits = torch.empty(n, NUM_DIGITS, dtype=dtype, device=device)
        # The softmax is exp((logits - shift) - log_sum_exp): exact for logits of any size.
        shift = torch.empty(n, dtype=dtype, device=device)
        log_sum_exp = torch.empty_like(shift)
        step = plan.chunk_tokens
        for start in range(0, n, step):
            part = slice(start, start + step)
            work = _chunk_logits(hidden[part], weight, dtype)
            ce[part], digit_logits[part], shift[part], log_sum_exp[part] = softmax_cross_entropy_(
                work, rows.rows(part), plan.digits, plan.shard, plan.validate and start == 0
            )
            del work
        ctx.save_for_backward(hidden, weight, shift, log_sum_exp, *rows)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return ce, digit_logits

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        hidden, weight, shift, log_sum_exp, *saved_rows = ctx.saved_tensors
        plan, rows = ctx.plan, TargetRows(*saved_rows)
        dtype, step = shift.dtype, plan.chunk_tokens
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        for start in range(0, hidden.size(0), step):
            part = slice(start, start + step)
            grad = _chunk_logits(hidden[part], weight, dtype)
            grad.sub_(shift[part].unsqueeze(-1)).sub_(log_sum_exp[part].unsqueeze(-1)).exp_()
            softmax_gradient_(
                grad,
                rows.rows(part),
                plan.digits,
                None if grad_ce is None else grad_ce[part],
                None if grad_digits is None else grad_digits[part],
            )
            # The materialised path hands the output layer a gradient in the logits' dtype.
            grad = grad.to(hidden.dtype)
            torch.matmul(grad, weight, out=grad_hidden[part])
            grad_weight.add_(torch.matmul(grad.t(), hidden[part]))
            del grad
        plan.shard.all_reduce(grad_hidden, dist.ReduceOp.SUM)
        return grad_hidden, grad_weight.to(weight.dtype), None, None


class SequenceParallelGather(torch.autograd.Function):
    """hidden [s/tp, b, h], this rank's contiguous slice of the positions (Megatron's sequence
    parallelism) -> [s, b, h], the whole sequence, on every rank of `group`.

    Backward returns this rank's rows of the gradient and communicates nothing: the linear
    kernel's backward has already summed grad_hidden over the group (a reduce-scatter here
    would count it tp times)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, group) -> torch.Tensor:
        pieces = [torch.empty_like(hidden) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, hidden.contiguous(), group=group)
        ctx.rows, ctx.rank = hidden.size(0), dist.get_rank(group)
        return torch.cat(pieces, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows], None
