"""Megatron-Bridge adapter (tested with megatron-bridge 0.6.2 and megatron-core 0.19.2).

Recipes build the model provider as an instance (`AutoBridge.from_hf_pretrained(...)
.to_megatron_provider()`, or a recipe's `ConfigContainer.model`). One call turns the numerical
loss on for it, with the digit ids read from the recipe's tokenizer, and Bridge's own
`pretrain()` runs with this module's forward step:

    from megatron.bridge.recipes.qwen.qwen2 import qwen25_500m_pretrain_config
    from megatron.bridge.training.gpt_step import forward_step   # not this one
    from megatron.bridge.training.pretrain import pretrain
    from del_megatron.megatron.bridge import enable_numerical_loss, numerical_forward_step

    cfg = qwen25_500m_pretrain_config()
    enable_numerical_loss(cfg, loss="del", alpha=0.1)
    pretrain(cfg, forward_step_func=numerical_forward_step)

The settings live on the model config object that Megatron-Core's GPTModel reads (the provider
itself, or `ModelConfig.transformer` on Bridge's ModelConfig path) as plain attributes, not as
dataclass fields. Bridge serialises providers field by field, so `run_config.yaml` keeps the
provider's own importable, allow-listed `_target_` (e.g. `megatron.bridge.models.qwen...`) and
no DEL setting: `load_model_config`, `load_megatron_model` and AutoBridge's HF export treat a
DEL checkpoint exactly as a cross-entropy one.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional, Union

import torch.distributed as dist

from ..config import NumericalLossConfig, field_of
from ..digits.vocab import DigitVocab
from . import accounting
from . import registration as reg
from .accounting import DigitAccounting, counted
from .groups import process_groups, unwrapped_model
from .hook import config_of_arguments, enable
from .logits_free import weight_gradient_of
from .loss_func import WRAPPED, apply_to_loss
from .refusals import check_hybrid_context_parallel, check_logits_free

__all__ = [
    "enable_numerical_loss",
    "make_forward_step",
    "model_config_of",
    "numerical_forward_step",
    "step_accounting",
    "wrap_loss_function",
]


def model_config_of(target: Any) -> Any:
    """The config object Megatron-Core's model will hold as `model.config` for `target`: a
    Bridge model provider (GPTModelProvider or a family provider) is its own config; Bridge's
    ModelConfig path (GPTModelConfig) builds `GPTModel(config=target.transformer)`; a
    ConfigContainer's model is `target.model`."""
    if hasattr(target, "model") and hasattr(target, "tokenizer") and hasattr(target, "train"):
        target = target.model  # a ConfigContainer
    if hasattr(target, "provide"):
        return target
    try:
        transformer = object.__getattribute__(target, "transformer")
    except AttributeError:
        transformer = None
    if transformer is not None and hasattr(target, "get_builder_cls"):
        return transformer
    raise TypeError(
        f"{type(target).__name__} is neither a Megatron-Bridge model provider (provide()), a "
        "Bridge ModelConfig (with .transformer) nor a ConfigContainer holding one"
    )


def _recipe_tokenizer(target: Any) -> Any:
    """The tokenizer a ConfigContainer's TokenizerConfig builds (None for other targets)."""
    config = getattr(target, "tokenizer", None)
    if config is None or not hasattr(target, "train"):
        return None
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    return build_tokenizer(config)


def _null_tokenizer(target: Any) -> bool:
    config = getattr(target, "tokenizer", None)
    return getattr(config, "tokenizer_type", None) == "NullTokenizer"


def _vocab_size(config: Any) -> Optional[int]:
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) else None


