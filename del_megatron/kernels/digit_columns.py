"""The ten digit tokens (one digit a token) on one vocab shard: NumberColumns whose output is
the digits' raw logits [N, 10], sent through the SUM all-reduce as they are (each from the shard
that holds it, 0 from the others). They add no maxima and keep nothing for backward, so every
binding method returns the columns themselves."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import torch

from ..device import int_tensor, on_device
from ..digits.vocab import NUM_DIGITS, DigitVocab
from .common import VocabShard


@dataclass(frozen=True)
class DigitColumns:
    """The digits whose ids fall in this shard (or tile): their digits k and their local
    columns, as Python tuples. index() gives them as int64 tensors on a device, made once per
    device (indexing with a Python list copies it from the host every time: a sync on CUDA).
    "Digit logits" are the raw logits of the ten digits, [N, 10]."""

    digits: Tuple[int, ...]
    columns: Tuple[int, ...]

    out_width = NUM_DIGITS
    maxima_width = 0

    @classmethod
    def of(cls, vocab: DigitVocab, shard: VocabShard) -> DigitColumns:
        return _digit_columns(vocab, shard.start, shard.end)

    def index(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(digits, columns), int64 [k] each, on `device`."""
        return (
            on_device(("digits", self.digits), device, int_tensor(self.digits)),
            on_device(("columns", self.columns), device, int_tensor(self.columns)),
        )

    def for_labels(self, target: torch.Tensor) -> DigitColumns:
        return self

    def rows(self, part: slice) -> DigitColumns:
        return self

    def within(self, start: int, end: int) -> DigitColumns:
        """The digits among local columns [start, end), numbered from start (a vocab tile)."""
        return _within(self, start, end)

    def with_forward(self, values: Optional[torch.Tensor], out: torch.Tensor) -> DigitColumns:
        return self

    def saved(self) -> Tuple[torch.Tensor, ...]:
        return ()

    def from_saved(self, saved: Tuple[torch.Tensor, ...]) -> DigitColumns:
        return self

    def values(self, logits: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """[N, k] this shard's digit logits in `dtype` (None where it holds no digit)."""
        if not self.columns:
            return None
        return logits.index_select(-1, self.column_index(logits.device)).to(dtype)

    def write_local_maxima_(self, maxima: torch.Tensor, values: Optional[torch.Tensor]) -> None:
        """Digits add no maxima (maxima is [N, 0])."""

    def write_partials_(
        self, packed: torch.Tensor, values: Optional[torch.Tensor], maxima: torch.Tensor
    ) -> None:
        """packed [N, 10] (zeros) gets this shard's digit logits at their digits."""
        if self.columns:
            digits, _ = self.index(values.device)
            packed.index_copy_(-1, digits, values.to(packed.dtype))

    def finish(self, summed: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
        """[N, 10] the digit logits: the reduced sums themselves."""
        return summed.contiguous()

    def forward_values(self, out: torch.Tensor, values: Optional[torch.Tensor]) -> torch.Tensor:
        """The digit logits [N, 10] forward returned."""
        return out

    def values_from_forward(self, kept: torch.Tensor) -> torch.Tensor:
        """[N, k] this shard's values from forward_values' [N, 10]."""
        return self.of_digits(kept)

    def backward_values(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, k] the digit logits, read from logits again."""
        return self.values(logits, dtype)

    def for_tiles(
        self,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        grad_out: Optional[torch.Tensor],
    ) -> DigitColumns:
        """Each tile forms its digits' gradient itself."""
        return self

    def column_gradient(
        self,
        values: torch.Tensor,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        grad_out: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """[N, k] the whole gradient at this shard's digit columns, in values' dtype: the
        softmax's (p - onehot) * scale plus grad_out [N, 10] (None: zero)."""
        probs = torch.exp(values - shift.unsqueeze(-1) - log_sum_exp.unsqueeze(-1))
        hit = onehot_column.unsqueeze(-1) == self.column_index(values.device)
        grad = (probs - hit.to(probs.dtype)) * scale.unsqueeze(-1)
        if grad_out is not None:
            grad += self.of_digits(grad_out).to(grad.dtype)
        return grad

    def term_gradient(self, grad_out: torch.Tensor) -> torch.Tensor:
        """[N, k] this shard's digits' entries of grad_out [N, 10]."""
        return self.of_digits(grad_out)

    def add_term_gradient_(self, grad: torch.Tensor, grad_out: torch.Tensor) -> None:
        """grad [N, V/tp] += grad_out [N, 10] at this shard's digit columns."""
        if self.columns:
            _, columns = self.index(grad.device)
            grad.index_add_(-1, columns, self.of_digits(grad_out).to(grad.dtype))

    def column_index(self, device: torch.device) -> torch.Tensor:
        """int64 [k] this shard's digit columns on `device`."""
        return self.index(device)[1]

    def set_gradient_(self, grad: torch.Tensor, values: torch.Tensor) -> None:
        """grad [N, V/tp] at this shard's digit columns becomes values [N, k]."""
        grad.index_copy_(-1, self.column_index(grad.device), values.to(grad.dtype))

    def of_digits(self, per_digit: torch.Tensor) -> torch.Tensor:
        """[N, k] this shard's digits' entries of per_digit [N, 10]."""
        return per_digit.index_select(-1, self.index(per_digit.device)[0])


@lru_cache(maxsize=256)
def _digit_columns(vocab: DigitVocab, start: int, end: int) -> DigitColumns:
    pairs = [(k, i - start) for k, i in enumerate(vocab.digit_ids) if start <= i < end]
    return DigitColumns(tuple(k for k, _ in pairs), tuple(c for _, c in pairs))


@lru_cache(maxsize=1024)
def _within(digits: DigitColumns, start: int, end: int) -> DigitColumns:
    both = zip(digits.digits, digits.columns, strict=True)
    pairs = [(k, c - start) for k, c in both if start <= c < end]
    return DigitColumns(tuple(k for k, _ in pairs), tuple(c for _, c in pairs))
