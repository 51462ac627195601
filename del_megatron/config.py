"""What a run means, in one object: NumericalLossConfig, its defaults, its one validation, and
its names as a flag, a keyword argument and a model-config field.

Every entry builds the same object: Megatron-LM's flags (megatron/flags.py), Bridge's and NeMo's
`enable_numerical_loss(**settings)` (its keyword arguments), a model config's fields
(`from_fields`, read once per config) and the Python API. A message names a setting the way its
entry does (`Names`): `alpha` for the API, `--del-alpha` for the flags.

The range checks of the numbers that set a weight (check_weight, check_digit_share,
check_learning_rate) are here too, one rule for every entry; each returns a Python float.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, asdict, dataclass
from typing import Any, Dict, Iterable, Optional

from .digits.slots import DEFAULT_SLOT_LOGITS, RULES
from .digits.vocab import DigitVocab
from .heads import HEADS

# Losses whose term is the cross-entropy itself at digit targets, not a head on digit logits:
# "digit_ce", the control for "any extra weight on digits" (docs/DEL.md).
CE_TERM_LOSSES = ("digit_ce",)
LOSSES = ("ce",) + tuple(HEADS) + CE_TERM_LOSSES
REDUCTIONS = ("digit", "token")
# The weight the DEL paper wrote and applied in its CodeLlama and Mistral-7B runs (docs/DEL.md,
# "The weight the paper's runs applied").
DEFAULT_ALPHA = 0.1
DEFAULT_REDUCTION = "digit"
# The settings that weigh the term, which loss "ce" (the control arm of an A/B) does not read.
WEIGHT_SETTINGS = ("alpha", "reduction", "digit_share")

# Each setting's flag; its model-config field is the flag's argparse dest (--del-alpha: del_alpha).
# The vocab's digit ids and decimal points are NumericalLossConfig's `vocab` (a DigitVocab).
FLAGS = {
    "loss": "--numerical-loss",
    "alpha": "--del-alpha",
    "reduction": "--del-reduction",
    "digit_share": "--del-digit-share",
    "slot_logits": "--del-slot-logits",
    "vocab": "--del-digit-token-ids",
    "points": "--del-decimal-point-token-ids",
}
# The settings a model config carries as one field each, then the vocab's three fields (its
# digit ids, decimal points and multi-digit tokens).
SCALAR_SETTINGS = ("loss", "alpha", "reduction", "digit_share", "slot_logits")
VOCAB_FIELDS = ("del_digit_token_ids", "del_decimal_point_token_ids", "del_multi_digit_token_ids")
_CACHED = "_del_megatron_config"  # on a model config: (its fields' values, the config built)


def field_of(setting: str) -> str:
    """The model-config field of a setting: `alpha` -> `del_alpha`."""
    return FLAGS[setting].removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Names:
    """How a message names a setting: as the API's keyword (`reduction='token'`) or, with
    `flags`, as its flag (`--del-reduction token`)."""

    flags: bool = False

    def __call__(self, setting: str, value: Any = None) -> str:
        """`setting` (a NumericalLossConfig field, "vocab" or "points"), with `value` if given."""
        if self.flags:
            return FLAGS[setting] + ("" if value is None else f" {value}")
        if setting == "vocab":
            return "vocab="  # ids given as a DigitVocab
        return setting if value is None else f"{setting}={value!r}"


API_NAMES, FLAG_NAMES = Names(), Names(flags=True)


def _real(value: Any, name: str) -> float:
    item = getattr(value, "item", None)
    if not isinstance(value, numbers.Real) and callable(item):
        try:  # a 0-d tensor or array
            value = item()
        except (ValueError, RuntimeError):
            raise TypeError(f"{name} must be one real number, got {value!r}") from None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def check_weight(value: Any, name: str = "alpha") -> float:
    """`value` as a float, if it is a finite number >= 0; ValueError / TypeError naming `name`."""
    weight = _real(value, name)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(
            f"{name} must be a finite number >= 0, got {value!r} (a negative weight trains "
            "against the target)"
        )
    return weight


def check_digit_share(value: Any, name: str = "digit_share") -> float:
    """`value` as a float, if it is a finite share in (0, 1]."""
    share = _real(value, name)
    if not math.isfinite(share) or not 0 < share <= 1:
        raise ValueError(
            f"{name} must be the share of loss tokens that are digit targets, a number in "
            f"(0, 1], got {value!r} (`del-megatron check --data-path PREFIX` measures it)"
        )
    return share


def check_learning_rate(value: Any, name: str = "lr", allow_zero: bool = False) -> float:
    """`value` as a float, if it is a finite number > 0 (>= 0 with allow_zero: a final rate)."""
    rate = _real(value, name)
    if not math.isfinite(rate) or rate < 0 or (rate == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite learning rate {bound}, got {value!r}")
    return rate


@dataclass(frozen=True)
class Settings:
    """The settings that need no vocab, as check_settings returned them: checked once, and
    taken as they are by NumericalLossConfig.of (alpha and digit_share floats, slot_logits
    never None)."""

    loss: str
    alpha: float
    reduction: str
    digit_share: Optional[float]
    slot_logits: str


def check_settings(
    loss: str = "del",
    alpha: Any = DEFAULT_ALPHA,
    reduction: str = DEFAULT_REDUCTION,
    digit_share: Any = None,
    slot_logits: Optional[str] = None,
    names: Names = API_NAMES,
) -> Settings:
    """The one validation of the settings that need no vocab (NumericalLossConfig's defaults).
    Returns them as Settings: alpha and digit_share as floats and slot_logits with None as
    DEFAULT_SLOT_LOGITS. Loss "ce" reads neither the reduction nor the share, so they are not
    held against each other there. Errors name the settings as `names` does."""
    slot_logits = DEFAULT_SLOT_LOGITS if slot_logits is None else slot_logits
    if loss not in LOSSES:
        raise ValueError(f"{names('loss')} must be one of {LOSSES}, got {loss!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{names('reduction')} must be one of {REDUCTIONS}, got {reduction!r}")
    if slot_logits not in RULES:
        raise ValueError(f"{names('slot_logits')} must be one of {RULES}, got {slot_logits!r}")
    alpha = check_weight(alpha, names("alpha"))
    token, share = names("reduction", "token"), names("digit_share")
    if loss != "ce" and digit_share is not None and reduction != "token":
        raise ValueError(
            f"{share} is used by {token} only: add {token}, or drop {share} (the default "
            "'digit' reduction counts the digit targets itself)"
        )
    if loss != "ce" and digit_share is None and reduction == "token":
        raise ValueError(
            f"{token} needs {share}, the share of loss tokens that are digit targets in your "
            f"data (`del-megatron check --data-path PREFIX` measures it): {names('alpha')} weighs "
            "the mean term over digit targets, which the token reduction reaches by weighing "
            f"each digit token's term by it / {share}. Or drop {token}: the default 'digit' "
            "reduction counts the digit targets itself"
        )
    if digit_share is not None:
        digit_share = check_digit_share(digit_share, share)
    return Settings(loss, alpha, reduction, digit_share, slot_logits)


def check_loss_given(loss: Optional[str], given: Iterable[str], names: Names = API_NAMES) -> None:
    """Refuse settings given without a loss (`given`: their names, as `names` words them): the
    forgotten --numerical-loss, or enable_numerical_loss(loss=None, alpha=...). The run would
    train stock cross-entropy and read none of them."""
    given = list(given)
    if loss is not None or not given:
        return
    others = ", ".join(name for name in LOSSES if name not in ("ce", "del"))
    raise ValueError(
        f"{', '.join(given)} set without {names('loss')}, so the run trains stock "
        f"cross-entropy and reads none of them: add {names('loss', 'del')} (or {others}; ce for "
        "the control arm of an A/B), or drop them"
    )


def unused_weight_settings(loss: str, given: Iterable[str], names: Names = API_NAMES) -> str:
    """The startup line for the weight settings `given` (their names) that loss "ce" does not
    read ("" when there are none or the loss reads them)."""
    given = set(given)
    unused = [names(setting) for setting in WEIGHT_SETTINGS if setting in given]
    if loss != "ce" or not unused:
        return ""
    return (
        f"del_megatron: {', '.join(unused)} unused: {names('loss', 'ce')} trains Megatron's "
        "cross-entropy (the control arm) and reports the digit entries beside it"
    )


@dataclass(frozen=True)
class NumericalLossConfig:
    """What a run means: the loss added to cross-entropy, and how much of it.

    loss:         "ce" (plain cross-entropy), "del", "ntl_was", "ntl_mse", "dist2" or
                  "digit_ce" (cross-entropy again on the digit targets: extra weight on digits)
    alpha:        weight of the numerical term's mean over digit targets, as in the papers:
                  loss = mean CE + alpha * mean digit term, under either reduction
    vocab:        DigitVocab of the tokenizer (required unless loss == "ce")
    reduction:    "digit" (the term averaged over the digit targets themselves) or "token"
                  (each token carries CE_t + alpha / digit_share * term_t, no counting;
                  docs/DEL.md)
    ignore_index: label value of positions without a loss
    digit_share:  with reduction "token": the share of loss tokens that are digit targets
                  (in (0, 1]; counted in digits); None otherwise
    slot_logits:  a chunking vocab's slot rule (docs/DEL.md): "length" (candidates of the
                  label's number of digits, prefix-conditional) or "any" (every length); the
                  same on a one-digit-a-token vocab; None is "length"
    names:        (init only) how error messages name the settings: config.API_NAMES, or
                  config.FLAG_NAMES where they came from Megatron-LM's flags

    How the loss is computed (kernel, inplace, validate, chunk_tokens) is a keyword argument of
    numerical_lm_loss, numerical_linear_loss and loss_parts.
    """

    loss: str = "del"
    alpha: float = DEFAULT_ALPHA
    vocab: Optional[DigitVocab] = None
    reduction: str = DEFAULT_REDUCTION
    ignore_index: int = -100
    digit_share: Optional[float] = None
    slot_logits: str = DEFAULT_SLOT_LOGITS
    names: InitVar[Names] = API_NAMES  # how errors name the settings (FLAG_NAMES for flags)

    def __post_init__(self, names: Names) -> None:
        checked = check_settings(
            self.loss, self.alpha, self.reduction, self.digit_share, self.slot_logits, names
        )
        for name, value in asdict(checked).items():
            object.__setattr__(self, name, value)
        self._check_vocab()

    def _check_vocab(self) -> None:
        if self.vocab is not None and not isinstance(self.vocab, DigitVocab):
            raise TypeError(f"vocab must be a DigitVocab, got {type(self.vocab).__name__}")
        if self.loss != "ce" and self.vocab is None:
            raise ValueError(
                f"loss={self.loss!r} needs vocab=DigitVocab(...) (or DigitVocab.from_tokenizer)"
            )

    @classmethod
    def of(
        cls, settings: Settings, vocab: Optional[DigitVocab], ignore_index: int = -100
    ) -> NumericalLossConfig:
        """The config of settings check_settings already checked (an entry that checks them
        before it reads the tokenizer: the flags, enable_numerical_loss, AutoModel's YAML) and
        the vocab read since; only the vocab is checked here."""
        if not isinstance(settings, Settings):
            raise TypeError(f"settings must be check_settings' Settings, got {type(settings)}")
        cfg = object.__new__(cls)
        for name, value in asdict(settings).items():
            object.__setattr__(cfg, name, value)
        object.__setattr__(cfg, "vocab", vocab)
        object.__setattr__(cfg, "ignore_index", ignore_index)
        cfg._check_vocab()
        return cfg

    @property
    def counts_digits(self) -> bool:
        """Whether the term's weight needs the scope's digit targets (the "digit" reduction of
        a loss with a term)."""
        return self.reduction == "digit" and self.loss != "ce"

    def term_weight(self, digit_scale: Any = None) -> Any:
        """The weight each digit target's term carries beside CE_t, the one rule every entry
        uses: token_weight, or for the "digit" reduction alpha x digit_scale, the scope's
        loss.digit_term_scale (its loss tokens / its digit targets: a float or a [] tensor on
        the device). ValueError when the digit reduction gets no scale."""
        if not self.counts_digits:
            return self.token_weight
        if digit_scale is None:
            raise ValueError("the 'digit' reduction weighs the term by the scope's digit count")
        return self.alpha * digit_scale

    @property
    def token_weight(self) -> float:
        """The weight each digit target's term carries in the per-token loss CE_t + w * term_t:
        alpha / digit_share for the token reduction, alpha for the digit reduction (before the
        step's scale: megatron/loss_func.py), 0 for loss "ce"."""
        if self.loss == "ce":
            return 0.0
        if self.reduction == "token":
            return self.alpha / self.digit_share
        return self.alpha

    def to_fields(self) -> Dict[str, Any]:
        """The model-config fields that carry this config (Bridge's providers, NeMo's and
        Megatron's TransformerConfig): `numerical_loss`, `del_alpha`, ... and the vocab's ids."""
        vocab = self.vocab
        fields = {field_of(s): getattr(self, s) for s in SCALAR_SETTINGS}
        digits, points, multi = VOCAB_FIELDS
        fields[digits] = list(vocab.digit_ids) if vocab else None
        fields[points] = list(vocab.decimal_point_ids) if vocab else None
        fields[multi] = list(vocab.multi_digit_ids) if vocab and vocab.chunked else None
        return fields

    def record_on(self, model_config: Any) -> None:
        """Write the fields onto a model config as plain attributes, not dataclass fields:
        Bridge's run_config.yaml, ModelConfig.as_dict and the HF export serialise fields only,
        and deepcopy keeps instance attributes. from_fields then returns this object."""
        fields = self.to_fields()
        for name, value in fields.items():
            object.__setattr__(model_config, name, value)
        object.__setattr__(model_config, _CACHED, (_values(model_config), self))

    @classmethod
    def from_fields(cls, model_config: Any) -> Optional[NumericalLossConfig]:
        """The config a model config's fields describe (None when it names no loss), built
        once per config and again only when a field changes."""
        values = _values(model_config)
        cached = getattr(model_config, _CACHED, None)
        if cached is not None and cached[0] == values:
            return cached[1]
        count = len(SCALAR_SETTINGS)
        settings = dict(zip(SCALAR_SETTINGS, values[:count], strict=True))
        if settings["loss"] is None:
            return None
        digits, points, multi = values[count:]
        if digits is None and settings["loss"] != "ce":
            raise ValueError(
                f"the model config names {field_of('loss')}={settings['loss']!r} without "
                f"{VOCAB_FIELDS[0]}: set the ten digit ids there, or register(cfg) with "
                "NumericalLossConfig(vocab=...)"
            )
        vocab = None if digits is None else DigitVocab(digits, points or (), multi or ())
        given = {name: value for name, value in settings.items() if value is not None}
        cfg = cls(vocab=vocab, **given)
        object.__setattr__(model_config, _CACHED, (values, cfg))
        return cfg


_FIELDS = tuple(field_of(s) for s in SCALAR_SETTINGS) + VOCAB_FIELDS  # from_fields' order


def _values(model_config: Any) -> tuple:
    return tuple(getattr(model_config, name, None) for name in _FIELDS)
