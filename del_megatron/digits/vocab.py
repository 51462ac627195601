"""DigitVocab: which token ids are the ten digits, the decimal point(s) and, for a tokenizer that
cuts numbers into chunks of up to three digits, the 1,100 two- and three-digit number tokens."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable, List, Tuple

import torch

from ..device import on_device
from .number_tokens import (
    CODE_LENGTH,
    CODE_OTHER,
    CODE_POINT,
    MAX_TOKEN_DIGITS,
    NUM_DIGITS,
    NUM_MULTI_DIGIT,
    multi_digit_text,
)
from .tokenizers import number_token_ids


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
    ids for '.', all of which count as decimal points. `multi_digit_ids` is empty for a tokenizer
    that splits numbers one digit per token; for one that cuts them into chunks of up to three
    digits (Llama-3, o200k, DeepSeek-V3) it holds the ids of all 1,100 two- and three-digit tokens,
    "00".."99" then "000".."999" (multi_digit_text), and DEL gives every digit of such a token its
    own term (docs/DEL.md).
    """

    digit_ids: Tuple[int, ...]
    decimal_point_ids: Tuple[int, ...] = ()
    multi_digit_ids: Tuple[int, ...] = ()

    def __init__(
        self,
        digit_ids: Iterable[int],
        decimal_point_ids: Iterable[int] = (),
        multi_digit_ids: Iterable[int] = (),
    ) -> None:
        digits = _as_id_tuple(digit_ids, "digit_ids")
        points = _as_id_tuple(decimal_point_ids, "decimal_point_ids")
        multi = _as_id_tuple(multi_digit_ids, "multi_digit_ids")
        if len(digits) != NUM_DIGITS:
            raise ValueError(
                f"digit_ids must hold exactly {NUM_DIGITS} ids, one per digit '0'..'9' in order; "
                f"got {len(digits)}: {digits}"
            )
        if len(set(digits)) != NUM_DIGITS:
            raise ValueError(f"digit_ids must be distinct, got {digits}")
        if len(set(points)) != len(points):
            raise ValueError(f"decimal_point_ids must be distinct, got {points}")
        if multi and len(multi) != NUM_MULTI_DIGIT:
            raise ValueError(
                f"multi_digit_ids must hold all {NUM_MULTI_DIGIT} two- and three-digit number "
                f"tokens ('00'..'99' then '000'..'999', in order) or none; got {len(multi)}"
            )
        if len(set(multi)) != len(multi):
            raise ValueError("multi_digit_ids must be distinct")
        negative = [i for i in digits + points + multi if i < 0]
        if negative:
            raise ValueError(f"token ids must be non-negative, got {negative[:10]}")
        shared = sorted(set(digits) & set(points))
        if shared:
            raise ValueError(f"ids {shared} are listed both as digits and as decimal points")
        shared = sorted(set(multi) & (set(digits) | set(points)))
        if shared:
            raise ValueError(
                f"ids {shared[:10]} are listed as multi-digit tokens and as digits or points"
            )
        object.__setattr__(self, "digit_ids", digits)
        object.__setattr__(self, "decimal_point_ids", points)
        object.__setattr__(self, "multi_digit_ids", multi)

    @classmethod
    def from_tokenizer(cls, tok, allow_multi_digit_tokens: bool = False) -> DigitVocab:
        """Digit and '.' ids of a SentencePiece, Hugging Face, tiktoken or Megatron tokenizer
        (or a tokenizer file's path), checked to split numbers one digit per token or in chunks
        of up to three digits as Llama-3's does; allow_multi_digit_tokens accepts other tokens in
        numbers (digits merged, GPT-2's 'Ġ4') and takes the bare digits '0'..'9' as the digit
        targets. The same as digit_vocab_from_tokenizer (this module)."""
        return digit_vocab_from_tokenizer(tok, allow_multi_digit_tokens)

    @property
    def chunked(self) -> bool:
        """Whether numbers come in chunks of up to three digits (multi_digit_ids given)."""
        return bool(self.multi_digit_ids)

    @property
    def max_digits(self) -> int:
        """Most digits one number token holds: 3 for a chunking vocab, else 1 (the slots a
        position's term is summed over)."""
        return MAX_TOKEN_DIGITS if self.chunked else 1

    def single_digits_only(self) -> DigitVocab:
        """This vocab without its multi-digit tokens: DEL on the ten single-digit tokens only
        (a multi-digit token then ends a number and gets no term)."""
        return DigitVocab(self.digit_ids, self.decimal_point_ids)

    def number_tokens(self) -> List[Tuple[int, str]]:
        """(id, text) of every number token: the ten digits, then the multi-digit tokens."""
        texts = [str(k) for k in range(NUM_DIGITS)]
        texts += [multi_digit_text(i) for i in range(len(self.multi_digit_ids))]
        return list(zip(self.digit_ids + self.multi_digit_ids, texts, strict=True))

    @property
    def all_ids(self) -> Tuple[int, ...]:
        return self.digit_ids + self.decimal_point_ids + self.multi_digit_ids

    @property
    def max_id(self) -> int:
        """Largest token id this vocab names."""
        return max(self.all_ids)

    def check_vocab_size(self, vocab_size: int) -> None:
        """Raise if an id of this vocab does not fit a vocabulary of `vocab_size` ids."""
        outside = [i for i in self.all_ids if i >= vocab_size]
        if outside:
            raise ValueError(
                f"DigitVocab ids {outside[:10]} lie outside the model's vocabulary of "
                f"{vocab_size} ids (summed over tensor-parallel shards); the DigitVocab was "
                "built for another tokenizer, or the logits are not the full vocabulary / its shard"
            )

    def token_codes(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 [max_id + 2]: L * CODE_LENGTH + value for a number token of L digits (leading
        zeros count: "07" is 2007), CODE_POINT for decimal points, CODE_OTHER elsewhere (the last
        entry serves any id > max_id). Made on `device` once and kept; do not write into it."""
        return on_device(("token_codes", self), torch.device(device or "cpu"), self._token_codes)

    def _token_codes(self, device: torch.device) -> torch.Tensor:
        # Scalar fills on the device: no host-to-device copy, so no sync even the first time.
        table = torch.full((self.max_id + 2,), CODE_OTHER, dtype=torch.long, device=device)
        for i in self.decimal_point_ids:
            table.narrow(0, i, 1).fill_(CODE_POINT)
        for i, text in self.number_tokens():
            table.narrow(0, i, 1).fill_(len(text) * CODE_LENGTH + int(text))
        return table


def digit_vocab_from_tokenizer(tok, allow_multi_digit_tokens: bool = False) -> DigitVocab:
    """DigitVocab of `tok`: one digit a token, or a chunking vocab (all 1,110 number tokens,
    numbers cut left to right in chunks of up to three; DigitVocab.multi_digit_ids) when the
    tokenizer is one. Any other tokenizer whose numbers hold other tokens (digits merged, or a
    digit after a space as a token of its own, GPT-2's 'Ġ4') raises MultiDigitTokens (a
    ValueError) with the reason, unless allow_multi_digit_tokens: then DEL applies to the bare
    single-digit tokens only, as they are encoded inside numbers (numbers made of other tokens
    get no numerical term, and a run's places count tokens)."""
    return DigitVocab(*number_token_ids(tok, allow_multi_digit_tokens))
