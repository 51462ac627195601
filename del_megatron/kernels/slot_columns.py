"""A chunking vocab's number-token columns on one vocab shard: what a kernel carries for them in
its two all-reduces (slots.py's partial sums), and their gradient.

Where DigitColumns sends the ten digits' raw logits through the SUM all-reduce, SlotColumns
sends per-row partial sums of its 1,110 number tokens: the maxima of the slot-1 and slot-2
candidate groups in the MAX all-reduce ([N, 20] beside the row maxima), then the sums of exp
relative to them and the slot-3 logits in the SUM all-reduce ([N, 30] where DigitColumns has
[N, 10]). Every rank reads only its own columns, and the kernel returns the slot logits
[N, 30] (z^(1) | z^(2) | z^(3), ten digits each).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import torch

from .. import slots
from ..device import int_tensor, on_device
from ..vocab import DigitVocab
from .common import VocabShard

# Layout positions: 1,110 (slots.ROW a first digit).
POSITIONS = 10 * slots.ROW
# The local column of a layout position this shard does not hold.
ABSENT = -2


@dataclass(frozen=True)
class SlotColumns:
    """The number tokens of a chunking vocab that fall in this shard (or a tile of it).

    vocab: the DigitVocab (its token codes give each label's first two digits). layout: the
    local column of every layout position (slots.LAYOUT order), ABSENT where another shard
    holds it. `positions` / `columns`: the held positions and their local columns, as Python
    tuples (index tensors are made once per device). rule: which tokens a slot's groups take
    (slots.RULES; "length" returns its groups' logits, which length_conditioned finishes)."""

    vocab: DigitVocab
    layout: Tuple[int, ...]
    positions: Tuple[int, ...]
    columns: Tuple[int, ...]
    rule: str = "any"

    width = slots.SUMS
    out_width = slots.SUMS
    maxima_width = slots.MAXIMA

    @classmethod
    def of(cls, vocab: DigitVocab, shard: VocabShard, rule: str = "any") -> SlotColumns:
        return _slot_columns(vocab, shard.start, shard.end, slots.check_rule(rule))

    @property
    def holds_all(self) -> bool:
        return len(self.positions) == POSITIONS

    def _tensors(self, device: torch.device) -> Tuple[torch.Tensor, ...]:
        """(layout columns clamped to >= 0 [1110], layout columns [1110], held [1110] bool,
        held positions [k], their columns [k]) on `device`."""
        return on_device(("slot_columns", self), device, self._make)

    def _make(self, device: torch.device) -> Tuple[torch.Tensor, ...]:
        layout = int_tensor(self.layout)(device)
        return (
            layout.clamp(min=0),
            layout,
            layout >= 0,
            int_tensor(self.positions)(device),
            int_tensor(self.columns)(device),
        )

    def prefix(self, target: torch.Tensor) -> torch.Tensor:
        """int64 [N, 4]: each label's first two digits, layout position and digits
        (slots.label_prefix)."""
        return slots.label_prefix(target, self.vocab.token_codes(target.device))

    def values(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, 1110] the number tokens' logits in layout order, in `dtype`; -inf where another
        shard holds the token."""
        gather, _, held, _, _ = self._tensors(logits.device)
        x = logits.gather(-1, gather.expand(logits.size(0), -1)).to(dtype)
        return x if self.holds_all else x.masked_fill_(~held, float("-inf"))

    def local_maxima(self, values: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """[N, 20] this shard's slot-group maxima, for the MAX all-reduce."""
        return slots.local_maxima(values, prefix, self.rule)

    def write_partials_(
        self,
        packed: torch.Tensor,
        values: torch.Tensor,
        prefix: torch.Tensor,
        maxima: torch.Tensor,
    ) -> None:
        """packed [N, 30] (zeros) gets this shard's partial sums; maxima [N, 20] global."""
        held = None if self.holds_all else self._tensors(values.device)[2]
        packed.copy_(slots.partial_sums(values, prefix, maxima, held, self.rule))

    def finish(self, summed: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
        """[N, 30] slot logits from the reduced sums [N, 30] and maxima [N, 20]."""
        return slots.finish(summed, maxima)

    def forward_values(self, out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What a kernel keeps of forward to form the gradient from: the layout values."""
        return values

    def values_from_forward(self, kept: torch.Tensor) -> torch.Tensor:
        return kept

    def column_gradient(
        self,
        values: torch.Tensor,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        prefix: torch.Tensor,
        out: Optional[torch.Tensor],
        grad_out: Optional[torch.Tensor],
        held_only: bool = True,
    ) -> torch.Tensor:
        """[N, k] the whole gradient at the held columns, in values' dtype: the softmax's
        (p - onehot) * scale plus what grad_out [N, 30] of the slot logits out [N, 30] gives.
        held_only=False: over the whole layout [N, 1110] (pick() takes the held ones)."""
        softmax = (scale, shift, log_sum_exp)
        grad = slots.gradient(values, prefix, out, grad_out, softmax, self.rule)
        # -scale at the target's column, where this shard (tile) holds the target
        position = prefix[:, 2]
        hit = (position >= 0) & (onehot_column >= 0)
        minus = torch.where(hit, -scale, 0.0).unsqueeze(-1)
        grad.scatter_add_(-1, position.clamp(min=0).unsqueeze(-1), minus)
        return self.pick(grad) if held_only else grad

    def pick(self, layout_values: torch.Tensor) -> torch.Tensor:
        """[N, k] the held positions of layout_values [N, 1110]."""
        if self.holds_all:
            return layout_values
        return layout_values.index_select(-1, self._tensors(layout_values.device)[3])

    def term_gradient(
        self,
        grad_out: torch.Tensor,
        values: torch.Tensor,
        prefix: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """[N, k] the gradient that grad_out [N, 30] of the slot logits out [N, 30] gives the
        held columns (values: forward's layout values [N, 1110])."""
        return self.pick(slots.gradient(values, prefix, out, grad_out, rule=self.rule))

    def column_index(self, device: torch.device) -> torch.Tensor:
        """int64 [k] the held columns on `device`."""
        return self._tensors(device)[4]

    def add_term_gradient_(
        self,
        grad: torch.Tensor,
        values: torch.Tensor,
        prefix: torch.Tensor,
        out: torch.Tensor,
        grad_out: torch.Tensor,
    ) -> None:
        """grad [N, V/tp] += the gradient that grad_out [N, 30] of the slot logits gives the held
        columns (values: forward's layout values)."""
        if self.columns:
            term = self.term_gradient(grad_out, values, prefix, out)
            grad.index_add_(-1, self.column_index(grad.device), term.to(grad.dtype))

    def set_gradient_(self, grad: torch.Tensor, values: torch.Tensor) -> None:
        """grad [N, V/tp] at the held columns becomes values [N, k]."""
        grad.index_copy_(-1, self.column_index(grad.device), values.to(grad.dtype))

    def within(self, start: int, end: int) -> SlotColumns:
        """The tokens among local columns [start, end), numbered from start (a vocab tile)."""
        return _within(self, start, end)


def _layout_ids(vocab: DigitVocab) -> Tuple[int, ...]:
    """The number tokens' ids in layout order."""
    ids = [i for i, _ in vocab.number_tokens()]
    return tuple(ids[p] for p in slots.LAYOUT)


@lru_cache(maxsize=256)
def _slot_columns(vocab: DigitVocab, start: int, end: int, rule: str) -> SlotColumns:
    layout = tuple(i - start if start <= i < end else ABSENT for i in _layout_ids(vocab))
    return _from_layout(vocab, layout, rule)


@lru_cache(maxsize=1024)
def _within(columns: SlotColumns, start: int, end: int) -> SlotColumns:
    layout = tuple(c - start if start <= c < end else ABSENT for c in columns.layout)
    return _from_layout(columns.vocab, layout, columns.rule)


def _from_layout(vocab: DigitVocab, layout: Tuple[int, ...], rule: str) -> SlotColumns:
    held = [(p, c) for p, c in enumerate(layout) if c != ABSENT]
    positions, columns = tuple(p for p, _ in held), tuple(c for _, c in held)
    return SlotColumns(vocab, layout, positions, columns, rule)
