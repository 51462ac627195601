"""Megatron-LM's command-line flags for the numerical losses, and the NumericalLossConfig they
make. The flags name config.py's settings (config.FLAGS); they are validated by its one check,
with flag names in the messages, as soon as Megatron-LM parses them (check_flags), and the digit
ids are resolved from the run's tokenizer by digit_ids.py."""

from __future__ import annotations

import argparse
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from ..config import (
    DEFAULT_ALPHA,
    DEFAULT_REDUCTION,
    FLAG_NAMES,
    FLAGS,
    LOSSES,
    REDUCTIONS,
    SCALAR_SETTINGS,
    NumericalLossConfig,
    Settings,
    check_loss_given,
    check_settings,
    field_of,
    unused_weight_settings,
)
from ..digits.slots import RULES
from ..digits.vocab import DigitVocab
from ..kernels.linear import DEFAULT_WEIGHT_GRADIENT, WEIGHT_GRADIENTS
from . import registration as reg
from .digit_ids import resolve_vocab

SINGLE_DIGITS_FLAG = "--del-single-digits-only"
MULTI_DIGITS_FLAG = "--del-allow-multi-digit-tokens"
# Flags that act without --numerical-loss too (a logits-free CE).
WITH_CE = ("del_logits_free",)
# On the parsed namespace: the dests of the --del-* flags the command line gave, whatever their
# values (a flag given at its default value is given all the same).
GIVEN = "del_flags_given"


def _recording(parser: argparse.ArgumentParser, action: str) -> type:
    """argparse's `action` class, recording its dest in the namespace's GIVEN set when the
    command line gives the flag."""
    base = parser._registry_get("action", action, action)

    class Given(base):
        def __call__(self, parser, namespace, values, option_string=None):
            setattr(namespace, GIVEN, set(getattr(namespace, GIVEN, None) or ()) | {self.dest})
            super().__call__(parser, namespace, values, option_string)

    return Given


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM extra-args provider: adds the del_megatron flags and returns the parser."""
    group = parser.add_argument_group(title="numerical loss (del_megatron)")
    group.add_argument(
        "--numerical-loss",
        action=_recording(parser, "store"),
        choices=LOSSES,
        default=None,
        help="loss added to cross-entropy on digit targets. 'ce' is an A/B's control arm: "
        "Megatron's cross-entropy, with the digit entries a DEL run logs (digit acc, digit "
        "entropy, ...). Without this flag the run is stock Megatron-LM",
    )
    group.add_argument(
        "--del-alpha",
        action=_recording(parser, "store"),
        type=float,
        default=DEFAULT_ALPHA,
        help="weight of the numerical term's mean over digit targets, as in the papers: "
        "loss = mean CE + alpha x mean digit term, under either reduction (default "
        f"{DEFAULT_ALPHA:g}: the DEL paper's CodeLlama and Mistral runs; `del-megatron check` "
        "gives the weight the paper's runs applied for your tokenizer's family)",
    )
    group.add_argument(
        "--del-reduction",
        action=_recording(parser, "store"),
        choices=REDUCTIONS,
        default=DEFAULT_REDUCTION,
        help="'digit' (default): the term is averaged over the digit targets of the whole step "
        "(all micro-batches, all data-parallel ranks: one count a step); 'token': each digit "
        "token's term weighs alpha / --del-digit-share in Megatron's per-token loss (no count)",
    )
    group.add_argument(
        "--del-digit-share",
        action=_recording(parser, "store"),
        type=float,
        default=None,
        metavar="S",
        help="with --del-reduction token: the share of loss tokens that are digit targets in "
        "the run's data, in (0, 1] (`del-megatron check --data-path` measures it)",
    )
    group.add_argument(
        FLAGS["vocab"],
        action=_recording(parser, "store"),
        type=int,
        nargs=10,
        default=None,
        metavar="ID",
        help="ids of the tokens '0'..'9' in order (default: read from the run's tokenizer)",
    )
    group.add_argument(
        FLAGS["points"],
        action=_recording(parser, "store"),
        type=int,
        nargs="*",
        default=None,
        metavar="ID",
        help="ids of '.' tokens (default: read from the run's tokenizer)",
    )
    group.add_argument(
        "--del-logits-free",
        action=_recording(parser, "store"),
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
        action=_recording(parser, "store_true"),
        help="accept a tokenizer that merges digits in another way than a chunking one, or has "
        "tokens of its own for a digit after a space (GPT-2's 'Ġ4'); DEL then acts on the "
        "bare single-digit tokens only (Llama-3's chunks of up to three need no opt-in)",
    )
    group.add_argument(
        "--del-slot-logits",
        action=_recording(parser, "store"),
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
        action=_recording(parser, "store_true"),
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


def _slot_rule(args: Any) -> Optional[str]:
    """The slot rule asked for a chunking tokenizer's multi-digit tokens (--del-slot-logits);
    --del-single-digits-only beside it is refused."""
    rule = getattr(args, "del_slot_logits", None)
    if rule is not None and getattr(args, "del_single_digits_only", False):
        raise ValueError(
            f"--del-slot-logits {rule} gives every digit of a chunking tokenizer's multi-digit "
            f"tokens a term, and {SINGLE_DIGITS_FLAG} gives the single digits only: drop one"
        )
    return rule


def _has_text(args: Any, tokenizer: Any) -> bool:
    return tokenizer is not None and getattr(args, "tokenizer_type", None) != "NullTokenizer"


def digit_vocab_from_args(args: Any, tokenizer: Any = None) -> Optional[DigitVocab]:
    """DigitVocab from the flags and the run's tokenizer (digit_ids.resolve_vocab); None
    without --numerical-loss (a logits-free stock CE: nothing to report). Flags that would do
    nothing beside --del-digit-token-ids are refused."""
    if args.numerical_loss is None:
        return None
    has_text, rule = _has_text(args, tokenizer), _slot_rule(args)
    given, points = None, args.del_decimal_point_token_ids
    if args.del_digit_token_ids is not None:
        given, points = DigitVocab(args.del_digit_token_ids, points or ()), points
        if getattr(args, "del_single_digits_only", False):
            raise ValueError(
                f"{SINGLE_DIGITS_FLAG} does nothing beside --del-digit-token-ids (the ten ids "
                f"given are used as they are): drop {SINGLE_DIGITS_FLAG}"
            )
        if not has_text and args.del_allow_multi_digit_tokens and rule is None:
            raise ValueError(
                f"{MULTI_DIGITS_FLAG} does nothing beside --del-digit-token-ids when the run's "
                "tokenizer has no text (NullTokenizer): there is no tokenizer to accept: drop "
                f"{MULTI_DIGITS_FLAG}"
            )
    elif not has_text:
        source = "the NullTokenizer has no text" if tokenizer is not None else "no tokenizer"
        raise ValueError(
            f"--numerical-loss {args.numerical_loss} needs the ids of the digit tokens, and "
            f"{source} to read them from: pass --del-digit-token-ids with the ten ids of "
            "'0'..'9' (and --del-decimal-point-token-ids for '.')"
        )
    return resolve_vocab(
        tokenizer if has_text else None,
        given,
        FLAG_NAMES,
        allow_multi_digit_tokens=args.del_allow_multi_digit_tokens,
        slot_rule=rule,
        points=points,
    )


def _set_del_flags(args: Any) -> dict:
    """The --del-* flags (-> their dest) the command line gave, whatever their values (GIVEN,
    recorded as add_arguments' parser parsed them: --del-alpha 0.1 is given though 0.1 is the
    default), and those set to other than their defaults on a namespace made another way;
    those that act without a loss (WITH_CE) aside."""
    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
    given = getattr(args, GIVEN, None) or set()
    return {
        "--" + name.replace("_", "-"): name
        for name, default in defaults.items()
        if name.startswith("del_")
        and name not in WITH_CE
        and (name in given or getattr(args, name, default) != default)
    }


def check_flags_need_a_loss(args: Any) -> None:
    """Refuse --del-* flags without --numerical-loss (the forgotten flag: the run would train
    stock CE in silence; config.check_loss_given). --numerical-loss ce, the control arm of an
    A/B, accepts them (say_unused_weight_flags says which it does not read)."""
    check_loss_given(getattr(args, "numerical_loss", None), _set_del_flags(args), FLAG_NAMES)


def say_unused_weight_flags(args: Any) -> None:
    """With --numerical-loss ce, log once the weight flags given that the control arm does not
    read (the DEL arm's command line may keep them)."""
    given = [setting for setting, flag in FLAGS.items() if flag in _set_del_flags(args)]
    line = unused_weight_settings(getattr(args, "numerical_loss", None), given, FLAG_NAMES)
    if line:
        reg.log_once("unused weight settings", "%s", line)


def _settings(args: Any) -> dict:
    """NumericalLossConfig's settings as the flags give them (no --numerical-loss: "ce", a
    logits-free stock cross-entropy)."""
    given = {setting: getattr(args, field_of(setting), None) for setting in SCALAR_SETTINGS}
    given["loss"] = given["loss"] or "ce"
    return {setting: value for setting, value in given.items() if value is not None}


# Each parsed namespace's flags as check_flags found them, by the namespace's identity (argparse
# namespaces compare by value and do not hash): (a weak reference to it, its --del-* values, the
# Settings), so that the route from the command line to the loss checks them once.
_CHECKED: Dict[int, Tuple[Any, tuple, Settings]] = {}


def _flag_values(args: Any) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in vars(args).items() if k.startswith("del_")))


