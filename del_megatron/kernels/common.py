"""What every kernel shares: where this rank's vocab shard sits, the per-row target facts, the
number-token columns, the compute dtype, the chunk size, and the two collectives.

The collectives are the whole communication of the primitive (docs/DEL.md, "tensor parallelism"):
one MAX all-reduce of the row maxima that also carries +-local_size for the shard-size check
(and, for a chunking vocab, 20 slot-group maxima a row), and one SUM all-reduce of an
[N, 2 + W] buffer (sum of exp | target logit | the ten digit logits, or a chunking vocab's 30
slot partial sums: kernels/slot_columns.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from ..device import check_on_device, int_tensor, on_device
from ..vocab import NUM_DIGITS, DigitVocab

if TYPE_CHECKING:
    from .slot_columns import SlotColumns

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


@dataclass(frozen=True)
class DigitColumns:
    """The digit tokens (one digit a token) whose ids fall in this shard: their digits k and
    their local columns, as Python tuples; `width` is the ten digits. index() gives them as
    int64 tensors on a device, made once per device (indexing with a Python list copies it
    from the host every time: a sync on CUDA). "Digit logits" below are the raw logits of the
    digits, [N, width]. A chunking vocab's number tokens are SlotColumns
    (kernels/slot_columns.py), with the same methods."""

    digits: Tuple[int, ...]
    columns: Tuple[int, ...]
    width: int = NUM_DIGITS

    @classmethod
    def of(cls, vocab: DigitVocab, shard: VocabShard) -> DigitColumns:
        return _digit_columns(vocab, shard.start, shard.end)

    def index(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(digits, columns), int64 [k] each, on `device`."""
        return (
            on_device(("digits", self.digits), device, int_tensor(self.digits)),
            on_device(("columns", self.columns), device, int_tensor(self.columns)),
        )

    def read(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, k] this shard's digit logits (their columns of logits [N, V/tp])."""
        return logits.index_select(-1, self.index(logits.device)[1])

    # What a kernel's SUM buffer carries per row for these columns (the digit logits), and how
    # many more maxima per row its MAX all-reduce carries (none): see SlotColumns for the others.
    @property
    def out_width(self) -> int:
        return self.width

    maxima_width = 0

    def prefix(self, target: torch.Tensor) -> None:
        """Per-row facts of the label these columns need (none)."""
        return None

    def values(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, k] this shard's digit logits in `dtype`."""
        return self.read(logits).to(dtype)

    def local_maxima(self, values: torch.Tensor, prefix: None) -> torch.Tensor:
        raise NotImplementedError("digit columns carry no maxima")

    def write_partials_(
        self, packed_digits: torch.Tensor, values: torch.Tensor, prefix: None, maxima: None
    ) -> None:
        """packed_digits [N, width] (zeros) gets this shard's digit logits at their digits."""
        if self.columns:
            digits, _ = self.index(values.device)
            packed_digits.index_copy_(-1, digits, values.to(packed_digits.dtype))

    def write_into(self, packed_digits: torch.Tensor, logits: torch.Tensor) -> None:
        """packed_digits [N, width] (zeros) gets this shard's digit logits at their digits."""
        if self.columns:
            values = self.values(logits, packed_digits.dtype)
            self.write_partials_(packed_digits, values, None, None)

    def finish(self, summed: torch.Tensor, maxima: None) -> torch.Tensor:
        """[N, width] the digit logits from the reduced SUM buffer's columns."""
        return summed.contiguous()

    def forward_values(self, out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What a kernel keeps of forward to form these columns' gradient from: the digit
        logits [N, width] it returned."""
        return out

    def values_from_forward(self, kept: torch.Tensor) -> torch.Tensor:
        """[N, k] this shard's values from forward_values' [N, width]."""
        return self.of_digits(kept)

    def column_gradient(
        self,
        values: torch.Tensor,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        prefix: None,
        out: Optional[torch.Tensor],
        grad_out: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """[N, k] the whole gradient at this shard's digit columns, in values' dtype: the
        softmax's (p - onehot) * scale plus grad_out [N, width] (None: zero)."""
        probs = torch.exp(values - shift.unsqueeze(-1) - log_sum_exp.unsqueeze(-1))
        hit = onehot_column.unsqueeze(-1) == self.index(values.device)[1]
        grad = (probs - hit.to(probs.dtype)) * scale.unsqueeze(-1)
        if grad_out is not None:
            grad += self.of_digits(grad_out).to(grad.dtype)
        return grad

    def term_gradient(
        self,
        grad_out: torch.Tensor,
        values: Optional[torch.Tensor],
        prefix: None,
        out: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """[N, k] the gradient that grad_out [N, width] gives this shard's digit columns."""
        return self.of_digits(grad_out)

    def add_term_gradient_(
        self,
        grad: torch.Tensor,
        values: Optional[torch.Tensor],
        prefix: None,
        out: Optional[torch.Tensor],
        grad_out: torch.Tensor,
    ) -> None:
        """grad [N, V/tp] += the gradient that grad_out [N, width] gives these columns."""
        self.add_gradient_(grad, grad_out)

    def column_index(self, device: torch.device) -> torch.Tensor:
        """int64 [k] this shard's digit columns on `device`."""
        return self.index(device)[1]

    def of_digits(self, per_digit: torch.Tensor) -> torch.Tensor:
        """[N, k] this shard's digits' entries of per_digit [N, width]."""
        return per_digit.index_select(-1, self.index(per_digit.device)[0])

    def add_gradient_(self, grad: torch.Tensor, grad_digits: torch.Tensor) -> None:
        """grad [N, V/tp] += grad_digits [N, width] at this shard's digit columns."""
        if self.columns:
            _, columns = self.index(grad.device)
            grad.index_add_(-1, columns, self.of_digits(grad_digits).to(grad.dtype))

    def set_gradient_(self, grad: torch.Tensor, values: torch.Tensor) -> None:
        """grad [N, V/tp] at this shard's digit columns becomes values [N, k]."""
        grad.index_copy_(-1, self.index(grad.device)[1], values.to(grad.dtype))

    def within(self, start: int, end: int) -> DigitColumns:
        """The digits among local columns [start, end), numbered from start (a vocab tile)."""
        return _within(self, start, end)


# A vocab's number-token columns on a shard: the ten digits (DigitColumns), or a chunking
# vocab's 1,110 number tokens (SlotColumns, kernels/slot_columns.py). Kernels use the same
# methods on both.
NumberColumns = Union["DigitColumns", "SlotColumns"]


@lru_cache(maxsize=256)
def _digit_columns(vocab: DigitVocab, start: int, end: int) -> DigitColumns:
    ids = [i for i, _ in vocab.number_tokens()]
    pairs = [(k, i - start) for k, i in enumerate(ids) if start <= i < end]
    return DigitColumns(tuple(k for k, _ in pairs), tuple(c for _, c in pairs), len(ids))


@lru_cache(maxsize=1024)
def _within(digits: DigitColumns, start: int, end: int) -> DigitColumns:
    both = zip(digits.digits, digits.columns, strict=True)
    pairs = [(k, c - start) for k, c in both if start <= c < end]
    return DigitColumns(tuple(k for k, _ in pairs), tuple(c for _, c in pairs), digits.width)


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
    digits: NumberColumns
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


def new_maxima(n: int, dtype: torch.dtype, device: torch.device, extra: int = 0) -> torch.Tensor:
    """[N * (1 + extra) + 2] buffer for global_row_max: row maxima first, then `extra` more
    maxima a row ([N, extra], a chunking vocab's slot groups), two slots for the size check."""
    return torch.empty(n * (1 + extra) + 2, dtype=dtype, device=device)


# (group, local_size) pairs whose shard sizes were checked across the group (global_row_max).
_SIZES_CHECKED: Set[Tuple[object, int]] = set()


def global_row_max(maxima: torch.Tensor, shard: VocabShard, check_sizes: bool) -> torch.Tensor:
    """The MAX all-reduce. maxima [N + 2] holds this shard's row maxima in its first N entries;
    the last two carry +-local_size, so that every rank sees the same shard-size verdict and all
    of them raise together (no collective is left waiting). The verdict is read on the host
    (one sync) the first time a group sees a shard size; later calls with the same sizes skip
    it. Returns the global maxima: [N], or [N * (1 + extra)] from new_maxima(..., extra)."""
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