def enable_numerical_loss(
    target: Any,
    tokenizer: Any = None,
    *,
    vocab: Optional[DigitVocab] = None,
    allow_multi_digit_tokens: bool = False,
    logits_free: Union[bool, str] = False,
    **settings: Any,
) -> NumericalLossConfig:
    """Turn the numerical loss on for a Bridge model provider, a Bridge ModelConfig or a
    recipe's ConfigContainer (`target`), and register the loss hook; returns the
    NumericalLossConfig.

    settings: NumericalLossConfig's keyword arguments (loss, alpha, reduction, digit_share,
    slot_logits), with its defaults. tokenizer: the run's (Bridge/Megatron, Hugging
    Face, SentencePiece, tiktoken, or a tokenizer file; default: the ConfigContainer's own); the
    digit ids are read from it, or `vocab` is held against it. A chunking tokenizer (Llama-3)
    gets the term on its single-digit tokens, or with slot_logits on every digit of its
    multi-digit tokens; allow_multi_digit_tokens accepts a tokenizer that merges digits another
    way. logits_free: True, or a weight-gradient route ("auto", "forward", "backward"): the same
    loss from the output layer's input, without the [s, b, V/tp] logits (megatron-core >= 0.18).
    Settings del_megatron cannot train with are refused here, before training (refusals.py,
    docs/support.md). With the "digit" reduction, pass `numerical_forward_step` to pretrain():
    it counts each step's digit targets over its micro-batches and data-parallel ranks.
    """
    config = model_config_of(target)
    if tokenizer is None and (vocab is None or not _null_tokenizer(target)):
        tokenizer = _recipe_tokenizer(target)  # also to hold a vocab given against
    if vocab is None and tokenizer is None:
        raise ValueError(
            "enable_numerical_loss needs the digit ids: pass the run's tokenizer, "
            "vocab=DigitVocab(...), or the recipe's ConfigContainer (its tokenizer is used)"
        )
    cfg = config_of_arguments(tokenizer, vocab, allow_multi_digit_tokens, settings)
    vocab = cfg.vocab
    size = _vocab_size(config)
    if size is not None:
        vocab.check_vocab_size(size)
    route = weight_gradient_of(logits_free)

    def framework_checks() -> None:
        # the reduction is recorded on the config only after these; its refusals need it now
        check_hybrid_context_parallel(
            SimpleNamespace(
                hybrid_context_parallel=getattr(config, "hybrid_context_parallel", False),
                numerical_loss=cfg.loss,
                del_reduction=cfg.reduction,
            )
        )
        if route is not None:  # a ConfigContainer's DDP and distributed settings (FSDP's)
            for group in (getattr(target, "ddp", None), getattr(target, "dist", None)):
                if group is not None:
                    check_logits_free(group, route)

    digit_steps = cfg.reduction == "digit"
    enable(
        cfg,
        model_config=config,
        logits_free=logits_free,
        framework_checks=framework_checks,
        step_accounting=functools.partial(step_accounting, cfg) if digit_steps else None,
        # its loss function applies the digit reduction: numerical_forward_step's, not Bridge's
        loss_func_required=digit_steps,
    )
    return cfg


def step_accounting(
    cfg: NumericalLossConfig, model: Any, num_microbatches: Any = None
) -> DigitAccounting:
    """The "digit" reduction over a Bridge step. Every Bridge rank reads its own batches from
    its data iterator (gpt_step.get_batch, whole sequences; CP slices them after), so nothing
    is broadcast (accounting.for_model). Groups come from the model's pg_collection (Bridge
    builds decentralized process groups), else parallel_state."""
    if num_microbatches is None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        num_microbatches = get_num_microbatches
    config = getattr(unwrapped_model(model), "config", None)
    return accounting.for_model(
        cfg,
        model,
        num_microbatches,
        per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
    )


