"""Route Megatron-Core's LanguageModule.compute_language_model_loss through del_megatron's loss,
and turn it on: register() / unregister(), and enable(), the one path Megatron-LM,
Megatron-Bridge and NeMo take.

GPTModel, its MTP head and hybrid models all compute their loss with that method (same signature
from core 0.13 to main), so replacing it on the base class covers them, even in modules that
imported GPTModel before register() ran. The loss runs over the model's process groups
(groups.py) with what the forward in progress captured (capture.py): packed documents, hybrid
CP's split, which head is the main one. With logits_free (logits_free.py) the forward also gets
an output_processor that computes the same loss from the output layer's input, without the
logits. Each loss is recorded (registration.record) for the loss function, which sets the
step's weight on the term and reports it (loss_func.py).

Megatron-LM (lm.register_from_args) registers the run's NumericalLossConfig before any model
exists and checks each model's config once the model provider has built it. Bridge and NeMo
have the model config first: `enable(..., model_config=...)` checks it, records the settings on
it and registers the hook to read them from there.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..config import (
    API_NAMES,
    SCALAR_SETTINGS,
    NumericalLossConfig,
    check_loss_given,
    check_settings,
    unused_weight_settings,
)
from ..digits.vocab import DigitVocab
from ..kernels.linear import resolve_weight_gradient, weight_gradient_into
from ..layout import VocabParallelLayout
from ..loss import LossParts, loss_parts, numerical_linear_loss
from ..sequence import check_balancing
from . import capture, groups, loss_func, refusals, telemetry
from . import logits_free as lf
from . import registration as reg
from .digit_ids import resolve_vocab

_MARKER = "_del_megatron_original"  # on LanguageModule: the original loss method


def _recorded_loss(
    parts: LossParts,
    cfg: NumericalLossConfig,
    labels: torch.Tensor,
    module: Any,
    cp_group: Optional[dist.ProcessGroup],
) -> torch.Tensor:
    """[b, s] the model's loss (loss_func.model_loss), recorded with its parts for the loss
    function, which has the loss mask and the step's counts the "digit" reduction needs. The main
    head's record carries the entries of the forward's MTP heads (their losses never reach
    the loss function); cp_group: the context-parallel group the loss split its sequences over
    (None: whole on this rank)."""
    loss = loss_func.model_loss(parts, cfg)
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    mtp = capture.mtp_heads()
    if capture.is_main_head(labels):
        reg.record(loss, parts, cfg, cp_size, None if mtp is None else mtp.entries)
        loss_func.expect_reduction(loss, cfg)
    else:
        reg.record(loss, parts, cfg, cp_size)
        if mtp is not None:  # an MTP head of the forward in progress
            depth, mask = mtp.next_head(module, labels)
            mtp.entries.update(telemetry.mtp_entries(depth, mask, parts, cp_size))
    return loss


def _check_model_once(module: Any) -> None:
    registration = reg.current()
    if registration is not None and registration.one_line_refusals:
        refusals.one_line(refusals.check_model_once)(module)
    else:
        refusals.check_model_once(module)
    cfg = reg.of_model(module)
    if cfg is not None:  # which model the loss is on (GPTModel, HybridModel, MambaModel, ...)
        name = type(module).__qualname__
        reg.log_once(f"model {name}", "del_megatron: %s's loss is %s", name, cfg.loss)


def _compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[b, s] the token form CE_t + token_weight * term_t (loss_func.model_loss)."""
    cfg = reg.of_model(self)
    original = getattr(capture.language_module(), _MARKER)
    if cfg is None:
        return original(self, labels, logits)
    _check_model_once(self)
    capture.check_captured(self)
    layout = _layout(self, groups.logits_tp_group(self, logits))
    inplace = _logits_spent_by_the_loss(self, labels, logits)
    parts = loss_parts(labels, logits, cfg, layout, inplace=inplace)
    return _recorded_loss(parts, cfg, labels, self, layout.cp_group)


def _layout(module: Any, tp_group: Any, sequence_parallel: bool = False) -> VocabParallelLayout:
    """How the forward in progress splits the loss's tensors: `tp_group` over the vocabulary,
    the model's CP split and the forward's packed documents over the sequence."""
    cp_group, cp_balancing = groups.cp_split(module, capture.packed_seq_params())
    return VocabParallelLayout(
        tp_group=tp_group,
        cp_group=cp_group,
        cu_seqlens=capture.cu_seqlens(),
        cp_balancing=cp_balancing,
        sequence_parallel=sequence_parallel,
    )


