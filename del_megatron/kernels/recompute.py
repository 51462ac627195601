"""The "recompute" and "compiled" kernels: keep the caller's logits, recompute the softmax in
backward.

Same collectives and results as the softmax kernel, but nothing of size [N, V/tp] is kept in
fp32. Forward reads the logits once, in row chunks converted to the compute dtype one at a time:
each chunk gives its row maxima and sums of exp relative to them, which are rescaled to the global
maxima after the MAX all-reduce. Backward converts each chunk again and writes the gradient in the
logits' dtype. Peak memory: the logits, their gradient and one chunk.

"recompute" runs the two passes eagerly on chunks of a few MiB (they stay in cache on a CPU);
"compiled" runs each pass as one torch.compile'd kernel over all rows (the CUDA default), written
pointwise so that TorchInductor fuses each into one loop: forward reads the logits and writes [N]
vectors, backward reads them and writes the gradient in their dtype, once; neither holds anything
of [N, V/tp] in fp32. Where torch.compile is off or fails, "compiled" runs the eager passes over
chunks as "recompute" does (logged once; CompiledPass).
"""

from __future__ import annotations

import functools
import logging
from functools import cache
from typing import Callable, Optional, Set, Tuple

import torch

from .common import (
    DIGITS,
    SUM_EXP,
    TARGET_LOGIT,
    KernelPlan,
    NumberColumns,
    TargetRows,
    compute_dtype,
    global_row_max,
    new_maxima,
    new_packed,
    rows_per_chunk,
    sum_packed,
    target_logit,
)

logger = logging.getLogger(__name__)

# fp32 bytes of one eager chunk.
EAGER_CHUNK_BYTES = 8 * 2**20
# fp32 bytes of one compiled chunk when the gradient overwrites the logits (inplace): the pass
# writes a new buffer that is copied over its rows, so it is kept small beside them.
COMPILED_INPLACE_CHUNK_BYTES = 256 * 2**20


def default_chunk_tokens(local_vocab: int) -> int:
    """Rows of an eager chunk when the caller gives no chunk size."""
    return rows_per_chunk(local_vocab, EAGER_CHUNK_BYTES)


