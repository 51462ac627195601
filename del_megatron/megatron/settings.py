"""The run's numerical-loss settings on a Megatron model config, and the one place they are read.

Megatron-LM copies flags onto TransformerConfig only by matching name, and Megatron-Bridge and
NeMo build the model from a config object, so the settings travel as config fields named like
the flags' dest (`del_alpha` for --del-alpha, ...). `of_model` is where the loss hook, the model
checks and the loss function read them: the registration's NumericalLossConfig when register()
was given one (Megatron-LM), else the model config's fields (Bridge, NeMo: register(None), so
that a model whose config names no loss, such as a distillation teacher, keeps Megatron's own).
"""

from __future__ import annotations

from typing import Any, Optional

from ..loss import NumericalLossConfig
from ..slots import DEFAULT_SLOT_LOGITS
from ..vocab import DigitVocab
from ..weights import DEFAULT_ALPHA
from . import state

FIELD_LOSS = "numerical_loss"
FIELD_ALPHA = "del_alpha"
FIELD_REDUCTION = "del_reduction"
FIELD_DIGITS = "del_digit_token_ids"
FIELD_POINTS = "del_decimal_point_token_ids"
FIELD_MULTI_DIGITS = "del_multi_digit_token_ids"
FIELD_SHARE = "del_digit_share"
FIELD_SLOT_LOGITS = "del_slot_logits"


def config_fields(cfg: NumericalLossConfig) -> dict:
    """The model-config fields that describe `cfg` (set them on TransformerConfig / providers)."""
    vocab = cfg.vocab
    return {
        FIELD_LOSS: cfg.loss,
        FIELD_ALPHA: cfg.alpha,
        FIELD_REDUCTION: cfg.reduction,
        FIELD_SHARE: cfg.digit_share,
        FIELD_SLOT_LOGITS: cfg.slot_logits,
        FIELD_DIGITS: list(vocab.digit_ids) if vocab else None,
        FIELD_POINTS: list(vocab.decimal_point_ids) if vocab else None,
        FIELD_MULTI_DIGITS: list(vocab.multi_digit_ids) if vocab and vocab.chunked else None,
    }


def record_on_model_config(config: Any, cfg: NumericalLossConfig) -> None:
    """Write `cfg` onto a model config as plain attributes, not dataclass fields: Bridge's
    run_config.yaml, ModelConfig.as_dict and the HF export serialise fields only, and deepcopy
    keeps instance attributes."""
    for name, value in config_fields(cfg).items():
        object.__setattr__(config, name, value)


def numerical_config(
    loss: str,
    alpha: float,
    vocab: Optional[DigitVocab],
    reduction: Optional[str],
    digit_share: Optional[float],
    slot_logits: Optional[str],
) -> NumericalLossConfig:
    """The NumericalLossConfig of settings read from flags, config fields or enable_numerical_loss
    arguments: reduction None is "digit", slot_logits None the default rule."""
    return NumericalLossConfig(
        loss=loss,
        alpha=alpha,
        vocab=vocab,
        reduction=reduction or "digit",
        digit_share=digit_share,
        slot_logits=slot_logits or DEFAULT_SLOT_LOGITS,
    )


def cfg_from_model_config(config: Any) -> Optional[NumericalLossConfig]:
    """NumericalLossConfig from fields on a Megatron model config; None if it names no loss."""
    loss = getattr(config, FIELD_LOSS, None)
    if loss is None:
        return None
    digits = getattr(config, FIELD_DIGITS, None)
    vocab = None
    if digits is not None:
        vocab = DigitVocab(
            digits,
            getattr(config, FIELD_POINTS, None) or (),
            getattr(config, FIELD_MULTI_DIGITS, None) or (),
        )
    return numerical_config(
        loss,
        getattr(config, FIELD_ALPHA, DEFAULT_ALPHA),
        vocab,
        getattr(config, FIELD_REDUCTION, None),
        getattr(config, FIELD_SHARE, None),
        getattr(config, FIELD_SLOT_LOGITS, None),
    )


def of_model(model: Any) -> Optional[NumericalLossConfig]:
    """The settings the loss of `model` (a LanguageModule, not a DDP / Float16Module wrapper)
    is computed with: the current registration's config, else the model config's fields; None
    when neither names a loss."""
    registration = state.current()
    if registration is not None and registration.cfg is not None:
        return registration.cfg
    return cfg_from_model_config(getattr(model, "config", None))


def settings_line(cfg: NumericalLossConfig) -> str:
    """The startup report: loss, weight and its unit, reduction, slot rule and ids."""
    share = "" if cfg.digit_share is None else f", digit share {cfg.digit_share:g}"
    vocab = cfg.vocab
    ids = "digit ids from each model's config"
    if vocab is not None:
        ids = f"digit ids {list(vocab.digit_ids)}, decimal points {list(vocab.decimal_point_ids)}"
        if vocab.chunked:
            ids += f", {len(vocab.multi_digit_ids)} multi-digit tokens, slot rule {cfg.slot_logits}"
    if cfg.loss == "ce":
        return (
            "del_megatron: ce, the control arm (cross-entropy, the digit entries reported) on "
            + ids
        )
    return (
        f"del_megatron: {cfg.loss} (alpha {cfg.alpha:g} on the mean term over digit targets, "
        f"{cfg.reduction} reduction{share}) on {ids}"
    )
