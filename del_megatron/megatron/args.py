"""Megatron-LM command-line flags for the numerical losses, and what they turn into."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from ..kernels.linear import DEFAULT_WEIGHT_GRADIENT, WEIGHT_GRADIENTS
from ..loss import LOSSES, REDUCTIONS, NumericalLossConfig
from ..slots import RULES
from ..vocab import DigitVocab
from ..weights import DEFAULT_ALPHA, check_digit_share, check_weight
from . import settings, state
from .given_ids import check_given_points, check_given_vocab, ids_text, tokenizer_vocab


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM extra-args provider: adds the del_megatron flags and returns the parser."""
    group = parser.add_argument_group(title="numerical loss (del_megatron)")
    group.add_argument(
        "--numerical-loss",
        choices=LOSSES,
        default=None,
        help="loss added to cross-entropy on digit targets. 'ce' is an A/B's control arm: "
        "Megatron's cross-entropy, with the digit entries a DEL run logs (digit acc, digit "
        "entropy, ...). Without this flag the run is stock Megatron-LM",
    )
    group.add_argument(
        "--del-alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help="weight of the numerical term's mean over digit targets, as in the papers: "
        "loss = mean CE + alpha x mean digit term, under either reduction (default "
        f"{DEFAULT_ALPHA:g}: the DEL paper's CodeLlama and Mistral runs; `del-megatron check` "
        "gives the weight the paper's runs applied for your tokenizer's family)",
    )
    group.add_argument(
        "--del-reduction",
        choices=REDUCTIONS,
        default="digit",
        help="'digit' (default): the term is averaged over the digit targets of the whole step "
        "(all micro-batches, all data-parallel ranks: one count a step); 'token': each digit "
        "token's term weighs alpha / --del-digit-share in Megatron's per-token loss (no count)",
    )
    group.add_argument(
        "--del-digit-share",
        type=float,
        default=None,
        metavar="S",
        help="with --del-reduction token: the share of loss tokens that are digit targets in "
        "the run's data, in (0, 1] (`del-megatron check --data-path` measures it)",
    )
    group.add_argument(
        "--del-digit-token-ids",
        type=int,
        nargs=10,
        default=None,
        metavar="ID",
        help="ids of the tokens '0'..'9' in order (default: read from the run's tokenizer)",
    )
    group.add_argument(
        "--del-decimal-point-token-ids",
        type=int,
        nargs="*",
        default=None,
        metavar="ID",
        help="ids of '.' tokens (default: read from the run's tokenizer)",
    )
    group.add_argument(
        "--del-logits-free",
        nargs="?",
        const=DEFAULT_WEIGHT_GRADIENT,
        default=False,
        choices=WEIGHT_GRADIENTS,
        metavar="WEIGHT_GRADIENT",
        help="compute the loss from the output layer's input, chunked over tokens, so that the "
        "[s, b, V/tp] logits never exist in training (megatron-core >= 0.18; the same loss; "
        "with --numerical-loss ce, a logits-free cross-entropy). Optional value: where the "
        "output weight's gradient is formed, 'forward' (an fp32 [V/tp, h] accumulator, as many "
        "matmuls as the materialised path), 'backward' (by vocab tile, one matmul more, no "
        "accumulator) or 'auto' (the default: 'forward' unless its accumulator would be large "
        "beside the logits and beside the backward route's own buffers; logged)",
    )
    group.add_argument(
        "--del-allow-multi-digit-tokens",
        action="store_true",
        help="accept a tokenizer that merges digits in another way than a chunking one, or has "
        "tokens of its own for a digit after a space (GPT-2's 'Ġ4'); DEL then acts on the "
        "bare single-digit tokens only (Llama-3's chunks of up to three need no opt-in)",
    )
    group.add_argument(
        "--del-slot-logits",
        choices=RULES,
        default=None,
        help="with a chunking tokenizer (Llama-3, o200k, DeepSeek-V3): give every digit of its "
        "1,100 multi-digit tokens a term through slot logits under this rule, 'length' (the "
        "label's number of digits, prefix-conditional) or 'any' (every length; del-megatron "
        "0.2); see docs/DEL.md. Default: DEL on its ten single-digit tokens only (no slot rule "
        "beat it in our comparison, docs/results.md)",
    )
    group.add_argument(
        "--del-single-digits-only",
        action="store_true",
        help="with a chunking tokenizer (Llama-3, o200k, DeepSeek-V3), give the term to the "
        "ten single-digit tokens only: the default without --del-slot-logits, said explicitly",
    )
    return parser


def chain_extra_args(*providers: Optional[Callable]) -> Callable:
    """One extra-args provider that runs `providers` in order (None entries skipped)."""

    def provider(parser):
        for extra in providers:
            if extra is not None:
                parser = extra(parser) or parser
        return parser

    return provider


