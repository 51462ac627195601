"""Numbers inside label sequences: which positions are digits, and where each sits in its number.

All functions are vectorised torch over [b, s] labels: no Python loop over tokens, no host sync.
A *number* is a maximal run of consecutive positions of one row whose labels are digits or
decimal points (docs/DEL.md). Its first decimal point, unless the run starts with it, splits the
run into an integer part and a fractional part: DEL's place weights. DIST2Loss groups otherwise:
only digits form its runs, so a decimal point ends one, and each run is weighed like an integer
from its last digit.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .vocab import CLASS_POINT, DigitVocab

# d-th fractional digit of a number gets 1.02 ** -(d + 1) under DEL.
FRACTION_DECAY = 1.02


class NumberLayout(NamedTuple):
    """Per-position facts about numbers, each [b, s].

    digit:      int64, the target digit 0..9 where `is_digit`, else 0 (a safe dummy index)
    is_digit:   bool, label is a digit token and not ignored
    int_place:  int64, k >= 1 in an integer part (units k = 1, tens k = 2, ...), else 0
    frac_place: int64, d >= 1 for positions right of the split (first fractional d = 1), else 0
    run_place:  int64, k >= 1 for digits, counted from the last digit of their run of digits
                only (DIST2's grouping: a decimal point ends a run; last digit k = 1), else 0
    """

    digit: torch.Tensor
    is_digit: torch.Tensor
    int_place: torch.Tensor
    frac_place: torch.Tensor
    run_place: torch.Tensor


def check_label_dtype(labels: torch.Tensor) -> None:
    """Raise unless `labels` is an integer tensor (token ids)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}")


def _check_labels(labels: torch.Tensor) -> None:
    check_label_dtype(labels)
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq], got shape {tuple(labels.shape)}")


def number_layout(
    labels: torch.Tensor,
    vocab: DigitVocab,
    ignore_index: int = -100,
    doc_start: Optional[torch.Tensor] = None,
) -> NumberLayout:
    """Locate every digit of `labels` [b, s] inside its number; see NumberLayout.

    doc_start: bool [b, s], True where a packed document begins; no number runs across one.
    """
    _check_labels(labels)
    b, s = labels.shape
    table = vocab.class_table(labels.device)
    other_slot = table.numel() - 1
    ids = labels.long()
    in_table = (ids >= 0) & (ids < other_slot) & (ids != ignore_index)
    cls = table[torch.where(in_table, ids, other_slot)]  # [b, s]

    is_digit = (cls >= 0) & (cls < CLASS_POINT)
    is_point = cls == CLASS_POINT
    in_number = is_digit | is_point

    # Row-major flat positions; a run starts at column 0 or after a non-number position, so
    # runs never cross rows.
    flat_in = in_number.reshape(-1)
    pos = torch.arange(b * s, device=labels.device)
    prev_in = torch.zeros_like(in_number)
    prev_in[:, 1:] = in_number[:, :-1]
    next_in = torch.zeros_like(in_number)
    next_in[:, :-1] = in_number[:, 1:]
    if doc_start is not None:
        if doc_start.shape != labels.shape or doc_start.dtype != torch.bool:
            raise ValueError(
                f"doc_start must be bool {list(labels.shape)} like labels, got "
                f"{doc_start.dtype} {list(doc_start.shape)}"
            )
        prev_in &= ~doc_start
        next_in[:, :-1] &= ~doc_start[:, 1:]
    starts = (in_number & ~prev_in).reshape(-1)
    ends = (in_number & ~next_in).reshape(-1)

    run_start = torch.where(starts, pos, 0).cummax(0).values
    big = b * s
    run_end = _next_true(ends, pos, big)

    # Split = the run's first decimal point; a run that starts with one has no split (it is an
    # integer), which puts the split one past the run's end.
    flat_point = is_point.reshape(-1)
    next_point = _next_true(flat_point, pos, big)
    first_point = next_point[run_start]
    has_split = (first_point <= run_end) & ~flat_point[run_start]
    split = torch.where(has_split, first_point, run_end + 1)

    int_place = torch.where(flat_in & (pos < split), split - pos, 0)
    frac_place = torch.where(flat_in & (pos > split), pos - split, 0)

    # DIST2: runs of digits alone. A digit run ends where the next position is no digit (a
    # decimal point included) or the number run ends.
    next_digit = torch.zeros_like(is_digit)
    next_digit[:, :-1] = is_digit[:, 1:]
    digit_ends = (is_digit & ~(next_digit & next_in)).reshape(-1)
    run_place = torch.where(is_digit.reshape(-1), _next_true(digit_ends, pos, big) - pos + 1, 0)

    digit = torch.where(is_digit, cls, 0)
    return NumberLayout(
        digit=digit,
        is_digit=is_digit,
        int_place=int_place.view(b, s),
        frac_place=frac_place.view(b, s),
        run_place=run_place.view(b, s),
    )


def _next_true(flags: torch.Tensor, pos: torch.Tensor, big: int) -> torch.Tensor:
    """[n] for every position, the first position at or after it where flags is True (big if
    none): a reversed running minimum, no Python loop."""
    return torch.where(flags, pos, big).flip(0).cummin(0).values.flip(0)


def select_positions(layout: NumberLayout, positions: torch.Tensor) -> NumberLayout:
    """The layout at sequence positions `positions` [s_local] (int64) of every row."""
    return NumberLayout(*(field.index_select(1, positions) for field in layout))


def del_weights(layout: NumberLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DEL place weights [b, s]: 2k for the k-th integer place, 1.02^-(d+1) for the d-th
    fractional place, 0 for decimal points and non-digit positions."""
    integer = 2.0 * layout.int_place.to(dtype)
    # float64 then rounded once, so every weight is the correctly rounded 1.02^-(d+1).
    fraction = torch.pow(FRACTION_DECAY, -(layout.frac_place.double() + 1.0)).to(dtype)
    weights = torch.where(layout.int_place > 0, integer, fraction)
    return torch.where(layout.is_digit, weights, 0.0)


def dist2_weights(layout: NumberLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DIST2Loss place weights [b, s], as its authors' code gives them: k for the k-th digit
    from the end of its run of digits (a decimal point ends a run, so the fractional digits of
    3.14159 weigh 5 4 3 2 1), 0 for decimal points and non-digit positions."""
    return layout.run_place.to(dtype)


def place_weights(
    labels: torch.Tensor, vocab: DigitVocab, ignore_index: int = -100
) -> torch.Tensor:
    """DEL place weights float32 [b, s] for labels int64 [b, s] (docs/DEL.md)."""
    return del_weights(number_layout(labels, vocab, ignore_index))


__all__ = [
    "NumberLayout",
    "number_layout",
    "del_weights",
    "dist2_weights",
    "place_weights",
]
