"""Plug del_megatron into Megatron-LM's pretrain_gpt.py without editing it.

`install(pretrain_gpt)` wraps the module's loss_func (telemetry, "digit" reduction) and its
get_batch (the "digit" reduction's step accounting); `wrap_model_provider` returns
a model-provider wrapper that, once Megatron has built the tokenizer, turns the parsed flags into
a NumericalLossConfig (stopping the run before training if the tokenizer has no single-digit
tokens), registers the loss hook and records the settings on the model config.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

from ..loss import NumericalLossConfig
from . import accounting
from .accounting import DigitAccounting
from .args import config_from_args, set_config_fields
from .hook import check_model_config, register
from .telemetry import make_loss_func

logger = logging.getLogger("del_megatron")


def step_accounting(cfg: NumericalLossConfig, args) -> DigitAccounting:
    """The "digit" reduction over Megatron-LM's whole step: its data iterators yield whole
    sequences on tensor-parallel rank 0 of each DP rank (CP slices them later), so counts are
    summed over the DP group, and the other tensor-parallel ranks receive them by broadcast."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return DigitAccounting(
        cfg.vocab,
        get_num_microbatches,
        group=ps.get_data_parallel_group(),
        per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
        ignore_index=cfg.ignore_index,
        ranks=ps.get_data_parallel_world_size(with_context_parallel=True),
        share_group=ps.get_tensor_model_parallel_group(),
        share_src=ps.get_tensor_model_parallel_src_rank(),
    )


_counted: dict = {}


def counted(data_iterator):
    """forward_step's data iterator, counted a step at a time when a "digit" reduction is
    active (the same wrapper for every micro-batch of one iterator); unchanged otherwise."""
    step = accounting.active()
    if step is None or data_iterator is None:
        return data_iterator
    key = id(data_iterator)
    if key not in _counted or _counted[key][0] is not data_iterator:
        _counted[key] = (data_iterator, step.wrap(data_iterator))
    return _counted[key][1]


def register_from_args(args, tokenizer) -> Optional[NumericalLossConfig]:
    """Build the config from parsed flags and the run's tokenizer and register the loss hook
    (None and nothing registered for --numerical-loss ce). With --del-reduction digit, also
    activate the step accounting that forward_step's `counted(data_iterator)` feeds."""
    if args.numerical_loss == "ce":
        return None
    cfg = config_from_args(args, tokenizer)
    register(cfg)
    if cfg.reduction == "digit" and accounting.active() is None:
        step_accounting(cfg, args).__enter__()
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
    """Wrap `pretrain_gpt.loss_func` in place (forward_step looks it up there) and
    `pretrain_gpt.get_batch` so that its data iterator is counted. Idempotent."""
    if not getattr(pretrain_gpt.loss_func, "_del_megatron", False):
        wrapped = make_loss_func(pretrain_gpt.loss_func)
        wrapped._del_megatron = True
        pretrain_gpt.loss_func = wrapped
    if hasattr(pretrain_gpt, "get_batch") and not getattr(
        pretrain_gpt.get_batch, "_del_megatron", False
    ):
        get_batch = pretrain_gpt.get_batch

        @functools.wraps(get_batch)
        def counted_get_batch(data_iterator, *args, **kwargs):
            return get_batch(counted(data_iterator), *args, **kwargs)

        counted_get_batch._del_megatron = True
        pretrain_gpt.get_batch = counted_get_batch
