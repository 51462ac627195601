"""A chunking vocab's number-token columns on one vocab shard (NumberColumns, number_columns.py):
what a kernel carries for them in its two all-reduces (slots.py's partial sums), and their
gradient.

Where DigitColumns sends the ten digits' raw logits through the SUM all-reduce, SlotColumns
sends per-row partial sums of its 1,110 number tokens: the maxima of the slot-1 and slot-2
candidate groups in the MAX all-reduce ([N, 20] beside the row maxima), then the sums of exp
relative to them and the slot-3 logits in the SUM all-reduce ([N, 30] where DigitColumns has
[N, 10]). Every rank reads only its own columns, and the kernel returns the slot logits
[N, 30] (z^(1) | z^(2) | z^(3), ten digits each).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Optional, Tuple

import torch

from ..device import int_tensor, on_device
from ..digits import slots
from ..digits.vocab import DigitVocab
from .common import VocabShard

# Layout positions: 1,110 (slots.ROW a first digit).
POSITIONS = 10 * slots.ROW
# The local column of a layout position this shard does not hold.
ABSENT = -2


def _bound():
    """A field bound to rows (SlotColumns): None until bound, outside equality and hashing."""
    return field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SlotColumns:
    """The number tokens of a chunking vocab that fall in this shard (or a tile of it).

    vocab: the DigitVocab (its token codes give each label's first two digits).
    position_columns: the local column of every layout position (slots.PLACES_BY_POSITION
    order), ABSENT where another shard holds it. `positions` / `columns`: the held positions
    and their local columns, as Python tuples (index tensors are made once per device). rule:
    which tokens a slot's groups take (slots.RULES; "length" returns its groups' logits, which
    length_conditioned finishes).

    Bound to rows (NumberColumns), it also holds, each None until bound: prefix, int64 [N, 4]
    the labels' slots.label_prefix; values, forward's layout values [N, 1110]; out, forward's
    slot logits [N, 30]; layout_grad, the gradient over the layout [N, 1110] formed once for
    all vocab tiles (for_tiles). They take no part in equality or hashing."""

    vocab: DigitVocab
    position_columns: Tuple[int, ...]
    positions: Tuple[int, ...]
    columns: Tuple[int, ...]
    rule: str = "any"
    prefix: Optional[torch.Tensor] = _bound()
    values_kept: Optional[torch.Tensor] = _bound()
    out: Optional[torch.Tensor] = _bound()
    layout_grad: Optional[torch.Tensor] = _bound()

    out_width = slots.SUMS
    maxima_width = slots.MAXIMA

    @classmethod
    def of(cls, vocab: DigitVocab, shard: VocabShard, rule: str = "any") -> SlotColumns:
        return _slot_columns(vocab, shard.start, shard.end, slots.check_rule(rule))

    @property
    def holds_all(self) -> bool:
        return len(self.positions) == POSITIONS

    def _tensors(self, device: torch.device) -> Tuple[torch.Tensor, ...]:
        """(position columns clamped to >= 0 [1110], position columns [1110], held [1110] bool,
        held positions [k], their columns [k]) on `device`."""
        key = ("slot_columns", self.position_columns, self.positions, self.columns)
        return on_device(key, device, self._make)

    def _make(self, device: torch.device) -> Tuple[torch.Tensor, ...]:
        position_columns = int_tensor(self.position_columns)(device)
        return (
            position_columns.clamp(min=0),
            position_columns,
            position_columns >= 0,
            int_tensor(self.positions)(device),
            int_tensor(self.columns)(device),
        )

    def for_labels(self, target: torch.Tensor) -> SlotColumns:
        """Bound to each label's first two digits, layout position and digits (prefix)."""
        codes = self.vocab.token_codes(target.device)
        return replace(self, prefix=slots.label_prefix(target, codes))

    def rows(self, part: slice) -> SlotColumns:
        bound = (self.prefix, self.values_kept, self.out, self.layout_grad)
        prefix, values, out, layout_grad = (None if t is None else t[part] for t in bound)
        return replace(self, prefix=prefix, values_kept=values, out=out, layout_grad=layout_grad)

    def within(self, start: int, end: int) -> SlotColumns:
        """The tokens among local columns [start, end), numbered from start (a vocab tile),
        bound as these are."""
        tile = _within(self.vocab, self.position_columns, self.rule, start, end)
        return replace(
            tile,
            prefix=self.prefix,
            values_kept=self.values_kept,
            out=self.out,
            layout_grad=self.layout_grad,
        )

    def with_forward(self, values: Optional[torch.Tensor], out: torch.Tensor) -> SlotColumns:
        return replace(self, values_kept=values, out=out)

    def saved(self) -> Tuple[torch.Tensor, ...]:
        """(prefix, layout values, slot logits)."""
        return (self.prefix, self.values_kept, self.out)

    def from_saved(self, saved: Tuple[torch.Tensor, ...]) -> SlotColumns:
        prefix, values, out = saved
        return replace(self, prefix=prefix, values_kept=values, out=out)

    def values(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, 1110] the number tokens' logits in layout order, in `dtype`; -inf where another
        shard holds the token."""
        gather, _, held, _, _ = self._tensors(logits.device)
        x = logits.gather(-1, gather.expand(logits.size(0), -1)).to(dtype)
        return x if self.holds_all else x.masked_fill_(~held, float("-inf"))

    def write_local_maxima_(self, maxima: torch.Tensor, values: torch.Tensor) -> None:
        """maxima [N, 20] gets this shard's slot-group maxima."""
        maxima.copy_(slots.local_maxima(values, self.prefix, self.rule))

    def write_partials_(
        self, packed: torch.Tensor, values: torch.Tensor, maxima: torch.Tensor
    ) -> None:
        """packed [N, 30] (zeros) gets this shard's partial sums; maxima [N, 20] global."""
        held = None if self.holds_all else self._tensors(values.device)[2]
        packed.copy_(slots.partial_sums(values, self.prefix, maxima, held, self.rule))

    def finish(self, summed: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
        """[N, 30] slot logits from the reduced sums [N, 30] and maxima [N, 20]."""
        return slots.finish(summed, maxima)

    def forward_values(self, out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The layout values [N, 1110]."""
        return values

    def values_from_forward(self, kept: torch.Tensor) -> torch.Tensor:
        return kept

    def backward_values(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layout values forward kept (with_forward): the 1,110 columns are not read
        again."""
        return self.values_kept

    def for_tiles(
        self,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        grad_out: Optional[torch.Tensor],
    ) -> SlotColumns:
        """Bound to the gradient over the whole layout [N, 1110], formed once from forward's
        values; each tile picks its positions."""
        if not self.columns:
            return self
        layout_grad = self._gradient(
            self.values_kept, shift, log_sum_exp, scale, onehot_column, grad_out
        )
        return replace(self, layout_grad=layout_grad)

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
        (p - onehot) * scale plus what grad_out [N, 30] of the slot logits gives (picked from
        layout_grad where for_tiles formed it)."""
        if self.layout_grad is not None:
            return self.pick(self.layout_grad)
        grad = self._gradient(values, shift, log_sum_exp, scale, onehot_column, grad_out)
        return self.pick(grad)

    def _gradient(
        self,
        values: torch.Tensor,
        shift: torch.Tensor,
        log_sum_exp: torch.Tensor,
        scale: torch.Tensor,
        onehot_column: torch.Tensor,
        grad_out: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """column_gradient over the whole layout [N, 1110]."""
        softmax = (scale, shift, log_sum_exp)
        grad = slots.gradient(values, self.prefix, self.out, grad_out, softmax, self.rule)
        # -scale at the target's column, where this shard (tile) holds the target
        position = self.prefix[:, 2]
        hit = (position >= 0) & (onehot_column >= 0)
        minus = torch.where(hit, -scale, 0.0).unsqueeze(-1)
        grad.scatter_add_(-1, position.clamp(min=0).unsqueeze(-1), minus)
        return grad

    def pick(self, layout_values: torch.Tensor) -> torch.Tensor:
        """[N, k] the held positions of layout_values [N, 1110]."""
        if self.holds_all:
            return layout_values
        return layout_values.index_select(-1, self._tensors(layout_values.device)[3])

    def term_gradient(self, grad_out: torch.Tensor) -> torch.Tensor:
        """[N, k] the gradient that grad_out [N, 30] of the slot logits gives the held
        columns."""
        grad = slots.gradient(self.values_kept, self.prefix, self.out, grad_out, rule=self.rule)
        return self.pick(grad)

    def add_term_gradient_(self, grad: torch.Tensor, grad_out: torch.Tensor) -> None:
        """grad [N, V/tp] += the gradient that grad_out [N, 30] of the slot logits gives the held
        columns."""
        if self.columns:
            term = self.term_gradient(grad_out)
            grad.index_add_(-1, self.column_index(grad.device), term.to(grad.dtype))

    def column_index(self, device: torch.device) -> torch.Tensor:
        """int64 [k] the held columns on `device`."""
        return self._tensors(device)[4]

    def set_gradient_(self, grad: torch.Tensor, values: torch.Tensor) -> None:
        """grad [N, V/tp] at the held columns becomes values [N, k]."""
        grad.index_copy_(-1, self.column_index(grad.device), values.to(grad.dtype))


def _ids_by_position(vocab: DigitVocab) -> Tuple[int, ...]:
    """The number tokens' ids in layout order."""
    ids = [i for i, _ in vocab.number_tokens()]
    return tuple(ids[p] for p in slots.PLACES_BY_POSITION)


@lru_cache(maxsize=256)
def _slot_columns(vocab: DigitVocab, start: int, end: int, rule: str) -> SlotColumns:
    ids = _ids_by_position(vocab)
    position_columns = tuple(i - start if start <= i < end else ABSENT for i in ids)
    return _held(vocab, position_columns, rule)


@lru_cache(maxsize=1024)
def _within(
    vocab: DigitVocab, position_columns: Tuple[int, ...], rule: str, start: int, end: int
) -> SlotColumns:
    tile = tuple(c - start if start <= c < end else ABSENT for c in position_columns)
    return _held(vocab, tile, rule)


def _held(vocab: DigitVocab, position_columns: Tuple[int, ...], rule: str) -> SlotColumns:
    held = [(p, c) for p, c in enumerate(position_columns) if c != ABSENT]
    positions, columns = tuple(p for p, _ in held), tuple(c for _, c in held)
    return SlotColumns(vocab, position_columns, positions, columns, rule)