SINGLE_DIGITS_FLAG = "--del-single-digits-only"
MULTI_DIGITS_FLAG = "--del-allow-multi-digit-tokens"
SINGLE_DIGITS_OF_CHUNKS = (
    "del_megatron: the run's tokenizer cuts numbers into chunks of up to three digits; DEL "
    "acts on its ten single-digit tokens (--del-slot-logits length gives every digit of its "
    "multi-digit tokens a term: docs/DEL.md, 'Which slot rule')"
)


def _slots_asked(args) -> bool:
    """Whether a chunking tokenizer's multi-digit tokens get slot terms (--del-slot-logits);
    --del-single-digits-only beside it is refused."""
    rule = getattr(args, "del_slot_logits", None)
    if rule is not None and getattr(args, "del_single_digits_only", False):
        raise ValueError(
            f"--del-slot-logits {rule} gives every digit of a chunking tokenizer's multi-digit "
            f"tokens a term, and {SINGLE_DIGITS_FLAG} gives the single digits only: drop one"
        )
    return rule is not None


def _slots_without_chunks(args) -> ValueError:
    return ValueError(
        f"--del-slot-logits {args.del_slot_logits} gives a chunking tokenizer's multi-digit "
        "tokens their terms, and this run has none (its tokenizer has one digit a token, or no "
        "text to read them from): drop --del-slot-logits"
    )


def _has_text(args, tokenizer) -> bool:
    return tokenizer is not None and getattr(args, "tokenizer_type", None) != "NullTokenizer"


def digit_vocab_from_args(args, tokenizer=None) -> Optional[DigitVocab]:
    """DigitVocab from the flags, or else from the run's tokenizer (None for loss 'ce'). Ids
    given by flag are held against the tokenizer where it has text (given_ids.py). None
    without --numerical-loss (a logits-free stock CE): nothing to report."""
    if args.numerical_loss is None:
        return None
    if args.del_digit_token_ids is not None:
        return _given_vocab(args, tokenizer)
    if not _has_text(args, tokenizer):
        source = "the NullTokenizer has no text" if tokenizer is not None else "no tokenizer"
        raise ValueError(
            f"--numerical-loss {args.numerical_loss} needs the ids of the digit tokens, and "
            f"{source} to read them from: pass --del-digit-token-ids with the ten ids of "
            "'0'..'9' (and --del-decimal-point-token-ids for '.')"
        )
    vocab = DigitVocab.from_tokenizer(tokenizer, args.del_allow_multi_digit_tokens)
    if not _slots_asked(args):
        if vocab.chunked:
            state.log_once("chunks", SINGLE_DIGITS_OF_CHUNKS)
        vocab = vocab.single_digits_only()
    elif not vocab.chunked:
        raise _slots_without_chunks(args)
    if args.del_decimal_point_token_ids is not None:
        points = args.del_decimal_point_token_ids
        check_given_points(points, vocab, "--del-decimal-point-token-ids")
        vocab = DigitVocab(vocab.digit_ids, points, vocab.multi_digit_ids)
    state.log_once("ids", "del_megatron: digit ids read from the run's tokenizer")
    return vocab


def _given_vocab(args, tokenizer) -> DigitVocab:
    """--del-digit-token-ids (and points): checked against a tokenizer with text, else used as
    given with a note. Flags that would do nothing beside them are refused."""
    given = DigitVocab(args.del_digit_token_ids, args.del_decimal_point_token_ids or ())
    if getattr(args, "del_single_digits_only", False):
        raise ValueError(
            f"{SINGLE_DIGITS_FLAG} does nothing beside --del-digit-token-ids (the ten ids given "
            f"are used as they are): drop {SINGLE_DIGITS_FLAG}"
        )
    slots = _slots_asked(args)
    multi = args.del_allow_multi_digit_tokens
    if not _has_text(args, tokenizer):
        if slots:
            raise _slots_without_chunks(args)
        if multi:
            raise ValueError(
                f"{MULTI_DIGITS_FLAG} does nothing beside --del-digit-token-ids when the run's "
                "tokenizer has no text (NullTokenizer): there is no tokenizer to accept: drop "
                f"{MULTI_DIGITS_FLAG}"
            )
        state.log_once(
            "ids",
            "del_megatron: --del-digit-token-ids %s used as given, not checked: the run's "
            "tokenizer has no text to read digits from",
            ids_text(given.digit_ids),
        )
        return given
    read = tokenizer_vocab(tokenizer, multi)
    if read is None:
        state.log_once(
            "ids",
            "del_megatron: --del-digit-token-ids %s used as given, not checked: del_megatron "
            "cannot read digits from a %s",
            ids_text(given.digit_ids),
            type(tokenizer).__name__,
        )
        return given
    points_given = args.del_decimal_point_token_ids is not None
    if not slots:
        if read.chunked:
            state.log_once("chunks", SINGLE_DIGITS_OF_CHUNKS)
        read = read.single_digits_only()
    elif not read.chunked:
        raise _slots_without_chunks(args)
    fix = "drop --del-slot-logits to give the term to the single digits only"
    check_given_vocab(given, read, "--del-digit-token-ids", points_given, fix)
    state.log_once("ids", "del_megatron: --del-digit-token-ids match the run's tokenizer")
    return given