def check_flags(args: Any) -> Settings:
    """The refusals the DEL flags decide alone, in the flags' words (Megatron-LM runs them as it
    parses the command line: lm.add_arguments): a forgotten --numerical-loss, the settings'
    one check (config.check_settings: the weight, the reduction and its share), and slot flags
    that contradict each other. Returns the Settings, kept for the namespace (checked)."""
    check_flags_need_a_loss(args)
    settings = check_settings(**_settings(args), names=FLAG_NAMES)
    _slot_rule(args)
    key = id(args)
    try:
        ref = weakref.ref(args, lambda _: _CHECKED.pop(key, None))
    except TypeError:  # no weak references: checked again next time
        return settings
    _CHECKED[key] = (ref, _flag_values(args), settings)
    return settings


def checked(args: Any) -> Settings:
    """The Settings of a namespace's flags: those check_flags found when the parser parsed it
    (the flags unchanged since), else check_flags now."""
    known = _CHECKED.get(id(args))
    if known is not None and known[0]() is args and known[1] == _flag_values(args):
        return known[2]
    return check_flags(args)


def config_from_args(args: Any, tokenizer: Any = None) -> NumericalLossConfig:
    """NumericalLossConfig from parsed Megatron-LM args and the run's tokenizer. Call before
    training starts: a tokenizer without single-digit tokens stops the run here. The flags
    are checked once (checked); the vocab read from the tokenizer is checked here."""
    settings = checked(args)
    vocab = digit_vocab_from_args(args, tokenizer)
    vocab_size = getattr(args, "padded_vocab_size", None)
    if vocab is not None and vocab_size is not None:
        vocab.check_vocab_size(vocab_size)
    return NumericalLossConfig.of(settings, vocab)
