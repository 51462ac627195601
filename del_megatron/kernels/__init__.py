"""The vocab-parallel primitive: per-token cross-entropy and the ten digit logits in one pass.

Every kernel computes, from a [N, V/tp] logits shard (rank r holds ids [r * V/tp, (r+1) * V/tp)),
ce [N] and the raw digit logits [N, 10], with the same two collectives (common.py): one MAX
all-reduce (with the shard-size check) and one SUM all-reduce of [N, 12]. Backward needs none.
Each kernel is one autograd Function, called as Kernel.apply(*inputs, target, plan).

| kernel    | keeps for backward                        | "auto" picks it                       |
|-----------|-------------------------------------------|---------------------------------------|
| softmax   | fp32 softmax [N, V/tp] (the logits' own   | off CUDA, fp32/fp64 logits, inplace   |
|           | buffer with inplace)                      |                                       |
| recompute | the caller's logits + two [N] vectors     | off CUDA, otherwise                   |
| compiled  | as recompute; passes torch.compile'd      | on CUDA                               |
| linear    | hidden, weight + two [N] vectors          | numerical_linear_loss (its only one)  |
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..vocab import DigitVocab
from . import linear, recompute
from .common import (
    DigitColumns,
    KernelPlan,
    ProcessGroup,
    VocabShard,
    check_chunk_tokens,
)
from .linear import LinearDigitCrossEntropy
from .recompute import CompiledDigitCrossEntropy, RecomputeDigitCrossEntropy
from .softmax import SoftmaxDigitCrossEntropy

KERNELS = ("auto", "softmax", "recompute", "compiled")
FUNCTIONS = {
    "softmax": SoftmaxDigitCrossEntropy,
    "recompute": RecomputeDigitCrossEntropy,
    "compiled": CompiledDigitCrossEntropy,
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


def _plan(
    shard: VocabShard,
    vocab: DigitVocab,
    ignore_index: int,
    validate: bool,
    inplace: bool,
    chunk_tokens: int,
) -> KernelPlan:
    vocab.check_vocab_size(shard.full_size)
    digits = DigitColumns.of(vocab, shard)
    return KernelPlan(shard, digits, ignore_index, validate, inplace, chunk_tokens)


def digit_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab: DigitVocab,
    tp_group: ProcessGroup = None,
    *,
    ignore_index: int = -100,
    kernel: str = "auto",
    inplace: bool = False,
    validate: bool = True,
    chunk_tokens: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token CE [N] and digit logits [N, 10] from logits [N, V/tp] and targets [N] (int64).

    tp_group=None: `logits` hold the WHOLE vocab (not "the default TP group"). inplace=True lets
    the logits be overwritten (by the gradient; with "softmax", fp32 logits by the softmax
    first) to save one [N, V/tp] buffer. validate checks labels against the vocab (one host
    sync) and that shard sizes agree. chunk_tokens: rows a pass of "recompute" (default: 8 MiB
    of fp32) or "compiled" (default: all) converts at once; "softmax" takes all rows at once.
    """
    shard = VocabShard.of(logits.size(-1), tp_group)
    kernel = resolve_kernel(kernel, logits, inplace)
    if chunk_tokens is not None:
        check_chunk_tokens(chunk_tokens)
        if kernel == "softmax":
            raise ValueError(
                "kernel 'softmax' works on all rows at once; chunk_tokens applies to the "
                "'recompute' and 'compiled' kernels and to numerical_linear_loss"
            )
    elif kernel == "recompute":
        chunk_tokens = recompute.default_chunk_tokens(shard.local_size)
    else:
        chunk_tokens = max(1, logits.size(0))
    plan = _plan(shard, vocab, ignore_index, validate, inplace, chunk_tokens)
    return FUNCTIONS[kernel].apply(logits, target, plan)


def linear_digit_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab: DigitVocab,
    tp_group: ProcessGroup = None,
    *,
    ignore_index: int = -100,
    validate: bool = True,
    chunk_tokens: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """digit_cross_entropy(hidden @ weight.T, ...) without the logits: hidden [N, h], weight
    [V/tp, h]; chunk_tokens rows at a time (default: 256 MiB of fp32 logits a chunk)."""
    shard = VocabShard.of(weight.size(0), tp_group)
    if chunk_tokens is None:
        chunk_tokens = linear.default_chunk_tokens(shard.local_size)
    check_chunk_tokens(chunk_tokens)
    plan = _plan(shard, vocab, ignore_index, validate, False, chunk_tokens)
    return LinearDigitCrossEntropy.apply(hidden, weight, target, plan)


__all__ = [
    "KERNELS",
    "CompiledDigitCrossEntropy",
    "LinearDigitCrossEntropy",
    "RecomputeDigitCrossEntropy",
    "SoftmaxDigitCrossEntropy",
    "digit_cross_entropy",
    "linear_digit_cross_entropy",
    "resolve_kernel",
]
