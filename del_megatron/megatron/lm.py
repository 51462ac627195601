"""Plug del_megatron into Megatron-LM's pretrain_gpt.py without editing it.

`install(pretrain_gpt)` wraps the module's loss_func (telemetry, "digit" reduction) and returns
a model-provider wrapper that, once Megatron has built the tokenizer, turns the parsed flags into
a NumericalLossConfig (stopping the run before training if the tokenizer has no single-digit
tokens), registers the loss hook and records the settings on the model config.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

from ..loss import NumericalLossConfig
from .args import config_from_args, set_config_fields
from .hook import check_model_config, register
from .telemetry import make_loss_func

logger = logging.getLogger("del_megatron")


def register_from_args(args, tokenizer) -> Optional[NumericalLossConfig]:
    """Build the config from parsed flags and the run's tokenizer and register the loss hook
    (None and nothing registered for --numerical-loss ce)."""
    if args.numerical_loss == "ce":
        return None
    cfg = config_from_args(args, tokenizer)
    register(cfg)
    logger.warning(
        "del_megatron: %s (alpha %s, %s reduction) on digits %s, decimal points %s",
        cfg.loss,
        cfg.alpha,
        cfg.reduction,
        list(cfg.vocab.digit_ids),
        list(cfg.vocab.decimal_point_ids),
    )
    return cfg


def wrap_model_provider(model_provider: Callable, get_args: Callable, get_tokenizer: Callable):
    """model_provider(*a, **kw) that first configures and registers the numerical loss (the
    tokenizer exists by then) and then checks the model config and records the settings on it."""

    @functools.wraps(model_provider)
    def provider(*args, **kwargs):
        cfg = register_from_args(get_args(), get_tokenizer())
        model = model_provider(*args, **kwargs)
        if cfg is not None:
            check_model_config(model.config)
            set_config_fields(model.config, cfg)
        return model

    return provider


def install(pretrain_gpt) -> None:
    """Wrap `pretrain_gpt.loss_func` in place (forward_step looks it up there). Idempotent."""
    if not getattr(pretrain_gpt.loss_func, "_del_megatron", False):
        wrapped = make_loss_func(pretrain_gpt.loss_func)
        wrapped._del_megatron = True
        pretrain_gpt.loss_func = wrapped