def compiled_chunk_tokens(local_vocab: int, tokens: int, inplace: bool) -> int:
    """Rows a compiled pass takes at once: all of them, or with inplace at most
    COMPILED_INPLACE_CHUNK_BYTES of fp32 and an eighth of the rows."""
    if not inplace:
        return max(1, tokens)
    return max(1, min(rows_per_chunk(local_vocab, COMPILED_INPLACE_CHUNK_BYTES), -(-tokens // 8)))


def max_and_sum_exp(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[c, V/tp] -> row maxima [c] and sum_v exp(logits - maxima) [c], in the compute dtype
    (eager: one working copy of the chunk, changed in place)."""
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
    local target column, -1 where this shard holds none. (Eager: one working copy of the chunk,
    changed in place.)"""
    work = logits.to(shift.dtype, copy=True)
    work.sub_(shift.unsqueeze(-1)).sub_(log_sum_exp.unsqueeze(-1)).exp_()
    work.mul_(scale.unsqueeze(-1))
    minus = torch.where(onehot_column >= 0, -scale, 0.0).unsqueeze(-1)
    work.scatter_add_(-1, onehot_column.clamp(min=0).unsqueeze(-1), minus)
    return work.to(logits.dtype)


def max_and_sum_exp_pointwise(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """max_and_sum_exp without a working copy: two row reductions over the logits, which
    TorchInductor fuses into one loop that writes [c] vectors only."""
    _refuse_eager()
    work = logits.to(compute_dtype(logits))
    row_max = work.amax(dim=-1)
    return row_max, torch.exp(work - row_max.unsqueeze(-1)).sum(dim=-1)


def softmax_minus_onehot_pointwise(
    logits: torch.Tensor,
    shift: torch.Tensor,
    log_sum_exp: torch.Tensor,
    scale: torch.Tensor,
    onehot_column: torch.Tensor,
) -> torch.Tensor:
    """softmax_minus_onehot as one pointwise expression (the target column found by comparing
    the column number with onehot_column, not scattered into a buffer), which TorchInductor
    fuses into one loop writing the gradient in the logits' dtype and nothing else. The same
    arithmetic, so the same values."""
    _refuse_eager()
    probs = torch.exp((logits.to(shift.dtype) - shift.unsqueeze(-1)) - log_sum_exp.unsqueeze(-1))
    grad = probs * scale.unsqueeze(-1)
    column = torch.arange(logits.size(-1), device=logits.device)
    is_target = column == onehot_column.unsqueeze(-1)
    return torch.where(is_target, grad - scale.unsqueeze(-1), grad).to(logits.dtype)


class _RanEagerly(Exception):
    """A torch.compile'd pass was about to run as plain Python (compilation disabled, a
    TorchDispatchMode active, or an error that Dynamo suppressed)."""


def _refuse_eager() -> None:
    """The pointwise passes run under torch.compile only: where Dynamo would run one eagerly
    over all rows (an fp32 copy of them all), it raises _RanEagerly before any work instead
    (CompiledPass then takes the eager passes in chunks). Traced, this is a constant."""
    if not torch.compiler.is_compiling():
        raise _RanEagerly


# Why the compiled passes run eagerly in this process (logged once each).
_FALLBACKS: Set[str] = set()
# Set once a compilation failed: the passes stay eager from then on (no retry each call).
_COMPILE_FAILED: Set[str] = set()


def _fall_back(reason: str) -> None:
    if reason not in _FALLBACKS:
        _FALLBACKS.add(reason)
        logger.warning(
            "del_megatron: the 'compiled' kernel runs its passes eagerly in chunks of %d MiB "
            "(as 'recompute'): %s",
            EAGER_CHUNK_BYTES // 2**20,
            reason,
        )


class CompiledPass:
    """A pass torch.compile'd (dynamic shapes, one graph) over all rows it is given; where
    compilation is off or fails, the eager pass over EAGER_CHUNK_BYTES of fp32 rows at a time,
    so that nothing of [N, V/tp] in fp32 is ever made (logged once). Fake tensors
    (FakeTensorMode) take the eager route without a word; a caller's own torch.compile traces
    the pointwise pass into its graph."""

    def __init__(self, pointwise: Callable, eager: Callable) -> None:
        self.pointwise, self.eager = pointwise, eager
        self.compiled = torch.compile(pointwise, dynamic=True, fullgraph=True)
        functools.update_wrapper(self, pointwise)

    def __call__(self, logits: torch.Tensor, *rest: torch.Tensor):
        from torch._guards import detect_fake_mode

        if torch.compiler.is_compiling():  # traced into a caller's graph: inline the pass
            return self.pointwise(logits, *rest)
        if not _COMPILE_FAILED and detect_fake_mode((logits, *rest)) is None:
            try:
                return self.compiled(logits, *rest)
            except _RanEagerly:
                _fall_back(
                    "torch.compile ran the pass as plain Python (disabled by "
                    "TORCH_COMPILE_DISABLE=1 or torch._dynamo.config.disable, under a "
                    "TorchDispatchMode, or after a compile error it suppressed)"
                )
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # any compile failure: the eager passes give the same
                if _device_failure(exc):
                    raise  # a dead CUDA context (a failed device-side check), not the compiler
                _COMPILE_FAILED.add(type(exc).__name__)
                _fall_back(f"torch.compile failed ({type(exc).__name__}: {exc})".split("\n")[0])
        return _in_chunks(self.eager, logits, *rest)


def _device_failure(exc: Exception) -> bool:
    """Whether `exc` is the device failing (a device-side assert surfacing here, a CUDA runtime
    error) rather than torch.compile: retrying eagerly would fail again and log a misleading
    "torch.compile failed"."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return "CUDA error" in text or "device-side assert" in text


def _in_chunks(eager: Callable, logits: torch.Tensor, *rows: torch.Tensor):
    """eager(logits, *rows) over EAGER_CHUNK_BYTES of fp32 rows at a time: ([n], [n]) for
    the first pass, [n, V/tp] for the second."""
    n, step = logits.size(0), default_chunk_tokens(logits.size(-1))
    if step >= n:
        return eager(logits, *rows)
    parts = [slice(start, start + step) for start in range(0, n, step)]
    if not rows:  # the first pass: row maxima and sums of exp
        dtype = compute_dtype(logits)
        row_max = torch.empty(n, dtype=dtype, device=logits.device)
        sum_exp = torch.empty_like(row_max)
        for part in parts:
            row_max[part], sum_exp[part] = eager(logits[part])
        return row_max, sum_exp
    grad = torch.empty_like(logits)
    for part in parts:
        grad[part] = eager(logits[part], *(r[part] for r in rows))
    return grad


def passes(compiled: bool) -> Tuple[Callable, Callable]:
    """The forward and backward passes: eager, or torch.compile'd pointwise forms (CompiledPass:
    one graph each for any number of rows, falling back to the eager passes in chunks). The
    same objects at every call."""
    if not compiled:
        return max_and_sum_exp, softmax_minus_onehot
    return _compiled_passes()


@cache
def _compiled_passes() -> Tuple[CompiledPass, CompiledPass]:
    return (
        CompiledPass(max_and_sum_exp_pointwise, max_and_sum_exp),
        CompiledPass(softmax_minus_onehot_pointwise, softmax_minus_onehot),
    )


def statistics(
    logits: torch.Tensor,
    rows: TargetRows,
    plan: KernelPlan,
    numbers: NumberColumns,
    first_pass: Callable,
    step: int,
    check_sizes: bool,
) -> Tuple[torch.Tensor, ...]:
    """Forward over logits [n, V/tp], `step` rows converted at a time, with the MAX and SUM
    all-reduces: ce [n] (0 on ignored rows), the number columns' output [n, W] (the digit
    logits, or a chunking vocab's slot logits), the row maxima (shift) [n], the log-sum-exp of
    the logits minus them [n], all in the compute dtype, and the number columns' values
    [n, K] (None where they read none). numbers: plan.numbers bound to these rows' labels."""
    dtype, device, n = compute_dtype(logits), logits.device, logits.size(0)
    maxima, shift, number_max = new_maxima(n, dtype, device, numbers.maxima_width)
    local_sum = torch.empty(n, dtype=dtype, device=device)
    for start in range(0, n, step):
        part = slice(start, start + step)
        shift[part], local_sum[part] = first_pass(logits[part])
    local_max = shift.clone()
    values = numbers.values(logits, dtype)
    numbers.write_local_maxima_(number_max, values)
    global_row_max(maxima, plan.shard, check_sizes)  # shift: the global row maxima from here

    packed = new_packed(n, numbers.out_width, dtype, device)
    torch.mul(local_sum, torch.exp(local_max - shift), out=packed[:, SUM_EXP])
    packed[:, TARGET_LOGIT] = target_logit(logits, rows, dtype)
    numbers.write_partials_(packed[:, DIGITS], values, number_max)
    sum_packed(packed, plan.shard)

    log_sum_exp = torch.log(packed[:, SUM_EXP])
    ce = torch.where(rows.valid, log_sum_exp - (packed[:, TARGET_LOGIT] - shift), 0.0)
    out = numbers.finish(packed[:, DIGITS], number_max)
    return ce, out, shift, log_sum_exp, values


def gradient_into(
    grad: Optional[torch.Tensor],
    logits: torch.Tensor,
    shift: torch.Tensor,
    log_sum_exp: torch.Tensor,
    rows: TargetRows,
    numbers: NumberColumns,
    second_pass: Callable,
    step: int,
    grad_ce: Optional[torch.Tensor],
    grad_out: Optional[torch.Tensor],
    forward_values: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """d(loss)/d(logits) [n, V/tp] in the logits' dtype, `step` rows at a time, given the
    upstream gradients of ce [n] and of the number columns' output [n, W] (None: zero). Written
    into `grad` (which may be `logits` itself); grad None: a new buffer. Returns it. numbers:
    the number columns bound to forward's (with_forward; for a vocab tile, within).

    forward_values (target probability exp(-ce) [n], numbers.forward_values of forward), as
    forward formed them: the target and number columns take their gradient from these, not
    from `logits`, when `logits` were multiplied out again by another matmul (a vocab tile's may
    differ from forward's in the last bits, and a saturated target's gradient p - 1 is all
    rounding)."""
    scale = upstream_scale(grad_ce, rows, shift)
    onehot_column = rows.onehot_column()
    n = logits.size(0)
    # The number columns' values are read before an in-place gradient overwrites them.
    values = None
    if numbers.columns:
        if forward_values is not None:
            values = numbers.values_from_forward(forward_values[1]).to(shift.dtype)
        else:
            values = numbers.backward_values(logits, shift.dtype)
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
    if numbers.columns:
        # The number columns get their whole gradient in the compute dtype, rounded once.
        column_grad = numbers.column_gradient(
            values, shift, log_sum_exp, scale, onehot_column, grad_out
        )
        numbers.set_gradient_(grad, column_grad)
    return grad


def upstream_scale(
    grad_ce: Optional[torch.Tensor], rows: TargetRows, like: torch.Tensor
) -> torch.Tensor:
    """[n] the upstream gradient of ce on rows that count (0 elsewhere, or everywhere for
    grad_ce None), in like's dtype."""
    if grad_ce is None:
        return torch.zeros_like(like)
    return torch.where(rows.valid, grad_ce, 0.0).to(like.dtype)


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
    numbers = plan.numbers.for_labels(target)
    first_pass, _ = passes(compiled)
    ce, out, shift, log_sum_exp, values = statistics(
        logits, rows, plan, numbers, first_pass, plan.chunk_tokens, plan.validate
    )
    # What the number columns keep of forward (a chunking vocab: its layout values and slot
    # logits, so that backward does not read the 1,110 columns again).
    numbers = numbers.with_forward(values, out)
    ctx.save_for_backward(logits, shift, log_sum_exp, *rows, *numbers.saved())
    ctx.plan, ctx.compiled = plan, compiled
    ctx.set_materialize_grads(False)
    return ce, out


def _backward(ctx, grad_ce: Optional[torch.Tensor], grad_out: Optional[torch.Tensor]):
    logits, shift, log_sum_exp, valid, in_shard, local_target, *number_tensors = ctx.saved_tensors
    plan = ctx.plan
    _, second_pass = passes(ctx.compiled)
    grad = gradient_into(
        logits if plan.inplace else None,
        logits,
        shift,
        log_sum_exp,
        TargetRows(valid, in_shard, local_target),
        plan.numbers.from_saved(tuple(number_tensors)),
        second_pass,
        plan.chunk_tokens,
        grad_ce,
        grad_out,
    )
    return grad, None, None


class RecomputeDigitCrossEntropy(torch.autograd.Function):
    """(logits [N, V/tp], target [N], plan) -> (ce [N], digit_logits [N, W]), as the softmax
    kernel, eager passes over plan.chunk_tokens rows at a time. Saves the logits; the caller must
    not change them before backward (autograd checks). With plan.inplace, backward writes the
    gradient over them, chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, plan: KernelPlan):
        return _forward(ctx, logits, target, plan, compiled=False)

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_out: Optional[torch.Tensor]):
        return _backward(ctx, grad_ce, grad_out)


class CompiledDigitCrossEntropy(RecomputeDigitCrossEntropy):
    """The recompute kernel with each pass torch.compile'd (by default over all rows at once;
    CompiledPass)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, plan: KernelPlan):
        return _forward(ctx, logits, target, plan, compiled=True)
