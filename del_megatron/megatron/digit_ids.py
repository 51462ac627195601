"""The run's digit ids: read from its tokenizer, or given by hand and held against it, once,
before the model exists. One resolver for every entry (Megatron-LM's flags, Bridge's and NeMo's
enable_numerical_loss); messages name the settings as the entry does (config.Names).

Ids copied from another tokenizer, or a chunking tokenizer's ten single-digit ids without its
1,100 multi-digit ones, would train the term on the wrong tokens without a word. Where the run
has a tokenizer with text, the given ids must be the ones it gives; where it has none
(NullTokenizer) they are used as given, and the startup report says so. A chunking tokenizer's
multi-digit tokens get terms only when a slot rule is asked for; by default DEL acts on its ten
single-digit tokens.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from ..config import Names
from ..digits.vocab import DigitVocab
from . import registration as reg

SINGLE_DIGITS_OF_CHUNKS = (
    "del_megatron: the run's tokenizer cuts numbers into chunks of up to three digits; DEL "
    "acts on its ten single-digit tokens (%s gives every digit of its multi-digit tokens a "
    "term: docs/DEL.md, 'Which slot rule')"
)


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


def _slots_without_chunks(slot_rule: str, names: Names) -> ValueError:
    return ValueError(
        f"{names('slot_logits', slot_rule)} gives a chunking tokenizer's multi-digit tokens "
        "their terms, and this run's digit ids have none (one digit a token, or ten single-digit "
        f"ids given): drop {names('slot_logits')}"
    )


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
    given: DigitVocab, read: DigitVocab, given_as: str, points_given: bool, fix: str
) -> None:
    """ValueError unless `given` (the ids a user passed, as `given_as` names them) is what the
    tokenizer gives (`read`): the same ten digit ids; decimal points among its points (when
    given); the multi-digit ids of a chunking tokenizer. `fix` says how to ask for DEL on the
    single-digit tokens only."""
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
            f"number tokens from its tokenizer), or {fix}"
        )


def _as_asked(read: DigitVocab, slot_rule: Optional[str], names: Names) -> DigitVocab:
    """The tokenizer's vocab with the number tokens that get a term: all of a chunking one's
    with a slot rule, else its single digits (said once); a slot rule without chunks is
    refused."""
    if slot_rule is None:
        if read.chunked:
            reg.log_once("chunks", SINGLE_DIGITS_OF_CHUNKS, names("slot_logits", "length"))
        return read.single_digits_only()
    if not read.chunked:
        raise _slots_without_chunks(slot_rule, names)
    return read


def resolve_vocab(
    tokenizer: Any,
    given: Optional[DigitVocab],
    names: Names,
    *,
    allow_multi_digit_tokens: bool = False,
    slot_rule: Optional[str] = None,
    points: Optional[Iterable[int]] = None,
) -> DigitVocab:
    """The run's DigitVocab. tokenizer: the run's, None when it has no text (NullTokenizer, or
    none given); given: ids passed by hand (None: read from the tokenizer); slot_rule: the rule
    asked for a chunking tokenizer's multi-digit tokens (None: single digits); points:
    decimal-point ids passed beside the tokenizer's digits (flags only). Given ids are checked
    against a tokenizer that can be read, else used as given with a note."""
    if given is None:
        if tokenizer is None:
            raise ValueError(
                f"the run needs the ids of the digit tokens, and has no tokenizer with text to "
                f"read them from: pass {names('vocab')}"
            )
        vocab = _as_asked(
            DigitVocab.from_tokenizer(tokenizer, allow_multi_digit_tokens), slot_rule, names
        )
        if points is not None:
            points = tuple(points)
            check_given_points(points, vocab, names("points"))
            vocab = DigitVocab(vocab.digit_ids, points, vocab.multi_digit_ids)
        reg.log_once("ids", "del_megatron: digit ids read from the run's tokenizer")
        return vocab
    read = None if tokenizer is None else tokenizer_vocab(tokenizer, allow_multi_digit_tokens)
    if read is None:
        if slot_rule is not None and not given.chunked:
            raise _slots_without_chunks(slot_rule, names)
        reason = (
            "there is no tokenizer with text to read digits from"
            if tokenizer is None
            else f"del_megatron cannot read digits from a {type(tokenizer).__name__}"
        )
        reg.log_once(
            "ids",
            "del_megatron: %s %s used as given, not checked: %s",
            names("vocab"),
            ids_text(given.digit_ids),
            reason,
        )
        return given
    if not given.chunked:
        read = _as_asked(read, slot_rule, names)
    fix = f"drop {names('slot_logits')} to give the term to the single digits only"
    check_given_vocab(given, read, names("vocab"), points is not None or not names.flags, fix)
    reg.log_once("ids", "del_megatron: the ids of %s match the run's tokenizer", names("vocab"))
    return given