# Flags that act without --numerical-loss too (a logits-free CE).
WITH_CE = ("del_logits_free",)
# Flags of the weight and its reduction: read by a numerical loss, not by the control arm.
WEIGHT_FLAGS = ("--del-alpha", "--del-reduction", "--del-digit-share")


def _on_the_command_line(flag: str) -> bool:
    """Whether `flag` is in this process's command line (Megatron-LM parses sys.argv)."""
    return any(a == flag or a.startswith(flag + "=") for a in sys.argv[1:])


def _set_del_flags(args) -> list:
    """The --del-* flags set to other than their defaults or given on the command line at all
    (--del-alpha 0.1 is the default), those that act without a loss (WITH_CE) aside."""
    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
    return [
        "--" + name.replace("_", "-")
        for name, default in defaults.items()
        if name.startswith("del_")
        and name not in WITH_CE
        and (
            getattr(args, name, default) != default
            or _on_the_command_line("--" + name.replace("_", "-"))
        )
    ]


def check_flags_need_a_loss(args) -> None:
    """Refuse --del-* flags without --numerical-loss (the forgotten flag: the run would train
    stock CE in silence). --numerical-loss ce, the control arm of an A/B, accepts them
    (say_unused_weight_flags says which it does not read)."""
    if getattr(args, "numerical_loss", None) is not None:
        return
    set_flags = _set_del_flags(args)
    if set_flags:
        others = ", ".join(loss for loss in LOSSES if loss not in ("ce", "del"))
        raise ValueError(
            f"{', '.join(set_flags)} set without --numerical-loss, so the run trains stock "
            f"cross-entropy and reads none of them: add --numerical-loss del (or {others}; ce "
            "for the control arm of an A/B), or drop them"
        )


def say_unused_weight_flags(args) -> None:
    """With --numerical-loss ce, log once the weight flags given that the control arm does not
    read (the DEL arm's command line may keep them)."""
    if getattr(args, "numerical_loss", None) != "ce":
        return
    unused = [flag for flag in _set_del_flags(args) if flag in WEIGHT_FLAGS]
    if unused:
        state.log_once(
            "unused weight flags",
            "del_megatron: %s unused: --numerical-loss ce trains Megatron's cross-entropy "
            "(the control arm) and reports the digit entries beside it",
            ", ".join(unused),
        )


def config_from_args(args, tokenizer=None) -> NumericalLossConfig:
    """NumericalLossConfig from parsed Megatron-LM args. Call before training starts: a
    tokenizer without single-digit tokens stops the run here with a clear message."""
    check_flags_need_a_loss(args)
    check_reduction_flags(args)
    vocab = digit_vocab_from_args(args, tokenizer)
    vocab_size = getattr(args, "padded_vocab_size", None)
    if vocab is not None and vocab_size is not None:
        vocab.check_vocab_size(vocab_size)
    alpha = check_weight(args.del_alpha, "--del-alpha")
    slot_logits = getattr(args, "del_slot_logits", None)
    if args.numerical_loss in (None, "ce"):  # the weight flags are unused (said once)
        return settings.numerical_config("ce", alpha, vocab, None, None, slot_logits)
    return settings.numerical_config(
        args.numerical_loss,
        alpha,
        vocab,
        args.del_reduction,
        getattr(args, "del_digit_share", None),
        slot_logits,
    )


def check_reduction_flags(args) -> None:
    """Refuse --del-reduction token without --del-digit-share, and the share without it, in the
    flags' own words (NumericalLossConfig's messages name its fields)."""
    share = getattr(args, "del_digit_share", None)
    if args.numerical_loss in (None, "ce"):
        return
    if args.del_reduction == "token" and share is None:
        raise ValueError(
            "--del-reduction token needs --del-digit-share S, the share of loss tokens that are "
            "digit targets in your data (`del-megatron check --data-path PREFIX` prints it): "
            "--del-alpha is the weight on the mean term over digit targets, and the token "
            "reduction weighs each digit token's term by alpha / S. Or drop --del-reduction "
            "token: the default 'digit' counts the digit targets itself"
        )
    if args.del_reduction != "token" and share is not None:
        raise ValueError(
            "--del-digit-share is used by --del-reduction token only: add --del-reduction "
            "token, or drop --del-digit-share (the default 'digit' reduction counts the digit "
            "targets itself)"
        )
    if share is not None:
        check_digit_share(share, "--del-digit-share")


def check_flags(args) -> None:
    """The refusals the DEL flags decide alone (Megatron-LM runs them as it parses the command
    line): a forgotten --numerical-loss, the reduction and its share, the weight, and slot
    flags that contradict each other."""
    check_flags_need_a_loss(args)
    check_reduction_flags(args)
    check_weight(args.del_alpha, "--del-alpha")
    _slots_asked(args)
