"""DigitVocab: which token ids are the ten digits and the decimal point(s)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, Tuple

import torch

from .device import on_device

NUM_DIGITS = 10

# Classes of a label in a number lookup table (see DigitVocab.class_table).
CLASS_OTHER = -1
CLASS_POINT = NUM_DIGITS  # digits are classes 0..9, their own value


def _as_id_tuple(ids: Iterable[int], what: str) -> Tuple[int, ...]:
    out = []
    for i in ids:
        if isinstance(i, bool):
            raise TypeError(f"{what} must hold integer token ids, got {i!r}")
        try:
            out.append(operator.index(i))
        except TypeError as exc:
            raise TypeError(f"{what} must hold integer token ids, got {i!r}") from exc
    return tuple(out)


@dataclass(frozen=True)
class DigitVocab:
    """Token ids of the digits '0'..'9' (in digit order) and of the decimal point(s).

    `digit_ids[k]` is the id of the single-digit token for digit k. A tokenizer may have several
    ids for '.', all of which count as decimal points.
    """

    digit_ids: Tuple[int, ...]
    decimal_point_ids: Tuple[int, ...] = ()

    def __init__(self, digit_ids: Iterable[int], decimal_point_ids: Iterable[int] = ()) -> None:
        digits = _as_id_tuple(digit_ids, "digit_ids")
        points = _as_id_tuple(decimal_point_ids, "decimal_point_ids")
        if len(digits) != NUM_DIGITS:
            raise ValueError(
                f"digit_ids must hold exactly {NUM_DIGITS} ids, one per digit '0'..'9' in order; "
                f"got {len(digits)}: {digits}"
            )
        if len(set(digits)) != NUM_DIGITS:
            raise ValueError(f"digit_ids must be distinct, got {digits}")
        if len(set(points)) != len(points):
            raise ValueError(f"decimal_point_ids must be distinct, got {points}")
        negative = [i for i in digits + points if i < 0]
        if negative:
            raise ValueError(f"token ids must be non-negative, got {negative}")
        shared = sorted(set(digits) & set(points))
        if shared:
            raise ValueError(f"ids {shared} are listed both as digits and as decimal points")
        object.__setattr__(self, "digit_ids", digits)
        object.__setattr__(self, "decimal_point_ids", points)

    @classmethod
    def from_tokenizer(cls, tok, allow_multi_digit_tokens: bool = False) -> DigitVocab:
        """Digit and '.' ids of a SentencePiece, Hugging Face, tiktoken or Megatron tokenizer
        (or a tokenizer file's path), checked to split numbers one digit per token.

        The work is del_megatron.tokenizers.digit_vocab_from_tokenizer, which imports this
        module; it is imported here at call time only, so that vocab.py depends on nothing.
        """
        from .tokenizers import digit_vocab_from_tokenizer

        return digit_vocab_from_tokenizer(tok, allow_multi_digit_tokens)

    @property
    def max_id(self) -> int:
        """Largest token id this vocab names."""
        return max(self.digit_ids + self.decimal_point_ids)

    def check_vocab_size(self, vocab_size: int) -> None:
        """Raise if a digit or decimal-point id does not fit a vocabulary of `vocab_size` ids."""
        outside = [i for i in self.digit_ids + self.decimal_point_ids if i >= vocab_size]
        if outside:
            raise ValueError(
                f"DigitVocab ids {outside} lie outside the model's vocabulary of {vocab_size} ids "
                "(summed over tensor-parallel shards); the DigitVocab was built for another "
                "tokenizer, or the logits are not the full vocabulary / its shard"
            )

    def class_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 [max_id + 2]: digit value 0..9 for digit ids, CLASS_POINT for decimal points,
        CLASS_OTHER elsewhere. The last entry is CLASS_OTHER and serves any id > max_id.
        Made on `device` once and kept (on_device); do not write into it."""
        return on_device(("class_table", self), torch.device(device or "cpu"), self._class_table)

    def _class_table(self, device: torch.device) -> torch.Tensor:
        table = torch.full((self.max_id + 2,), CLASS_OTHER, dtype=torch.long, device=device)
        classes = list(enumerate(self.digit_ids)) + [
            (CLASS_POINT, i) for i in self.decimal_point_ids
        ]
        for cls, i in classes:
            table.narrow(0, i, 1).fill_(cls)
        return table
