"""The vocab-parallel primitive: per-token cross-entropy and the ten digit logits in one pass.

Works on a [N, V/tp] logits shard (rank r holds the contiguous ids [r * V/tp, (r + 1) * V/tp)),
with the same passes over the shard as Megatron-Core's `vocab_parallel_cross_entropy`:
MAX all-reduce of the row maxima, then ONE SUM all-reduce of a small [N, 12] buffer carrying the
sum of exponentials, the target logit and the ten digit logits. The backward pass needs no
collective: it writes `softmax - onehot` into the saved softmax and adds the digit gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .vocab import NUM_DIGITS, DigitVocab

ProcessGroup = Optional["dist.ProcessGroup"]


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logits columns sit in the full vocabulary."""

    group: ProcessGroup
    rank: int
    world_size: int
    local_size: int

    @property
    def start(self) -> int:
        return self.rank * self.local_size

    @property
    def end(self) -> int:
        return self.start + self.local_size

    @property
    def full_size(self) -> int:
        return self.world_size * self.local_size

    @classmethod
    def of(cls, local_size: int, group: ProcessGroup) -> VocabShard:
        if group is None:
            return cls(None, 0, 1, local_size)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), local_size)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)


class DigitColumns(NamedTuple):
    """Local column of each digit id (clamped into the shard) [10] and whether this rank owns it."""

    columns: torch.Tensor
    owned: torch.Tensor

    @classmethod
    def of(cls, vocab: DigitVocab, shard: VocabShard, device: torch.device) -> DigitColumns:
        ids = torch.tensor(vocab.digit_ids, device=device)
        owned = (ids >= shard.start) & (ids < shard.end)
        return cls(torch.where(owned, ids - shard.start, 0), owned)


class TargetRows(NamedTuple):
    """Per-row target facts, each [N]: not ignored, owned by this shard, local column (0 if not)."""

    valid: torch.Tensor
    in_shard: torch.Tensor
    local_target: torch.Tensor

    @classmethod
    def of(
        cls, target: torch.Tensor, shard: VocabShard, ignore_index: int, validate: bool
    ) -> TargetRows:
        """With `validate`, labels outside the whole vocab are refused (one host sync)."""
        valid = target != ignore_index
        if validate:
            check_labels_in_vocab(target, valid, shard.full_size)
        in_shard = valid & (target >= shard.start) & (target < shard.end)
        return cls(valid, in_shard, torch.where(in_shard, target - shard.start, 0))

    def rows(self, index: slice) -> TargetRows:
        return TargetRows(self.valid[index], self.in_shard[index], self.local_target[index])


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (a checking dtype), fp32 for everything else."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_shard_sizes(maxima: torch.Tensor, shard: VocabShard) -> None:
    """The MAX all-reduce also carried +-local_size (its last two entries): all ranks see the same
    verdict, so all of them raise together and no collective is left waiting."""
    largest, neg_smallest = maxima[-2].item(), maxima[-1].item()
    if largest != -neg_smallest:
        raise ValueError(
            f"tensor-parallel logits shards disagree in size (between {int(-neg_smallest)} and "
            f"{int(largest)} columns; this rank has {shard.local_size}): every rank must hold an "
            "equal contiguous vocab shard, as Megatron's ColumnParallelLinear output layer gives "
            "(pad the vocab to a multiple of the tensor-parallel size)"
        )


def global_row_max(maxima: torch.Tensor, shard: VocabShard, check_sizes: bool) -> torch.Tensor:
    """maxima [N + 2] holds this shard's row maxima in its first N entries: MAX all-reduce them,
    with +-local size in the last two for the shard-size check. Returns the global maxima [N]."""
    maxima[-2] = shard.local_size
    maxima[-1] = -shard.local_size
    shard.all_reduce(maxima, dist.ReduceOp.MAX)
    if check_sizes and shard.world_size > 1:
        _check_shard_sizes(maxima, shard)
    return maxima[:-2]


def check_labels_in_vocab(target: torch.Tensor, valid: torch.Tensor, full_size: int) -> None:
    bad = valid & ((target < 0) | (target >= full_size))
    if bool(bad.any()):
        values = target[bad]
        raise ValueError(
            f"labels hold ids outside the vocabulary of {full_size} ids (min {int(values.min())}, "
            f"max {int(values.max())}); mark ignored positions with ignore_index, or check that "
            "the logits are the whole vocab (tp_group=None) or this rank's shard of it"
        )


