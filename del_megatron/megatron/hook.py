"""Route Megatron-Core's LanguageModule.compute_language_model_loss through numerical_lm_loss.

GPTModel, its MTP head and hybrid models all compute their loss with that method (same signature
from core 0.13 to main), so replacing it on the base class covers them, even in modules that
imported GPTModel before register() ran. The hook passes Megatron's context-parallel group, and
the forward of every LanguageModule class that takes packed_seq_params (GPTModel, MambaModel,
HybridModel, ...) is wrapped so that the hook sees the THD cu_seqlens of the call in progress.
With logits_free (logits_free.py), that wrapper also hands GPTModel.forward an output_processor
that computes the same loss from the output layer's input, without the logits. MTP heads compute
their losses through the same method, before the main head's: each reports its digit accuracy and
entropy (`mtp_1 digit acc`, ...) under the loss mask Megatron rolls for it, beside the main head's.
register() sets up everything the glue keeps (state.Registration); unregister() undoes it.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..kernels.linear import resolve_weight_gradient, weight_gradient_into
from ..loss import LossParts, NumericalLossConfig, loss_parts, numerical_linear_loss
from ..sequence import check_balancing
from ..slots import DEFAULT_SLOT_LOGITS
from ..vocab import DigitVocab
from . import logits_free as lf
from . import resume, state, support, telemetry
from .state import Registration

_MARKER = "_del_megatron_original"  # on LanguageModule: the original loss method
_FORWARD_MARKER = "_del_megatron_forward"  # on a model class: its original forward
# Model modules imported at register() so that their forwards get wrapped (best effort: some
# need optional packages).
MODEL_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.mamba.mamba_model",
    "megatron.core.models.hybrid.hybrid_model",
)

# Names of the TransformerConfig (or GPTModelProvider) fields that carry the settings when
# register() is given no config; the same names as the Megatron-LM flags' dest.
FIELD_LOSS = "numerical_loss"
FIELD_ALPHA = "del_alpha"
FIELD_REDUCTION = "del_reduction"
FIELD_DIGITS = "del_digit_token_ids"
FIELD_POINTS = "del_decimal_point_token_ids"
FIELD_MULTI_DIGITS = "del_multi_digit_token_ids"
FIELD_SHARE = "del_digit_share"
FIELD_SLOT_LOGITS = "del_slot_logits"


def _language_module():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return LanguageModule


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


def cfg_from_model_config(config) -> Optional[NumericalLossConfig]:
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
    return NumericalLossConfig(
        loss=loss,
        alpha=getattr(config, FIELD_ALPHA, 0.01),
        vocab=vocab,
        reduction=getattr(config, FIELD_REDUCTION, None) or "digit",
        digit_share=getattr(config, FIELD_SHARE, None),
        slot_logits=getattr(config, FIELD_SLOT_LOGITS, None) or DEFAULT_SLOT_LOGITS,
    )


# What replaces each fused cross-entropy implementation, as the log says it once.
FUSION_NAMES = {
    "native": "Megatron's fused cross-entropy (impl 'native')",
    "te": "Transformer Engine's fused cross-entropy (impl 'te')",
}
FUSION_REPLACED_BY = {
    "native": (
        "Megatron's fused cross-entropy (impl 'native') is replaced by del_megatron's "
        "vocab-parallel CE+digit kernel, which computes the loss in fp32 from the same logits"
    ),
    "te": (
        "Transformer Engine's fused cross-entropy (impl 'te') is replaced by del_megatron's "
        "vocab-parallel CE+digit kernel ('compiled' on CUDA, 'recompute' elsewhere). TE's "
        "kernel writes the gradient over the logits in place; del_megatron's keeps the logits "
        "for backward and writes their gradient into a new buffer, so the loss holds one more "
        "[s, b, V/tp] buffer than TE's (2 bytes a logit in bf16: 4 against TE's 2). "
        "--del-logits-free forms no logits at all"
    ),
}
LOGITS_FREE_REPLACES = (
    "%s is replaced by del_megatron's logits-free loss (--del-logits-free, weight-gradient "
    "route '%s'): the output layer's matmul and the CE+digit passes chunked over tokens, with "
    "no [s, b, V/tp] logits or gradient held (less than the fused kernel's logits buffer)"
)


def fusion_replacement(impl: str, logits_free: Optional[str] = None) -> str:
    """The log line saying what replaces fused cross-entropy `impl`, and at what memory
    (logits_free: the weight-gradient route, None when the loss keeps its logits)."""
    if logits_free is not None:
        return LOGITS_FREE_REPLACES % (FUSION_NAMES[impl], logits_free)
    return FUSION_REPLACED_BY[impl]


def check_model_config(config, logits_free: Optional[str] = None) -> None:
    """Refuse a model config del_megatron cannot train right (support.check_settings; logits_free:
    the weight-gradient route, None when the loss keeps its logits), and log once which fused
    cross-entropy it replaces."""
    support.check_settings(config, logits_free)
    if getattr(config, "cross_entropy_loss_fusion", False):
        impl = getattr(config, "cross_entropy_fusion_impl", "native")
        state.log_once("fusion", "del_megatron: %s", fusion_replacement(impl, logits_free))


def _check_model_once(module) -> None:
    """check_model_config for a model the loss hook sees for the first time in this
    registration (its config and logits-free setting; then nothing for it again), and for
    logits-free its output layer: no bias, no MuP logit multiplier, no FSDP- or GTP-sharded
    weight."""
    registration = state.current()
    if registration is None or id(module) in registration.checked_models:
        return
    registration.checked_models[id(module)] = module
    if _resolve_cfg(module) is None:
        return
    route = _weight_gradient(module, registration)
    check_model_config(module.config, route)
    output_layer = getattr(module, "output_layer", None)
    if route is not None and output_layer is not None:
        lf.check_no_logit_scaling(module.config)
        lf.check_no_bias(output_layer)
        if getattr(module, "share_embeddings_and_output_weights", False):
            support.check_sharded_weight(module.shared_embedding_or_output_weight())
        elif getattr(output_layer, "weight", None) is not None:
            support.check_sharded_weight(output_layer.weight)


def _model_tp_group(module):
    """The model's tensor-parallel group (its own, its pg_collection's, else parallel_state's)."""
    from megatron.core import parallel_state

    pg_collection = getattr(module, "pg_collection", None)
    group = getattr(module, "tp_group", None) or getattr(pg_collection, "tp", None)
    return group or parallel_state.get_tensor_model_parallel_group()


