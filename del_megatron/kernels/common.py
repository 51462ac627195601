"""What every kernel shares: where this rank's vocab shard sits, the per-row target facts, the
number-token columns, the compute dtype, the chunk size, and the two collectives.

The collectives are the whole communication of the primitive (docs/DEL.md, "tensor parallelism"):
one MAX all-reduce of the row maxima that also carries +-local_size for the shard-size check
(and NumberColumns.maxima_width more a row: a chunking vocab's 20 slot-group maxima), and one
SUM all-reduce of an [N, 2 + W] buffer (sum of exp | target logit | the ten digit logits, or a
chunking vocab's 30 slot partial sums: number_columns.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ..device import check_on_device
from .number_columns import NumberColumns

# A tensor-parallel group, or None: the logits hold the WHOLE vocabulary (no tensor parallelism).
# Not Megatron-Core's convention, where None in vocab_parallel_cross_entropy means "the default
# TP group of parallel_state": port a call site by passing the group explicitly.
ProcessGroup = Optional["dist.ProcessGroup"]

# Columns of the packed SUM buffer: sum of exp, target logit, then the number tokens' W.
SUM_EXP, TARGET_LOGIT, DIGITS = 0, 1, slice(2, None)


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
        """group None: one shard, the whole vocabulary."""
        if group is None:
            return cls(None, 0, 1, local_size)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), local_size)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)


class TargetRows(NamedTuple):
    """Per-row target facts, each [N]: not ignored, owned by this shard, local column (0 if not)."""

    valid: torch.Tensor
    in_shard: torch.Tensor
    local_target: torch.Tensor

    @classmethod
    def of(
        cls, target: torch.Tensor, shard: VocabShard, ignore_index: int, validate: bool
    ) -> TargetRows:
        """With `validate`, labels outside the whole vocab are refused (check_labels_in_vocab:
        no host sync)."""
        valid = target != ignore_index
        if validate:
            check_labels_in_vocab(target, valid, shard.full_size)
        in_shard = valid & (target >= shard.start) & (target < shard.end)
        return cls(valid, in_shard, torch.where(in_shard, target - shard.start, 0))

    def rows(self, index: slice) -> TargetRows:
        return TargetRows(self.valid[index], self.in_shard[index], self.local_target[index])

    def within(self, start: int, end: int) -> TargetRows:
        """The same rows seen from local columns [start, end) (a vocab tile): a target counts as
        in the shard only if it falls in the tile, its column numbered from start."""
        in_tile = self.in_shard & (self.local_target >= start) & (self.local_target < end)
        return TargetRows(self.valid, in_tile, torch.where(in_tile, self.local_target - start, 0))

    def onehot_column(self) -> torch.Tensor:
        """[N] local target column, -1 where this shard holds no target."""
        return torch.where(self.in_shard, self.local_target, -1)


@dataclass(frozen=True)
class KernelPlan:
    """Everything a kernel needs besides its tensors; the last argument of every kernel's
    autograd Function: Kernel.apply(*inputs, target, plan)."""

    shard: VocabShard
    numbers: NumberColumns
    ignore_index: int
    validate: bool
    inplace: bool
    chunk_tokens: int
    # Linear kernel only: [N] per-row weights the caller reduces ce by (Megatron's loss mask),
    # up to one scalar; None: the gradients are multiplied out again in backward.
    ce_weights: Optional[torch.Tensor] = None
    # Linear kernel only: where the weight gradient is formed, "forward" (an fp32 accumulator
    # over token chunks) or "backward" (vocab tile by vocab tile); see kernels/linear.py.
    weight_gradient: str = "forward"


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (a checking dtype), fp32 for everything else."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rows_per_chunk(local_vocab: int, chunk_bytes: int) -> int:
    """Rows of a [rows, local_vocab] fp32 chunk that fit in chunk_bytes (at least one)."""
    return max(1, chunk_bytes // (4 * local_vocab))


def check_chunk_tokens(chunk_tokens) -> int:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    return chunk_tokens


LABELS_OUTSIDE = (
    "labels hold ids outside the vocabulary of {full_size} ids; mark ignored positions with "
    "ignore_index, or check that the logits are the whole vocab (tp_group=None) or this rank's "
    "shard of it"
)


def check_labels_in_vocab(target: torch.Tensor, valid: torch.Tensor, full_size: int) -> None:
    """Refuse labels outside [0, full_size) on rows that count, on the device (no host sync;
    check_on_device: ValueError on a CPU, a device-side assert on CUDA)."""
    bad = valid & ((target < 0) | (target >= full_size))

    def found() -> str:
        values = target[bad]
        return f" (min {int(values.min())}, max {int(values.max())})"

    check_on_device(~bad.any(), LABELS_OUTSIDE.format(full_size=full_size), found)


def new_maxima(
    n: int, dtype: torch.dtype, device: torch.device, width: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffer for global_row_max, [N * (1 + width) + 2]: row maxima, then `width` more
    maxima a row (NumberColumns.maxima_width), then two entries for the size check. Returns it
    and its views of the row maxima [N] and of the others [N, width]."""
    maxima = torch.empty(n * (1 + width) + 2, dtype=dtype, device=device)
    return maxima, maxima[:n], maxima[n:-2].view(n, width)


