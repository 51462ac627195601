"""The vocab-parallel primitive: per-token cross-entropy and the ten digit logits (or a chunking
vocab's slot logits) in one pass.

Every kernel computes, from a [N, V/tp] logits shard (rank r holds ids [r * V/tp, (r+1) * V/tp);
the linear kernel multiplies the shard out of hidden [N, h] and weight [V/tp, h] chunk by chunk),
ce [N] and the raw digit logits [N, W] (W = 10; for a chunking vocab the slot logits, W = 30,
formed from each rank's partial sums: slot_columns.py; the two kinds of number columns, the ten
digits' (digit_columns.py) and the slots', are one NumberColumns protocol, number_columns.py),
with the same two collectives
(common.py): one MAX all-reduce (with the shard-size check) and one SUM all-reduce of
[N, 2 + W]. Backward needs none
(the linear kernel adds Megatron's SUM of grad_hidden). Each kernel is one autograd Function,
called as Kernel.apply(*inputs, target, plan); digit_cross_entropy below picks and calls one.

| kernel    | keeps for backward                        | "auto" picks it                       |
|-----------|-------------------------------------------|---------------------------------------|
| softmax   | fp32 softmax [N, V/tp] (the logits' own   | off CUDA, fp32/fp64 logits, inplace   |
|           | buffer with inplace)                      |                                       |
| recompute | the caller's logits + two [N] vectors     | off CUDA, otherwise                   |
| compiled  | as recompute; passes torch.compile'd      | on CUDA                               |
|           | (eager chunks where compile is off)       |                                       |
| linear    | hidden, weight + two [N] vectors; with    | numerical_linear_loss (its only one); |
|           | ce_weights grad_hidden [N, h] and, on the | its passes as "compiled" on CUDA, as  |
|           | "forward" route, an fp32 grad_weight      | "recompute" elsewhere                 |
|           | [V/tp, h], formed in forward              |                                       |
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..digits.vocab import DigitVocab
from . import linear, recompute
from .common import (
    KernelPlan,
    ProcessGroup,
    VocabShard,
    check_chunk_tokens,
)
from .digit_columns import DigitColumns
from .linear import LinearDigitCrossEntropy
from .recompute import CompiledDigitCrossEntropy, RecomputeDigitCrossEntropy
from .slot_columns import SlotColumns
from .softmax import SoftmaxDigitCrossEntropy

KERNELS = ("auto", "softmax", "recompute", "compiled")
FUNCTIONS = {
    "softmax": SoftmaxDigitCrossEntropy,
    "recompute": RecomputeDigitCrossEntropy,
    "compiled": CompiledDigitCrossEntropy,
    "linear": LinearDigitCrossEntropy,
}


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def resolve_kernel(kernel: str, logits: torch.Tensor, inplace: bool) -> str:
    """The kernel that `kernel` names for these logits; see the table above."""
    if check_kernel(kernel) != "auto":
        return kernel
    if logits.device.type == "cuda":
        return "compiled"
    if inplace and logits.dtype in (torch.float32, torch.float64):
        return "softmax"
    return "recompute"


def _linear_kernel(kernel: str, inplace: bool) -> str:
    """The linear kernel is the only one for (hidden, weight); it has no logits to overwrite."""
    if kernel not in ("auto", "linear"):
        check_kernel(kernel)
        raise ValueError(
            f"numerical_linear_loss has one kernel, 'linear' (kernel={kernel!r} needs the "
            "logits: use numerical_lm_loss for it)"
        )
    if inplace:
        raise ValueError("numerical_linear_loss keeps no logits, so inplace=True has nothing to do")
    return "linear"


def _chunk_tokens(
    kernel: str, chunk_tokens: Optional[int], shard: VocabShard, n: int, inplace: bool
) -> int:
    if chunk_tokens is not None:
        if kernel == "softmax":
            raise ValueError(
                "kernel 'softmax' works on all rows at once; chunk_tokens applies to the "
                "'recompute' and 'compiled' kernels and to numerical_linear_loss"
            )
        return check_chunk_tokens(chunk_tokens)
    if kernel == "recompute":
        return recompute.default_chunk_tokens(shard.local_size)
    if kernel == "linear":
        return linear.default_chunk_tokens(shard.local_size, n)
    if kernel == "compiled":
        return recompute.compiled_chunk_tokens(shard.local_size, n, inplace)
    return max(1, n)


def digit_cross_entropy(
    inputs: Tuple[torch.Tensor, ...],
    target: torch.Tensor,
    vocab: DigitVocab,
    tp_group: ProcessGroup = None,
    *,
    ignore_index: int = -100,
    kernel: str = "auto",
    inplace: bool = False,
    validate: bool = True,
    chunk_tokens: Optional[int] = None,
    ce_weights: Optional[torch.Tensor] = None,
    weight_gradient: str = linear.DEFAULT_WEIGHT_GRADIENT,
    slot_logits: str = "any",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token CE [N] and the number tokens' output [N, W] for targets [N] (int64): the ten
    digit logits (W = 10), or for a chunking vocab the slot logits of each label's digits
    (W = 30: z^(1) | z^(2) | z^(3), docs/DEL.md).

    inputs: (logits [N, V/tp],), or (hidden [N, h], weight [V/tp, h]) for the linear kernel,
    which multiplies the logits out chunk by chunk and never holds them whole.
    tp_group=None: the logits (weight) hold the WHOLE vocab, not "the default TP group".
    inplace=True lets the logits be overwritten (by the gradient; with "softmax", fp32 logits by
    the softmax first) to save one [N, V/tp] buffer. validate checks labels against the vocab
    (on the device, no host sync) and that shard sizes agree (read on the host the first time a
    group sees a shard size). chunk_tokens: rows a pass takes at once (defaults:
    recompute.default_chunk_tokens, recompute.compiled_chunk_tokens and
    linear.default_chunk_tokens; "softmax" always takes all rows). ce_weights [N] (linear
    kernel only): the weights the caller reduces ce by, up to a scalar; forward then forms the
    gradients and backward scales them, on the "forward" weight-gradient route
    (LinearDigitCrossEntropy). weight_gradient (linear kernel only): "forward", "backward" or
    "auto", where the gradients are formed (kernels/linear.py). slot_logits (a chunking vocab):
    "any" or "length", which tokens a slot's groups take (slots.py); "length" returns its groups'
    logits, before slots.length_conditioned's per-row offsets.
    """
    n = inputs[0].size(0)
    if len(inputs) == 2:
        kernel = _linear_kernel(kernel, inplace)
        local_vocab = inputs[1].size(0)
        hidden_size, dtype = inputs[0].size(-1), inputs[0].dtype
        route = linear.resolve_weight_gradient(weight_gradient, n, local_vocab, hidden_size, dtype)
    else:
        kernel = resolve_kernel(kernel, inputs[0], inplace)
        local_vocab, route = inputs[0].size(-1), "forward"
        if ce_weights is not None or weight_gradient != linear.DEFAULT_WEIGHT_GRADIENT:
            raise ValueError(
                "ce_weights and weight_gradient apply to the linear kernel (hidden, weight) only"
            )
    shard = VocabShard.of(local_vocab, tp_group)
    chunk_tokens = _chunk_tokens(kernel, chunk_tokens, shard, n, inplace)
    vocab.check_vocab_size(shard.full_size)
    if vocab.chunked:
        numbers = SlotColumns.of(vocab, shard, slot_logits)
    else:
        numbers = DigitColumns.of(vocab, shard)
    plan = KernelPlan(
        shard, numbers, ignore_index, validate, inplace, chunk_tokens, ce_weights, route
    )
    return FUNCTIONS[kernel].apply(*inputs, target, plan)


__all__ = [
    "KERNELS",
    "CompiledDigitCrossEntropy",
    "LinearDigitCrossEntropy",
    "RecomputeDigitCrossEntropy",
    "SoftmaxDigitCrossEntropy",
    "digit_cross_entropy",
    "resolve_kernel",
]
