"""Megatron-Bridge adapter (written against megatron-bridge 0.3.x, GPTModelProvider.provide(
pre_process, post_process, vp_stage) and gpt_step.forward_step(state, data_iterator, model,
return_schedule_plan) returning (output, partial(masked_next_token_loss, loss_mask, ...))).

    from megatron.bridge.models import GPTModelProvider
    from del_megatron.megatron.bridge import numerical_forward_step, with_numerical_loss

    Provider = with_numerical_loss(GPTModelProvider)   # or a model-family provider class
    provider = Provider(..., numerical_loss="del", del_alpha=0.01,
                        del_digit_token_ids=[...], del_decimal_point_token_ids=[...])
    pretrain(config, forward_step_func=numerical_forward_step)
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, List, Optional

import torch

from ..vocab import DigitVocab
from . import accounting
from .hook import (
    FIELD_ALPHA,
    FIELD_DIGITS,
    FIELD_LOSS,
    FIELD_POINTS,
    FIELD_REDUCTION,
    cfg_from_model_config,
    check_model_config,
    register,
)
from .lm import counted, step_accounting
from .telemetry import apply_to_loss

PROVIDER_FIELDS = [
    (FIELD_LOSS, str, dataclasses.field(default="ce")),
    (FIELD_ALPHA, float, dataclasses.field(default=0.01)),
    (FIELD_REDUCTION, str, dataclasses.field(default="token")),
    (FIELD_DIGITS, Optional[List[int]], dataclasses.field(default=None)),
    (FIELD_POINTS, Optional[List[int]], dataclasses.field(default=None)),
]


def with_numerical_loss(provider_cls: type) -> type:
    """Dataclass subclass of a GPTModelProvider class with the numerical-loss fields
    (numerical_loss, del_alpha, del_reduction, del_digit_token_ids, del_decimal_point_token_ids)
    whose provide() checks the CE fusion mode and registers the loss hook."""
    if not dataclasses.is_dataclass(provider_cls) or not hasattr(provider_cls, "provide"):
        raise TypeError(f"{provider_cls!r} is not a Megatron-Bridge model provider dataclass")

    def provide(self, *args, **kwargs):
        cfg = cfg_from_model_config(self)  # validates the fields
        if cfg is not None and cfg.loss != "ce":
            check_model_config(self)
            register()  # each model reads its own config (this provider) at loss time
            if cfg.reduction == "digit" and accounting.active() is None:
                step_accounting(cfg, self).__enter__()  # fed by numerical_forward_step
        return provider_cls.provide(self, *args, **kwargs)

    return dataclasses.make_dataclass(
        f"Numerical{provider_cls.__name__}",
        PROVIDER_FIELDS,
        bases=(provider_cls,),
        namespace={"provide": provide},
    )


def set_digit_ids_from_tokenizer(provider, tokenizer, allow_multi_digit_tokens=False) -> None:
    """Fill del_digit_token_ids / del_decimal_point_token_ids from the run's tokenizer."""
    vocab = DigitVocab.from_tokenizer(tokenizer, allow_multi_digit_tokens)
    setattr(provider, FIELD_DIGITS, list(vocab.digit_ids))
    setattr(provider, FIELD_POINTS, list(vocab.decimal_point_ids))


def wrap_loss_function(loss_function: partial) -> Callable:
    """Bridge's partial(masked_next_token_loss, loss_mask, ...) with the "digit" reduction and
    the DEL telemetry entries added to its report."""
    if not isinstance(loss_function, partial) or not loss_function.args:
        raise TypeError(
            "expected Megatron-Bridge's partial(masked_next_token_loss, loss_mask, ...); got "
            f"{loss_function!r}"
        )
    loss_mask = loss_function.args[0]

    def wrapped(output_tensor: torch.Tensor, *args, **kwargs):
        return apply_to_loss(
            loss_mask, output_tensor, lambda losses: loss_function(losses, *args, **kwargs)
        )

    return wrapped


def numerical_forward_step(
    state, data_iterator, model, return_schedule_plan: bool = False, base_forward_step=None
):
    """Megatron-Bridge forward_step with del_megatron's loss function wrapper (and, for the
    "digit" reduction, its data iterator counted a step at a time)."""
    if base_forward_step is None:
        from megatron.bridge.training.gpt_step import forward_step as base_forward_step
    data_iterator = counted(data_iterator)
    output, loss_function = base_forward_step(state, data_iterator, model, return_schedule_plan)
    return output, wrap_loss_function(loss_function)