def wrap_loss_function(loss_function: Callable, model: Any = None) -> Callable:
    """Bridge's loss function, `partial(masked_next_token_loss, loss_mask, ...)` called with
    the model's output, with the "digit" reduction applied and the DEL telemetry entries
    (`ce loss`, `<loss> term`, `digit acc`, `digit entropy`, `digit tokens`, `digit share`)
    added to its report, which Bridge sums over micro-batches and data-parallel ranks and logs
    like `lm loss`.
    `model` (the forward step's) says whether the run asks for a numerical loss, so that a loss
    the hook did not compute stops the run (loss_func.check_recorded). A loss function this
    returned comes back as it is (a forward step of ours inside another: the second wrapper
    would not find the loss the first one reduced)."""
    if getattr(loss_function, WRAPPED, False):
        return loss_function
    if not isinstance(loss_function, functools.partial) or not loss_function.args:
        raise TypeError(
            "expected Megatron-Bridge's partial(masked_next_token_loss, loss_mask, ...); got "
            f"{loss_function!r}"
        )
    loss_mask = loss_function.args[0]

    @functools.wraps(loss_function.func)
    def wrapped(output_tensor: Any, *args, **kwargs):
        if isinstance(output_tensor, tuple):  # (losses, loss_mask) from multimodal models
            return loss_function(output_tensor, *args, **kwargs)
        return apply_to_loss(
            loss_mask,
            output_tensor,
            lambda losses: loss_function(losses, *args, **kwargs),
            model,
        )

    setattr(wrapped, WRAPPED, True)
    return wrapped


def _check_enabled(model: Any) -> None:
    """Refuse a model the numerical loss would silently skip: numerical_forward_step was asked
    for, but neither register(cfg) nor the model's own config names a loss (typically DEL
    fields set on a Bridge ModelConfig, which GPTModel never sees, or a provider copied with
    dataclasses.replace, which drops the settings)."""
    registration = reg.current()
    if registration is None or reg.of_model(unwrapped_model(model)) is None:
        missing = f"no {field_of('loss')} on model.config"
        where = "not registered" if registration is None else missing
        raise RuntimeError(
            f"numerical_forward_step: the numerical loss is off for this model ({where}); turn "
            "it on with del_megatron.megatron.bridge.enable_numerical_loss(provider_or_config, "
            "tokenizer, ...) before pretrain() (on Bridge's ModelConfig path it must reach "
            "ModelConfig.transformer, which is what GPTModel reads)"
        )


def _eval_microbatches(state: Any, model: Any) -> int:
    """Micro-batches a Bridge evaluation step runs (training/eval.py): the validation config's
    eval global batch over its eval micro-batch x the model's DP size (Bridge's config fills
    them in from the training ones when unset)."""
    validation = state.cfg.validation
    dp = dist.get_world_size(process_groups(model)[0])
    return validation.eval_global_batch_size // (validation.eval_micro_batch_size * dp)


def make_forward_step(base_forward_step: Callable) -> Callable:
    """A Bridge forward step `(state, data_iterator, model, return_schedule_plan=False)` that
    runs `base_forward_step` (same signature, returning (output, partial(loss_fn, loss_mask,
    ...))) with the data iterator counted for the step-wide "digit" reduction and the loss
    function wrapped for the reduction and telemetry. Stacked (over a forward step of ours, or
    one that calls ours), each step is counted once (counted) and the loss function wrapped once
    (wrap_loss_function)."""

    def forward_step(
        state: Any,
        data_iterator: Optional[Iterator],
        model: Any,
        return_schedule_plan: bool = False,
    ):
        _check_enabled(model)
        data_iterator = counted(
            data_iterator, model, functools.partial(_eval_microbatches, state, model)
        )
        output, loss_function = base_forward_step(state, data_iterator, model, return_schedule_plan)
        return output, wrap_loss_function(loss_function, model)

    forward_step.__doc__ = f"{getattr(base_forward_step, '__name__', 'forward_step')} + DEL"
    return forward_step


def numerical_forward_step(
    state: Any, data_iterator: Optional[Iterator], model: Any, return_schedule_plan: bool = False
):
    """megatron.bridge.training.gpt_step.forward_step with the numerical loss's step-wide
    "digit" reduction and telemetry; pass it to Bridge's pretrain() as forward_step_func."""
    from megatron.bridge.training.gpt_step import forward_step

    return make_forward_step(forward_step)(state, data_iterator, model, return_schedule_plan)
