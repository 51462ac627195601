"""Numbers inside label sequences: which positions are number tokens, and where each of their
digits sits in its number.

All functions are vectorised torch over [b, s] labels: no Python loop over tokens, no host sync.
A *number* is a maximal run of consecutive positions of one row whose labels are number tokens
(one digit each, or up to three in a chunking vocab) or decimal points (docs/DEL.md). Places are
counted in digits, a decimal point taking one. Its first decimal point, unless the run starts with
it, splits the run into an integer part and a fractional part: DEL's place weights. DIST2Loss
groups otherwise: only number tokens form its runs, so a decimal point ends one, and each run is
weighed like an integer from its last digit.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .vocab import CODE_LENGTH, CODE_POINT, DigitVocab

# d-th fractional digit of a number gets 1.02 ** -(d + 1) under DEL.
FRACTION_DECAY = 1.02


class DigitPlaces(NamedTuple):
    """Where each label's digits sit in their number, per position (number_layout). S is the
    vocab's max_digits (1, or 3 for a chunking vocab): the slots of a position, one per digit
    of its label.

    digit:       int64 [b, s, S], the target digit 0..9 of each slot, else 0 (a safe dummy)
    is_digit:    bool [b, s], the label is a number token (a digit token, one digit a token)
                 and not ignored
    digit_count: int64 [b, s], digits the label holds (0 off number tokens)
    int_place:   int64 [b, s, S], k >= 1 in an integer part (units k = 1, tens k = 2, ...)
    frac_place:  int64 [b, s, S], d >= 1 for digits right of the split (first fractional d = 1)
    run_place:   int64 [b, s, S], k >= 1 for digits, counted from the last digit of their run of
                 number tokens only (DIST2's grouping: a decimal point ends a run; last k = 1)
    Slots past a label's last digit hold 0 in every field.
    """

    digit: torch.Tensor
    is_digit: torch.Tensor
    digit_count: torch.Tensor
    int_place: torch.Tensor
    frac_place: torch.Tensor
    run_place: torch.Tensor

    @property
    def in_slot(self) -> torch.Tensor:
        """bool [b, s, S]: the slot holds a digit of the label."""
        return held_slots(self.digit_count, self.digit.size(-1))


def held_slots(digit_count: torch.Tensor, slots: int) -> torch.Tensor:
    """bool [..., slots]: slot j holds a digit of a label of digit_count [...] digits."""
    return torch.arange(slots, device=digit_count.device) < digit_count.unsqueeze(-1)


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
) -> DigitPlaces:
    """Locate every digit of `labels` [b, s] inside its number; see DigitPlaces.

    doc_start: bool [b, s], True where a packed document begins; no number runs across one.
    """
    _check_labels(labels)
    b, s = labels.shape
    slots = vocab.max_digits
    table = vocab.token_codes(labels.device)
    other_slot = table.numel() - 1
    ids = labels.long()
    in_table = (ids >= 0) & (ids < other_slot) & (ids != ignore_index)
    code = table[torch.where(in_table, ids, other_slot)]  # [b, s]

    is_digit = code >= CODE_LENGTH
    is_point = code == CODE_POINT
    in_number = is_digit | is_point
    count = torch.where(is_digit, code // CODE_LENGTH, 0)
    value = torch.where(is_digit, code % CODE_LENGTH, 0)

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

    # Places count digits, and a decimal point takes one (docs/DEL.md): through a running count
    # of places, the slot j digit of position p takes place number ahead[p] + j + 1 of the
    # row-major sequence, and a number's integer part ends with place number through[split - 1]
    # (its fractional part starts after through[split], the split point's own place).
    flat_count = count.reshape(-1)
    places = flat_count + is_point.reshape(-1).long()
    through = places.cumsum(0)  # places up to and including each position
    ahead = (through - places).unsqueeze(-1)  # places before each position
    slot = torch.arange(slots, device=labels.device)
    number = ahead + slot + 1  # [b * s, S]
    held = slot < flat_count.unsqueeze(-1)
    last = big - 1
    integer_end = through[(split - 1).clamp(min=0, max=last)].unsqueeze(-1)
    point_place = through[split.clamp(max=last)].unsqueeze(-1)
    left = (flat_in & (pos < split)).unsqueeze(-1) & held
    right = (flat_in & (pos > split)).unsqueeze(-1) & held
    int_place = torch.where(left, integer_end - number + 1, 0)
    frac_place = torch.where(right, number - point_place, 0)

    # DIST2: runs of number tokens alone. A run ends where the next position holds no number
    # token (a decimal point included) or the number run ends.
    next_digit = torch.zeros_like(is_digit)
    next_digit[:, :-1] = is_digit[:, 1:]
    digit_ends = (is_digit & ~(next_digit & next_in)).reshape(-1)
    run_digits = through[_next_true(digit_ends, pos, big).clamp(max=last)].unsqueeze(-1)
    run_place = torch.where(held & is_digit.reshape(-1, 1), run_digits - number + 1, 0)

    # The slot j digit of an L-digit value: (value // 10^(L - 1 - j)) % 10.
    power = (flat_count.unsqueeze(-1) - 1 - slot).clamp(min=0)
    digit = torch.where(held, (value.reshape(-1, 1) // 10**power) % 10, 0)
    return DigitPlaces(
        digit=digit.view(b, s, slots),
        is_digit=is_digit,
        digit_count=count,
        int_place=int_place.view(b, s, slots),
        frac_place=frac_place.view(b, s, slots),
        run_place=run_place.view(b, s, slots),
    )


def _next_true(flags: torch.Tensor, pos: torch.Tensor, big: int) -> torch.Tensor:
    """[n] for every position, the first position at or after it where flags is True (big if
    none): a reversed running minimum, no Python loop."""
    return torch.where(flags, pos, big).flip(0).cummin(0).values.flip(0)


def select_positions(layout: DigitPlaces, positions: torch.Tensor) -> DigitPlaces:
    """The layout at sequence positions `positions` [s_local] (int64) of every row."""
    return DigitPlaces(*(field.index_select(1, positions) for field in layout))


def del_weights(layout: DigitPlaces, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DEL place weights [b, s, S]: 2k for the k-th integer place, 1.02^-(d+1) for the d-th
    fractional place, 0 for decimal points, non-digit positions and empty slots."""
    integer = 2.0 * layout.int_place.to(dtype)
    # float64 then rounded once, so every weight is the correctly rounded 1.02^-(d+1).
    fraction = torch.pow(FRACTION_DECAY, -(layout.frac_place.double() + 1.0)).to(dtype)
    weights = torch.where(layout.int_place > 0, integer, fraction)
    return torch.where(layout.in_slot, weights, 0.0)


def dist2_weights(layout: DigitPlaces, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DIST2Loss place weights [b, s, S], as its authors' code gives them: k for the k-th digit
    from the end of its run of digits (a decimal point ends a run, so the fractional digits of
    3.14159 weigh 5 4 3 2 1), 0 for decimal points and non-digit positions."""
    return layout.run_place.to(dtype)


def place_weights(
    labels: torch.Tensor, vocab: DigitVocab, ignore_index: int = -100
) -> torch.Tensor:
    """DEL place weights float32 [b, s] for labels int64 [b, s] (docs/DEL.md); for a chunking
    vocab [b, s, 3], one weight per digit of the label (0 past its last digit)."""
    weights = del_weights(number_layout(labels, vocab, ignore_index))
    return weights if vocab.chunked else weights.squeeze(-1)


__all__ = [
    "DigitPlaces",
    "number_layout",
    "del_weights",
    "dist2_weights",
    "place_weights",
]
