"""Turning the numerical loss on: the one path Megatron-LM, Megatron-Bridge and NeMo take.

Megatron-LM (lm.register_from_args) registers the run's NumericalLossConfig before any model
exists and records it on each model's config once the model provider has built it
(`check_and_record`). Bridge and NeMo have the model config first: `enable(...,
model_config=...)` checks it, records the settings on it and registers the hook to read them
from there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from ..loss import NumericalLossConfig
from ..vocab import DigitVocab
from ..weights import DEFAULT_ALPHA
from . import logits_free as lf
from . import model_checks, settings, state
from .given_ids import api_vocab
from .hook import register


def config_of_arguments(
    loss: str,
    alpha: float,
    reduction: str,
    digit_share: Optional[float],
    slot_logits: Optional[str],
    vocab: Optional[DigitVocab],
    tokenizer: Any,
    allow_multi_digit_tokens: bool,
) -> NumericalLossConfig:
    """The NumericalLossConfig of Bridge's and NeMo's enable_numerical_loss arguments: the digit
    ids given (held against the tokenizer when there is one), else the tokenizer's
    (given_ids.api_vocab)."""
    vocab = api_vocab(vocab, tokenizer, allow_multi_digit_tokens, slot_logits)
    if loss == "ce":
        unused = [
            name
            for name, value, default in (
                ("alpha", alpha, DEFAULT_ALPHA),
                ("reduction", reduction, "digit"),
                ("digit_share", digit_share, None),
            )
            if value != default
        ]
        if unused:
            state.log_once(
                "unused weight arguments",
                "del_megatron: %s unused: loss='ce' trains cross-entropy (the control arm) and "
                "reports the digit entries beside it",
                ", ".join(unused),
            )
    return settings.numerical_config(loss, alpha, vocab, reduction, digit_share, slot_logits)


def check_and_record(
    model_config: Any,
    cfg: NumericalLossConfig,
    route: Optional[str],
    framework_checks: Optional[Callable[[], None]] = None,
) -> None:
    """Check a model config for the run (model_checks.check_model_config; route: the
    logits-free weight-gradient route, None when the loss keeps its logits), then the
    framework's own refusals (`framework_checks()`), and only then record `cfg` on it
    (settings.record_on_model_config)."""
    model_checks.check_model_config(model_config, route)
    if framework_checks is not None:
        framework_checks()
    settings.record_on_model_config(model_config, cfg)


def enable(
    cfg: NumericalLossConfig,
    *,
    model_config: Any = None,
    logits_free: Union[bool, str] = False,
    framework_checks: Optional[Callable[[], None]] = None,
    step_accounting: Optional[Callable[[Any], Any]] = None,
    cp_balancing: str = "document",
    loss_func_required: bool = False,
    share_watch: Any = None,
) -> state.Registration:
    """Register the loss hook for `cfg` and return the new registration.

    model_config: the model's config (Bridge, NeMo): checked, then `framework_checks()` (the
    framework's own refusals), then the settings and the logits-free choice are recorded on it
    and the hook reads them from there (register(None)). Without it (Megatron-LM) the hook
    computes every model's loss with `cfg` and logits_free. step_accounting: model ->
    DigitAccounting for a step-wide "digit" reduction (accounting.for_model). loss_func_required:
    the run's loss function must be ours (it applies the "digit" reduction:
    reduction.expect_reduction). share_watch: the token reduction's check of the given digit
    share (share_watch.py)."""
    if model_config is not None:
        check_and_record(model_config, cfg, lf.weight_gradient_of(logits_free), framework_checks)
        lf.set_on_model_config(model_config, logits_free)
        register(None, step_accounting=step_accounting, cp_balancing=cp_balancing)
    else:
        if framework_checks is not None:
            framework_checks()
        register(
            cfg, step_accounting=step_accounting, logits_free=logits_free, cp_balancing=cp_balancing
        )
    registration = state.current()
    registration.loss_func_required = loss_func_required
    registration.share_watch = share_watch
    return registration