def _logits_spent_by_the_loss(module, labels: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether the loss may write over `logits` (inplace: the gradient over fp32 logits, one
    [s, b, V/tp] fp32 buffer where a new gradient would be a second, as Megatron's own
    cross-entropy works on fp32 logits in place). So only when nothing reads them after the
    loss: fp32 logits of the model's main head (labels are those of the forward in progress;
    MTP heads' logits, with rolled labels, are read after their loss for acceptance counts), and
    no forward hook on the output layer or on every module (knowledge distillation and Megatron's
    logits saver capture the logits there)."""
    if logits.dtype != torch.float32 or not capture.is_main_head(labels):
        return False
    output_layer = getattr(module, "output_layer", None)
    if output_layer is None or output_layer._forward_hooks:
        return False
    if torch.nn.modules.module._global_forward_hooks:
        return False
    reg.log_once(
        "fp32_logits_in_place",
        "del_megatron: fp32 logits: the loss writes their gradient over them (in place), as "
        "Megatron's cross-entropy does",
    )
    return True


def _before_forward(
    module: Any, arguments: Dict[str, Any], kwargs: Dict[str, Any], takes_output_processor: bool
) -> Dict[str, Any]:
    """capture's hook on each wrapped forward: check the model the first time it runs, and hand
    a call with labels the logits-free output_processor when the run asks for it."""
    _check_model_once(module)
    if arguments.get("labels") is None or arguments.get("output_processor") is not None:
        return kwargs
    if reg.of_model(module) is None or lf.route_of(module) is None:
        return kwargs
    lf.check_model_supports(module, takes_output_processor)
    return {**kwargs, "output_processor": _logits_free_loss, "output_processor_context": module}


def _logits_free_loss(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: Optional[torch.Tensor],
    labels: torch.Tensor,
    context: Any,
    loss_mask: Optional[torch.Tensor] = None,
    **_: Any,
) -> torch.Tensor:
    """GPTModel output_processor: the [b, s] per-token loss of _compute_language_model_loss from
    hidden_states [s, b, h] ([s/tp, b, h] under sequence parallelism) and the output layer's
    weight shard, chunked over tokens; no [s, b, V/tp] logits. loss_mask [b, s] (what loss_func
    weighs each token's loss by) lets the gradients be formed in forward."""
    module = context
    cfg = reg.of_model(module)
    refusals.check_logit_dtype(lf.logit_dtype(module, output_layer), hidden_states.dtype)
    lf.run_forward_pre_hooks(output_layer, hidden_states)
    weight = lf.output_weight(output_layer, output_weight)
    tp_group = groups.model_tp_group(module)
    tp_group = tp_group if dist.get_world_size(tp_group) > 1 else None
    sequence_parallel = getattr(output_layer, "sequence_parallel", False) and tp_group is not None
    asked = lf.route_of(module)
    tokens, hidden_size = labels.numel(), hidden_states.size(-1)
    route = resolve_weight_gradient(asked, tokens, weight.size(0), hidden_size, hidden_states.dtype)
    reg.log_once(
        f"logits_free_{route}",
        "del_megatron: logits-free loss; the output layer's gradients take the '%s' route "
        "(asked: %s; %d tokens, h %d, %d vocab columns on this rank)",
        route,
        asked,
        tokens,
        hidden_size,
        weight.size(0),
    )
    layout = _layout(module, tp_group, sequence_parallel)
    with weight_gradient_into(lf.main_grad_sink(output_layer, weight)):
        parts = numerical_linear_loss(
            hidden_states,
            weight,
            labels,
            cfg,
            layout,
            return_parts=True,
            loss_mask=loss_mask,
            weight_gradient=route,
        )
    return _recorded_loss(parts, cfg, labels, module, layout.cp_group)


def register(
    cfg: Optional[NumericalLossConfig] = None,
    *,
    step_accounting: Optional[Callable[[Any], Any]] = None,
    logits_free: Union[bool, str] = False,
    cp_balancing: str = "document",
) -> None:
    """Route every LanguageModule's loss through del_megatron (Megatron's own methods are kept
    to restore: unregister()). Calling it again replaces the registration.

    Args:
        cfg: the loss of every model; None: each model's config fields say
            (NumericalLossConfig.from_fields), and a model whose config names no loss keeps
            Megatron's own.
        step_accounting: model -> DigitAccounting for a step-wide "digit" reduction, called on
            the first training step (accounting.counted), when the process groups exist.
        logits_free: True, or a weight-gradient route ("auto", "forward", "backward"): GPTModel
            computes the loss of calls with labels from the output layer's input, without the
            logits (megatron-core >= 0.18, refused otherwise). A model config's del_logits_free
            field asks for it too.
        cp_balancing: how the data pipeline cuts a packed (THD) batch over context-parallel
            ranks: "document" (Megatron's default) or "sequence" (Megatron-LM core 0.19's
            --dataloader-inter-document-masking without --sft).
    """
    check_balancing(cp_balancing)
    if cfg is not None and not isinstance(cfg, NumericalLossConfig):
        raise TypeError(f"cfg must be a NumericalLossConfig or None, got {type(cfg).__name__}")
    if lf.weight_gradient_of(logits_free) is not None:
        lf.check_core_supports()
    module = capture.language_module()
    if not hasattr(module, _MARKER):
        setattr(module, _MARKER, module.compute_language_model_loss)
        module.compute_language_model_loss = _compute_language_model_loss
    capture.wrap_forwards(_before_forward)
    registration = reg.Registration(
        cfg=cfg,
        make_accounting=step_accounting,
        logits_free=logits_free,
        cp_balancing=cp_balancing,
    )
    reg.begin(registration)
    if cfg is not None and (cfg.loss != "ce" or cfg.vocab is not None):
        reg.log_once("settings", reg.settings_line(cfg))
    if cfg is not None and cfg.loss != "ce" and cfg.alpha == 0:
        reg.log_once(
            "zero weight",
            "del_megatron: alpha is 0: the %s term is computed (it costs its time) and adds "
            "nothing to the loss; --numerical-loss ce trains the same loss, with the same digit "
            "entries, without computing the term",
            cfg.loss,
        )


def unregister() -> None:
    """Restore Megatron's own loss and forwards exactly and drop what register() kept.
    Idempotent."""
    module = capture.language_module()
    if hasattr(module, _MARKER):
        module.compute_language_model_loss = getattr(module, _MARKER)
        delattr(module, _MARKER)
    capture.unwrap_forwards()
    reg.end()


def is_registered() -> bool:
    """Whether LanguageModule's loss method is del_megatron's (between register and
    unregister)."""
    return hasattr(capture.language_module(), _MARKER)


def config_of_arguments(
    tokenizer: Any,
    vocab: Optional[DigitVocab],
    allow_multi_digit_tokens: bool,
    settings: Mapping[str, Any],
) -> NumericalLossConfig:
    """The NumericalLossConfig of Bridge's and NeMo's enable_numerical_loss: `settings` are its
    keyword arguments (loss, alpha, reduction, digit_share, slot_logits), checked once, before
    the tokenizer is read (loss=None beside others is the forgotten loss); the digit ids are
    `vocab` (held against `tokenizer` when there is one) or the tokenizer's
    (digit_ids.resolve_vocab). With loss "ce" the weight settings given are said unused."""
    unknown = sorted(set(settings) - set(SCALAR_SETTINGS))
    if unknown:
        raise TypeError(
            f"enable_numerical_loss got {', '.join(unknown)}: its settings are "
            f"{', '.join(SCALAR_SETTINGS)} (NumericalLossConfig's)"
        )
    if "loss" in settings:
        check_loss_given(settings["loss"], [API_NAMES(n) for n in settings if n != "loss"])
    checked = check_settings(**settings)
    vocab = resolve_vocab(
        tokenizer,
        vocab,
        API_NAMES,
        allow_multi_digit_tokens=allow_multi_digit_tokens,
        slot_rule=settings.get("slot_logits"),
    )
    cfg = NumericalLossConfig.of(checked, vocab)
    line = unused_weight_settings(cfg.loss, settings)
    if line:
        reg.log_once("unused weight settings", "%s", line)
    return cfg


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
) -> reg.Registration:
    """Register the loss hook for `cfg` and return the new registration.

    model_config: the model's config (Bridge, NeMo): checked, then `framework_checks()` (the
    framework's own refusals), then the settings and the logits-free choice are recorded on it
    and the hook reads them from there (register(None)). Without it (Megatron-LM) the hook
    computes every model's loss with `cfg` and logits_free. step_accounting: model ->
    DigitAccounting for a step-wide "digit" reduction (accounting.for_model). loss_func_required:
    the run's loss function must be ours (it applies the "digit" reduction:
    loss_func.expect_reduction). share_watch: the token reduction's check of the given digit
    share (accounting.ShareWatch)."""
    if model_config is not None:
        refusals.check_model_config(model_config, lf.weight_gradient_of(logits_free))
        if framework_checks is not None:
            framework_checks()
        cfg.record_on(model_config)
        lf.set_on_model_config(model_config, logits_free)
        register(None, step_accounting=step_accounting, cp_balancing=cp_balancing)
    else:
        if framework_checks is not None:
            framework_checks()
        register(
            cfg, step_accounting=step_accounting, logits_free=logits_free, cp_balancing=cp_balancing
        )
    registration = reg.current()
    registration.loss_func_required = loss_func_required
    registration.share_watch = share_watch
    return registration
