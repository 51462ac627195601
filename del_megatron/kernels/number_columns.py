"""NumberColumns: what a kernel asks of a vocab's number-token columns on one vocab shard (or a
vocab tile of it), whichever kind of vocab it is.

Two implementations: DigitColumns (digit_columns.py, the ten digits, one digit a token) and
SlotColumns (slot_columns.py, a chunking vocab's 1,110 number tokens, giving slot logits). A
kernel calls the same methods on both and never asks which it holds. Shapes: N rows, k held
columns, K the values they read per row (k digits; 1,110 layout positions), W out_width (10;
30), M maxima_width (0; 20).

An object starts static (one per shard, cached) and is bound in forward to what its rows need:
for_labels (the labels' facts), rows (a row block), with_forward (what forward formed),
for_tiles (what backward forms once for all vocab tiles); saved / from_saved carry the bound
tensors through save_for_backward. DigitColumns needs none of it and returns itself.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple, TypeVar

import torch

Columns = TypeVar("Columns", bound="NumberColumns")


class NumberColumns(Protocol):
    """A vocab's number-token columns on one shard (or tile), seen from a block of rows."""

    # W: the kernel's output [N, W] and the SUM buffer's number part.
    out_width: int
    # M: maxima a row these columns add to the MAX all-reduce.
    maxima_width: int
    # The held local columns (empty where another shard holds them all).
    columns: Tuple[int, ...]

    def for_labels(self: Columns, target: torch.Tensor) -> Columns:
        """These columns for rows of labels target [N]."""
        ...

    def rows(self: Columns, part: slice) -> Columns:
        """These columns for rows `part` of the rows they are bound to."""
        ...

    def within(self: Columns, start: int, end: int) -> Columns:
        """The columns among local columns [start, end), numbered from start (a vocab tile)."""
        ...

    def with_forward(self: Columns, values: Optional[torch.Tensor], out: torch.Tensor) -> Columns:
        """These columns bound to what forward formed: values [N, K] and output out [N, W]."""
        ...

    def saved(self) -> Tuple[torch.Tensor, ...]:
        """The bound tensors, for save_for_backward."""
        ...

    def from_saved(self: Columns, saved: Tuple[torch.Tensor, ...]) -> Columns:
        """These (static) columns bound again to saved()'s tensors."""
        ...

    def values(self, logits: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """[N, K] what they read of logits [N, V/tp], in `dtype` (None: nothing to read)."""
        ...

    def write_local_maxima_(self, maxima: torch.Tensor, values: Optional[torch.Tensor]) -> None:
        """maxima [N, M] (the MAX all-reduce's) gets this shard's maxima from values."""
        ...

    def write_partials_(
        self, packed: torch.Tensor, values: Optional[torch.Tensor], maxima: torch.Tensor
    ) -> None:
        """packed [N, W] (zeros, the SUM all-reduce's) gets this shard's partials; maxima
        [N, M] global."""
        ...

    def finish(self, summed: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
        """[N, W] the output from the reduced sums [N, W] and maxima [N, M]."""
        ...

    def forward_values(self, out: torch.Tensor, values: Optional[torch.Tensor]) -> torch.Tensor:
        """What the linear kernel keeps of forward to form these columns' gradient from, given
        the output out [N, W] and values [N, K]."""
        ...

    def values_from_forward(self, kept: torch.Tensor) -> torch.Tensor:
        """[N, K] the values from forward_values' tensor."""
        ...

    def backward_values(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] the values backward forms the gradient from (logits [N, V/tp] as forward
        read them)."""
        ...

    def for_tiles(
        self: Columns,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        grad_out: Optional[torch.Tensor],
    ) -> Columns:
        """These columns with what their gradient needs formed once for all vocab tiles."""
        ...

    def column_gradient(
        self,
        values: torch.Tensor,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        grad_out: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """[N, k] the whole gradient at the held columns, in values' dtype: the softmax's
        (p - onehot) * scale, p = exp(values - shift - log_sum_exp), plus what grad_out [N, W]
        (None: zero) gives them."""
        ...

    def term_gradient(self, grad_out: torch.Tensor) -> torch.Tensor:
        """[N, k] the gradient that grad_out [N, W] gives the held columns."""
        ...

    def add_term_gradient_(self, grad: torch.Tensor, grad_out: torch.Tensor) -> None:
        """grad [N, V/tp] += the gradient that grad_out [N, W] gives the held columns."""
        ...

    def column_index(self, device: torch.device) -> torch.Tensor:
        """int64 [k] the held columns on `device`."""
        ...

    def set_gradient_(self, grad: torch.Tensor, values: torch.Tensor) -> None:
        """grad [N, V/tp] at the held columns becomes values [N, k]."""
        ...