# (group, local_size) pairs whose shard sizes were checked across the group (global_row_max).
_SIZES_CHECKED: Set[Tuple[object, int]] = set()


def global_row_max(maxima: torch.Tensor, shard: VocabShard, check_sizes: bool) -> torch.Tensor:
    """The MAX all-reduce. maxima [N + 2] holds this shard's row maxima in its first N entries;
    the last two carry +-local_size, so that every rank sees the same shard-size verdict and all
    of them raise together (no collective is left waiting). The verdict is read on the host
    (one sync) the first time a group sees a shard size; later calls with the same sizes skip
    it. Reduces in place (new_maxima's views then hold the global maxima) and returns
    maxima[:-2]."""
    n = maxima.numel() - 2
    maxima.narrow(0, n, 1).fill_(shard.local_size)
    maxima.narrow(0, n + 1, 1).fill_(-shard.local_size)
    shard.all_reduce(maxima, dist.ReduceOp.MAX)
    key = (shard.group, shard.local_size)
    if check_sizes and shard.world_size > 1 and key not in _SIZES_CHECKED:
        largest, neg_smallest = maxima[n:].tolist()
        if largest != -neg_smallest:
            raise ValueError(
                f"tensor-parallel logits shards disagree in size (between {int(-neg_smallest)} "
                f"and {int(largest)} columns; this rank has {shard.local_size}): every rank must "
                "hold an equal contiguous vocab shard, as Megatron's ColumnParallelLinear output "
                "layer gives (pad the vocab to a multiple of the tensor-parallel size)"
            )
        _SIZES_CHECKED.add(key)
    return maxima[:n]


def new_packed(n: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[N, 2 + width] zeros: sum of exp | target logit | the number columns' width entries
    (digit logits, or slot partial sums), for sum_packed."""
    return torch.zeros(n, 2 + width, dtype=dtype, device=device)


def sum_packed(packed: torch.Tensor, shard: VocabShard) -> None:
    """The SUM all-reduce: each rank's partial sums of exp, its target logits (0 where another
    shard holds the target) and its number columns' entries (0 where another shard holds the
    digit)."""
    shard.all_reduce(packed, dist.ReduceOp.SUM)


def target_logit(logits: torch.Tensor, rows: TargetRows, dtype: torch.dtype) -> torch.Tensor:
    """[N] the logit at each row's target on this shard (0 where another shard holds it)."""
    picked = logits.gather(-1, rows.local_target.unsqueeze(-1)).squeeze(-1)
    return torch.where(rows.in_shard, picked.to(dtype), 0.0)