def softmax_cross_entropy_(
    work: torch.Tensor,
    rows: TargetRows,
    digits: DigitColumns,
    shard: VocabShard,
    check_sizes: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Overwrites `work` [N, V/tp] (fp32/fp64 logits) with the softmax over the full vocab.

    Returns ce [N] (0 on ignored rows), the raw digit logits [N, 10], the row maxima [N] and
    the log-sum-exp of the logits minus those maxima [N]. Two collectives: a MAX all-reduce of
    [N + 2] (row maxima and +-local size) and a SUM all-reduce of [N, 12].
    """
    dtype = work.dtype
    # [N, 12]: sum of exp | shifted target logit | ten raw digit logits.
    packed = torch.empty(work.size(0), 2 + NUM_DIGITS, dtype=dtype, device=work.device)
    packed[:, 2:] = torch.where(digits.owned, work[:, digits.columns], 0.0)

    maxima = torch.empty(work.size(0) + 2, dtype=dtype, device=work.device)
    torch.amax(work, dim=-1, out=maxima[:-2])
    row_max = global_row_max(maxima, shard, check_sizes)

    work.sub_(row_max.unsqueeze(-1))
    target_logit = work.gather(-1, rows.local_target.unsqueeze(-1)).squeeze(-1)
    packed[:, 1] = torch.where(rows.in_shard, target_logit, 0.0)
    work.exp_()
    torch.sum(work, dim=-1, out=packed[:, 0])
    shard.all_reduce(packed, dist.ReduceOp.SUM)
    sum_exp, target_logit = packed[:, 0], packed[:, 1]

    log_sum_exp = torch.log(sum_exp)
    ce = torch.where(rows.valid, log_sum_exp - target_logit, 0.0)
    work.div_(sum_exp.unsqueeze(-1))
    return ce, packed[:, 2:].contiguous(), row_max, log_sum_exp


def softmax_gradient_(
    grad: torch.Tensor,
    rows: TargetRows,
    digits: DigitColumns,
    grad_ce: Optional[torch.Tensor],
    grad_digits: Optional[torch.Tensor],
) -> torch.Tensor:
    """Turns the softmax `grad` [N, V/tp] in place into d(loss)/d(logits) given the upstream
    gradients of ce [N] and of the digit logits [N, 10] (None: zero)."""
    if grad_ce is None:
        grad.zero_()
    else:
        onehot = rows.in_shard.to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, rows.local_target.unsqueeze(-1), -onehot)
        grad.mul_(torch.where(rows.valid, grad_ce, 0.0).to(grad.dtype).unsqueeze(-1))
    if grad_digits is not None:
        local = torch.where(digits.owned, grad_digits.to(grad.dtype), 0.0)
        grad.scatter_add_(-1, digits.columns.expand_as(local), local)
    return grad


class DigitCrossEntropy(torch.autograd.Function):
    """(logits [N, V/tp], target [N]) -> (ce [N], digit_logits [N, 10]).

    ce is 0 on rows whose target is ignore_index (and so is their gradient). Computation is fp32
    (fp64 for fp64 logits). Unless `inplace`, fp32/fp64 logits are copied once; bf16/fp16 logits
    always are (the copy becomes the saved softmax, as in Megatron). Backward overwrites the
    saved softmax with the gradient, so it runs once (fp64 excepted).
    """

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab: DigitVocab,
        shard: VocabShard,
        ignore_index: int,
        inplace: bool,
        validate: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(logits)
        if logits.dtype == dtype:
            work = logits if inplace else logits.clone()
        else:
            work = logits.to(dtype)
        rows = TargetRows.of(target, shard, ignore_index, validate)
        digits = DigitColumns.of(vocab, shard, logits.device)
        ce, digit_logits, _, _ = softmax_cross_entropy_(work, rows, digits, shard, validate)

        ctx.save_for_backward(work, *rows, *digits)
        ctx.set_materialize_grads(False)
        return ce, digit_logits

    @staticmethod
    def backward(ctx, grad_ce: Optional[torch.Tensor], grad_digits: Optional[torch.Tensor]):
        softmax, valid, in_shard, local_target, columns, owned = ctx.saved_tensors
        # Reused in place as Megatron does; fp64 (a checking dtype) keeps it so that backward can
        # run more than once (gradcheck).
        grad = softmax.clone() if softmax.dtype == torch.float64 else softmax
        rows, digits = TargetRows(valid, in_shard, local_target), DigitColumns(columns, owned)
        softmax_gradient_(grad, rows, digits, grad_ce, grad_digits)
        return grad, None, None, None, None, None, None


KERNELS = ("auto", "softmax", "recompute", "compiled")


def resolve_kernel(kernel: str, logits: torch.Tensor, inplace: bool) -> str:
    """The kernel that `kernel` names for these logits. "auto": "compiled" on CUDA; elsewhere
    "softmax" for fp32/fp64 logits that may be overwritten (no conversion to make, and the
    softmax is computed in their buffer), else "recompute" (nothing [N, V/tp] in fp32 kept)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel != "auto":
        return kernel
    if logits.device.type == "cuda":
        return "compiled"
    if inplace and logits.dtype in (torch.float32, torch.float64):
        return "softmax"
    return "recompute"


def digit_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab: DigitVocab,
    tp_group: ProcessGroup = None,
    ignore_index: int = -100,
    inplace: bool = False,
    validate: bool = True,
    kernel: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token CE [N] and digit logits [N, 10] from logits [N, V/tp] and targets [N] (int64).

    `tp_group=None`: `logits` hold the whole vocab. `inplace=True` lets the logits be overwritten
    (by the gradient; with kernel="softmax", fp32 logits by the softmax first) to save one
    [N, V/tp] buffer. `validate` checks labels
    against the vocab (one host sync) and that shard sizes agree. `kernel`: "softmax" keeps an
    fp32 softmax for backward (Megatron's scheme); "recompute"
    (recompute.py) keeps the logits instead and recomputes the softmax in backward, in row chunks;
    "compiled" does the same with each pass fused by torch.compile; "auto": see resolve_kernel.
    """
    shard = VocabShard.of(logits.size(-1), tp_group)
    vocab.check_vocab_size(shard.full_size)
    kernel = resolve_kernel(kernel, logits, inplace)
    if kernel != "softmax":
        from .recompute import RecomputeDigitCrossEntropy

        compiled = kernel == "compiled"
        return RecomputeDigitCrossEntropy.apply(
            logits, target, vocab, shard, ignore_index, validate, compiled, inplace
        )
    return DigitCrossEntropy.apply(logits, target, vocab, shard, ignore_index, inplace, validate)
