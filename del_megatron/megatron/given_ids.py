"""Digit ids given by hand (--del-digit-token-ids, Bridge's and NeMo's vocab=) held against the
run's own tokenizer, once, before the model exists.

Ids copied from another tokenizer, or a chunking tokenizer's ten single-digit ids without its
1,100 multi-digit ones, would train the term on the wrong tokens without a word. Where the run
has a tokenizer with text, the given ids must be the ones it gives; where it has none
(NullTokenizer) they are used as given, and the startup report says so.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from ..vocab import DigitVocab
from . import state


def ids_text(ids: Iterable[int]) -> str:
    """Ids as the flags take them: space-separated."""
    return " ".join(map(str, ids))


def tokenizer_vocab(tokenizer: Any, allow_multi_digit_tokens: bool) -> Optional[DigitVocab]:
    """What the tokenizer gives (DigitVocab.from_tokenizer), None for a tokenizer kind that
    cannot be read. A tokenizer that merges digits without the opt-in raises its own error."""
    try:
        return DigitVocab.from_tokenizer(tokenizer, allow_multi_digit_tokens)
    except TypeError:
        return None


def check_given_points(points: Iterable[int], read: DigitVocab, given_as: str) -> None:
    """ValueError unless every decimal-point id given is a '.' of the tokenizer (`read`)."""
    points = tuple(points)
    extra = sorted(set(points) - set(read.decimal_point_ids))
    if extra:
        raise ValueError(
            f"{given_as} gives decimal-point ids {ids_text(points)}, but {ids_text(extra)} are "
            f"not '.' in the run's tokenizer (its '.' ids: "
            f"{ids_text(read.decimal_point_ids) or 'none'}): "
            "drop them to read them from the tokenizer, or pass its own"
        )


def check_given_vocab(
    given: DigitVocab,
    read: DigitVocab,
    given_as: str,
    points_given: bool,
    single_digits_fix: str,
) -> None:
    """ValueError unless `given` (the ids a user passed, as `given_as` names them) is what the
    tokenizer gives (`read`): the same ten digit ids; decimal points among its points (when
    given); the multi-digit ids of a chunking tokenizer. `single_digits_fix` says how to ask for
    DEL on the single-digit tokens only."""
    if given.digit_ids != read.digit_ids:
        raise ValueError(
            f"{given_as} gives digit ids {ids_text(given.digit_ids)}, but the run's tokenizer "
            f"has '0'..'9' at {ids_text(read.digit_ids)}: the ids are from another tokenizer. "
            "Drop them to read them from the run's tokenizer, or pass its own"
        )
    if points_given:
        check_given_points(given.decimal_point_ids, read, given_as)
    if given.chunked and given.multi_digit_ids != read.multi_digit_ids:
        raise ValueError(
            f"{given_as} gives multi-digit ids that are not the run's tokenizer's number tokens "
            "(another tokenizer's, or another order): drop them to read them from it"
        )
    if read.chunked and not given.chunked:
        raise ValueError(
            f"the run's tokenizer cuts numbers into tokens of up to three digits, and "
            f"{given_as} names its ten single-digit tokens only: the term would skip every digit "
            "of its 1,100 two- and three-digit tokens. Drop the ids (the run reads all 1,110 "
            f"number tokens from its tokenizer), or {single_digits_fix}"
        )


def api_vocab(
    vocab: Optional[DigitVocab],
    tokenizer: Any,
    allow_multi_digit_tokens: bool,
    slot_logits: Optional[str],
) -> DigitVocab:
    """Bridge's and NeMo's enable_numerical_loss: the vocab= given, held against `tokenizer`
    when there is one, else the tokenizer's own; a chunking tokenizer's multi-digit tokens only
    with a slot rule (slot_logits), else its single-digit tokens. The caller makes sure one of
    vocab and tokenizer is given."""
    if vocab is None:
        read = DigitVocab.from_tokenizer(tokenizer, allow_multi_digit_tokens)
        if slot_logits is not None and not read.chunked:
            raise ValueError(
                f"slot_logits={slot_logits!r} gives a chunking tokenizer's multi-digit tokens "
                "their terms, and this tokenizer has one digit a token: drop slot_logits"
            )
        return read if slot_logits is not None else read.single_digits_only()
    read = None if tokenizer is None else tokenizer_vocab(tokenizer, allow_multi_digit_tokens)
    if read is None:
        state.log_once(
            "ids",
            "del_megatron: vocab= digit ids %s used as given, not checked: no tokenizer "
            "del_megatron can read digits from",
            ids_text(vocab.digit_ids),
        )
        return vocab
    if not vocab.chunked:
        read = read.single_digits_only()
    check_given_vocab(vocab, read, "vocab=", True, "pass vocab=None")
    state.log_once("ids", "del_megatron: vocab= matches the tokenizer's digit ids")
    return vocab