def _tp_group(module, logits: torch.Tensor):
    """The TP group the logits are sharded over, or None when they hold the whole vocab
    (parallel_output=False, or runtime_gather_output: the output layer gathered them)."""
    group = _model_tp_group(module)
    world = dist.get_world_size(group)
    if world == 1:
        return None
    columns = logits.size(-1)
    vocab_size = getattr(module, "vocab_size", None)
    if vocab_size is None:
        return group if getattr(module, "parallel_output", True) else None
    if columns * world == vocab_size:
        return group
    if columns == vocab_size:
        return None
    raise ValueError(
        f"logits have {columns} vocab columns, neither the model's vocab of {vocab_size} nor "
        f"its 1/{world} tensor-parallel shard: they are not what the output layer gives"
    )


def _cp_group(module):
    """Megatron's context-parallel group when the sequence is split over more than one rank."""
    from megatron.core import parallel_state

    group = getattr(module, "cp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def _cp_layout(module) -> Tuple[Any, str]:
    """(context-parallel group or None, cp_balancing) of the call in progress. Hybrid context
    parallelism (core 0.19: PackedSeqParams.local_cp_size set) cuts each micro-batch's whole
    packed sequence in 2 * local_cp_size chunks over that micro-batch's own group
    (PackedSeqParams.cp_group; none when local_cp_size is 1); otherwise the model's CP group,
    balanced as the registration says (register's cp_balancing)."""
    params = _packed_seq_params.get()
    local_cp_size = getattr(params, "local_cp_size", None)
    if local_cp_size is None:
        registration = state.current()
        balancing = registration.cp_balancing if registration is not None else "document"
        return _cp_group(module), balancing
    group = getattr(params, "cp_group", None) if local_cp_size > 1 else None
    if local_cp_size > 1 and (group is None or dist.get_world_size(group) != local_cp_size):
        raise ValueError(
            f"PackedSeqParams.local_cp_size is {local_cp_size} but its cp_group is "
            f"{'missing' if group is None else f'of {dist.get_world_size(group)} ranks'}: "
            "hybrid context parallelism hands each micro-batch's CP group with it"
        )
    return group, "sequence"


# The PackedSeqParams of the LanguageModule.forward in progress (set by _capture_packed_seq_params).
_NOT_CAPTURED = object()  # no wrapped forward is in progress
_packed_seq_params: contextvars.ContextVar = contextvars.ContextVar(
    "del_megatron_packed_seq_params", default=_NOT_CAPTURED
)


# The labels of the LanguageModule.forward in progress (set by _capture_packed_seq_params): the
# main head computes its loss with them, MTP heads with rolled copies.
_forward_labels: contextvars.ContextVar = contextvars.ContextVar(
    "del_megatron_forward_labels", default=None
)


class _MtpHeads:
    """The MTP heads of the LanguageModule.forward in progress: the loss mask as Megatron rolls
    it for the last head seen, and the heads' report entries (telemetry.mtp_entries), which the
    main head's record carries to the loss function."""

    def __init__(self, loss_mask: Optional[torch.Tensor]) -> None:
        self.mask, self.depth = loss_mask, 0
        self.entries: dict = {}

    def report(self, module: Any, labels: torch.Tensor, parts: LossParts) -> None:
        """Add the entries of the next MTP head, whose loss over `labels` (rolled once more
        than the last head's) gave `parts`. Megatron rolls the forward's loss mask (all ones
        when it has none) in lockstep with the labels, with its own roll_tensor over the
        model's CP group and the forward's packed sequences: so is it rolled here, on the
        device (under CP one more exchange of a column between neighbours)."""
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        mask = self.mask if self.mask is not None else torch.ones_like(labels, dtype=torch.float)
        params = _packed_seq_params.get()
        self.mask, _ = roll_tensor(
            mask,
            shifts=-1,
            dims=-1,
            cp_group=getattr(module, "cp_group", None),
            packed_seq_params=None if params is _NOT_CAPTURED else params,
        )
        self.depth += 1
        self.entries.update(telemetry.mtp_entries(self.depth, self.mask, parts))


# The MTP heads of the LanguageModule.forward in progress (a call with labels), else None.
_forward_mtp: contextvars.ContextVar = contextvars.ContextVar(
    "del_megatron_forward_mtp", default=None
)


def _cu_seqlens() -> Optional[torch.Tensor]:
    """Document offsets of a packed (THD) batch in the whole sequence, else None."""
    params = _packed_seq_params.get()
    if params is None or params is _NOT_CAPTURED or getattr(params, "qkv_format", None) != "thd":
        return None
    padded = getattr(params, "cu_seqlens_q_padded", None)
    return padded if padded is not None else params.cu_seqlens_q


@functools.cache
def _takes_packed_seq_params(forward: Callable) -> bool:
    return "packed_seq_params" in inspect.signature(forward).parameters


def _capture_packed_seq_params(forward: Callable) -> Callable:
    """A LanguageModule forward that makes its packed_seq_params (keyword or positional)
    visible to the loss hook for the duration of the call, and that hands a logits-free
    output_processor to a call with labels when the run asks for it."""
    signature = inspect.signature(forward)
    takes_output_processor = "output_processor" in signature.parameters

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        try:
            arguments = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # let forward itself report the bad call
            arguments = {}
        params = arguments.get("packed_seq_params")
        if args:
            _check_model_once(args[0])
        if arguments.get("labels") is not None and arguments.get("output_processor") is None:
            if args and _wants_logits_free(args[0]):
                lf.check_model_supports(args[0], takes_output_processor)
                kwargs = {**kwargs, "output_processor": _logits_free_loss}
                kwargs["output_processor_context"] = args[0]
        labels = arguments.get("labels")
        token = _packed_seq_params.set(params)
        labels_token = _forward_labels.set(labels)
        mtp = None if labels is None else _MtpHeads(arguments.get("loss_mask"))
        mtp_token = _forward_mtp.set(mtp)
        try:
            return forward(*args, **kwargs)
        finally:
            _forward_mtp.reset(mtp_token)
            _forward_labels.reset(labels_token)
            _packed_seq_params.reset(token)

    return wrapped


def _forward_owner(cls: type) -> Optional[type]:
    """The class in cls's MRO that defines the forward its instances run."""
    return next((c for c in cls.__mro__ if "forward" in vars(c)), None)


def _language_model_classes() -> list:
    """LanguageModule and its subclasses defined so far (known model modules imported first)."""
    for name in MODEL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # e.g. the hybrid/Mamba models without mamba_ssm
            pass
    found, todo = [], [_language_module()]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def _wrap_forwards() -> None:
    for cls in _language_model_classes():
        forward = vars(cls).get("forward")
        if forward is None or _FORWARD_MARKER in vars(cls):
            continue
        if _takes_packed_seq_params(forward):
            setattr(cls, _FORWARD_MARKER, forward)
            cls.forward = _capture_packed_seq_params(forward)


def _unwrap_forwards() -> None:
    for cls in _language_model_classes():
        if _FORWARD_MARKER in vars(cls):
            cls.forward = vars(cls)[_FORWARD_MARKER]
            delattr(cls, _FORWARD_MARKER)


def _check_packed_capture(module) -> None:
    """Refuse to compute the loss of a model whose forward takes packed_seq_params when no
    wrapped forward is in progress (its class was defined after register()): its packed
    documents would silently run into each other."""
    if _packed_seq_params.get() is not _NOT_CAPTURED:
        return
    owner = _forward_owner(type(module))
    if owner is not None and _takes_packed_seq_params(vars(owner)["forward"]):
        raise RuntimeError(
            f"{owner.__qualname__}.forward takes packed_seq_params but was defined after "
            "del_megatron.megatron.register() ran, so packed (THD) document boundaries would not "
            "reach the numerical loss; call register() after importing the model class"
        )


def _resolve_cfg(module) -> Optional[NumericalLossConfig]:
    registration = state.current()
    cfg = registration.cfg if registration is not None else None
    if cfg is None:
        cfg = cfg_from_model_config(module.config)
    return cfg


def _check_digit_ids(cfg: NumericalLossConfig) -> None:
    if cfg.vocab is None and cfg.loss != "ce":
        raise ValueError(
            f"numerical loss {cfg.loss!r} has no digit ids: set {FIELD_DIGITS} on the model "
            "config, or pass cfg=NumericalLossConfig(vocab=...) to register()"
        )


def _token_loss(
    parts: LossParts,
    cfg: NumericalLossConfig,
    labels: torch.Tensor,
    module: Any,
    cp_group: Optional[dist.ProcessGroup],
) -> torch.Tensor:
    """[b, s] CE + token_weight * term, recorded for the loss function. The "digit" reduction
    is applied by the loss_func wrapper, which has the loss mask and the step's counts: the
    model returns the per-token form. The main head's record carries the entries of the
    forward's MTP heads (their losses never reach loss_func); cp_group: the context-parallel
    group the loss split its sequences over (None: whole on this rank)."""
    loss = parts.token_loss(cfg.token_weight)
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    mtp = _forward_mtp.get()
    if labels is _forward_labels.get():  # the main head's
        telemetry.record(loss, parts, cfg, cp_size, None if mtp is None else mtp.entries)
        _expect_reduction(loss, cfg)
    else:
        telemetry.record(loss, parts, cfg, cp_size)
        if mtp is not None:  # an MTP head of the forward in progress
            mtp.report(module, labels, parts)
    return loss


UNREDUCED = (
    "del_megatron: the last training micro-batch's loss never reached del_megatron's loss "
    "function, so the 'digit' reduction (the default) was not applied to it: it trained alpha "
    "x the digit share on the mean digit term instead of alpha. With Megatron-Bridge pass "
    "forward_step_func=numerical_forward_step to pretrain() / finetune() (or wrap your forward "
    "step with make_forward_step); in your own loop call "
    "del_megatron.megatron.numerical_loss_func(loss_mask, output); or use reduction='token' "
    "with digit_share (no loss function of ours needed)"
)


def _expect_reduction(loss: torch.Tensor, cfg: NumericalLossConfig) -> None:
    """Where the registration requires our loss function, stop at a training micro-batch
    whose predecessor's loss it never saw (the "digit" reduction would go unapplied)."""
    registration = state.current()
    if registration is None or not registration.loss_func_required:
        return
    if cfg.reduction != "digit" or not torch.is_grad_enabled():
        return
    if registration.unreduced is not None:
        registration.unreduced = None
        raise RuntimeError(UNREDUCED)
    registration.unreduced = loss


def _compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[b, s] per-token loss: CE + alpha * numerical term (docs/DEL.md "token" form)."""
    cfg = _resolve_cfg(self)
    original = getattr(_language_module(), _MARKER)
    if cfg is None:
        return original(self, labels, logits)
    _check_model_once(self)
    _check_packed_capture(self)
    _check_digit_ids(cfg)
    cp_group, cp_balancing = _cp_layout(self)
    parts = loss_parts(
        labels,
        logits,
        cfg,
        _tp_group(self, logits),
        cp_group=cp_group,
        cu_seqlens=_cu_seqlens(),
        cp_balancing=cp_balancing,
        inplace=_logits_spent_by_the_loss(self, labels, logits),
    )
    return _token_loss(parts, cfg, labels, self, cp_group)


def _logits_spent_by_the_loss(module, labels: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether the loss may write over `logits` (inplace: the gradient over fp32 logits, one
    [s, b, V/tp] fp32 buffer where a new gradient would be a second, as Megatron's own
    cross-entropy works on fp32 logits in place). So only when nothing reads them after the
    loss: fp32 logits of the model's main head (labels are those of the forward in progress;
    MTP heads' logits, with rolled labels, are read after their loss for acceptance counts), and
    no forward hook on the output layer or on every module (knowledge distillation and Megatron's
    logits saver capture the logits there)."""
    if logits.dtype != torch.float32 or labels is not _forward_labels.get():
        return False
    output_layer = getattr(module, "output_layer", None)
    if output_layer is None or output_layer._forward_hooks:
        return False
    if torch.nn.modules.module._global_forward_hooks:
        return False
    state.log_once(
        "fp32_logits_in_place",
        "del_megatron: fp32 logits: the loss writes their gradient over them (in place), as "
        "Megatron's cross-entropy does",
    )
    return True


def _wants_logits_free(module) -> bool:
    registration = state.current()
    if registration is None or _resolve_cfg(module) is None:
        return False
    return _weight_gradient(module, registration) is not None


def _weight_gradient(module, registration: Registration) -> Optional[str]:
    """The route the registration's or the model config's logits-free setting asks for (the
    registration's first), None when neither asks for the logits-free loss."""
    route = lf.weight_gradient_of(registration.logits_free)
    if route is None:
        config = getattr(module, "config", None)
        route = lf.weight_gradient_of(getattr(config, lf.FIELD_LOGITS_FREE, False))
    return route


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
    cfg = _resolve_cfg(module)
    _check_digit_ids(cfg)
    support.check_logit_dtype(lf.logit_dtype(module, output_layer), hidden_states.dtype)
    lf.run_forward_pre_hooks(output_layer, hidden_states)
    weight = lf.output_weight(output_layer, output_weight)
    tp_group = _model_tp_group(module)
    tp_group = tp_group if dist.get_world_size(tp_group) > 1 else None
    sequence_parallel = getattr(output_layer, "sequence_parallel", False) and tp_group is not None
    asked = _weight_gradient(module, state.current())
    tokens, hidden_size = labels.numel(), hidden_states.size(-1)
    route = resolve_weight_gradient(asked, tokens, weight.size(0), hidden_size, hidden_states.dtype)
    state.log_once(
        f"logits_free_{route}",
        "del_megatron: logits-free loss; the output layer's gradients take the '%s' route "
        "(asked: %s; %d tokens, h %d, %d vocab columns on this rank)",
        route,
        asked,
        tokens,
        hidden_size,
        weight.size(0),
    )
    cp_group, cp_balancing = _cp_layout(module)
    with weight_gradient_into(lf.main_grad_sink(output_layer, weight)):
        parts = numerical_linear_loss(
            hidden_states,
            weight,
            labels,
            cfg,
            tp_group,
            return_parts=True,
            cp_group=cp_group,
            cu_seqlens=_cu_seqlens(),
            cp_balancing=cp_balancing,
            sequence_parallel=sequence_parallel,
            loss_mask=loss_mask,
            weight_gradient=route,
        )
    return _token_loss(parts, cfg, labels, module, cp_group)


def register(
    cfg: Optional[NumericalLossConfig] = None,
    *,
    step_accounting: Optional[Callable[[Any], Any]] = None,
    logits_free: Union[bool, str] = False,
    cp_balancing: str = "document",
) -> None:
    """Route every LanguageModule's loss through del_megatron. Calling it again replaces the
    settings (and forgets what the previous registration kept).

    cfg=None reads the settings from each model's config fields (numerical_loss, del_alpha, ...);
    a model whose config names no loss keeps Megatron's own loss. step_accounting: model ->
    DigitAccounting, called on the first training step (lm.counted) for a step-wide "digit"
    reduction; the process groups it needs exist by then. logits_free: GPTModel computes the
    loss of calls with labels from the output layer's input, never forming the logits (needs
    megatron-core >= 0.18; refused here otherwise); a route name ("auto", "forward",
    "backward") also picks where the weight gradient is formed (numerical_linear_loss's
    weight_gradient; True is "auto"). A model config can ask for it with the field
    del_logits_free instead. cp_balancing: how the run's data pipeline cuts a packed (THD)
    batch over the context-parallel ranks: "document" (Megatron's default: each document in
    2 * cp chunks) or "sequence" (the whole packed sequence in 2 * cp chunks, as Megatron-LM
    core 0.19's get_batch does under --dataloader-inter-document-masking without --sft).
    """
    check_balancing(cp_balancing)
    if cfg is not None and not isinstance(cfg, NumericalLossConfig):
        raise TypeError(f"cfg must be a NumericalLossConfig or None, got {type(cfg).__name__}")
    if lf.weight_gradient_of(logits_free) is not None:
        lf.check_core_supports()
    module = _language_module()
    if not hasattr(module, _MARKER):
        setattr(module, _MARKER, module.compute_language_model_loss)
        module.compute_language_model_loss = _compute_language_model_loss
    _wrap_forwards()
    registration = Registration(
        cfg=cfg,
        make_accounting=step_accounting,
        logits_free=logits_free,
        cp_balancing=cp_balancing,
    )
    state.begin(registration)
    if cfg is not None and cfg.loss != "ce":
        state.log_once("settings", settings_line(cfg))
        if cfg.alpha == 0:
            state.log_once(
                "zero weight",
                "del_megatron: alpha is 0: the %s term is computed (it costs its time) and adds "
                "nothing to the loss; --numerical-loss ce trains the same loss without it",
                cfg.loss,
            )


def settings_line(cfg: NumericalLossConfig) -> str:
    """The startup report: loss, weight and its unit, reduction, slot rule and ids."""
    share = "" if cfg.digit_share is None else f", digit share {cfg.digit_share:g}"
    vocab = cfg.vocab
    ids = "digit ids from each model's config"
    if vocab is not None:
        ids = f"digit ids {list(vocab.digit_ids)}, decimal points {list(vocab.decimal_point_ids)}"
        if vocab.chunked:
            ids += f", {len(vocab.multi_digit_ids)} multi-digit tokens, slot rule {cfg.slot_logits}"
    return (
        f"del_megatron: {cfg.loss} (alpha {cfg.alpha:g} on the mean term over digit targets, "
        f"{cfg.reduction} reduction{share}) on {ids}"
    )


def unregister() -> None:
    """Restore Megatron's own loss and forwards exactly and drop what register() kept.
    Idempotent."""
    module = _language_module()
    if hasattr(module, _MARKER):
        module.compute_language_model_loss = getattr(module, _MARKER)
        delattr(module, _MARKER)
    _unwrap_forwards()
    resume.uninstall()
    state.end()


def is_registered() -> bool:
    return hasattr(_language_module(), _MARKER)
