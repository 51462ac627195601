"""What the loss hook needs from the LanguageModule.forward in progress.

compute_language_model_loss gets only labels and logits. The forward of every LanguageModule
class that takes packed_seq_params (GPTModel, MambaModel, HybridModel, ...) is wrapped so that,
for the duration of the call, the hook sees its PackedSeqParams (THD document offsets, hybrid
CP's per-micro-batch group), its labels (the main head's; MTP heads get rolled copies) and its
MTP heads' loss mask as Megatron rolls it. The wrapper also lets the hook adjust the call's
arguments first (hook.py hands a logits-free output_processor this way).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch

_FORWARD_MARKER = "_del_megatron_forward"  # on a model class: its original forward
# Model modules imported at wrap_forwards() so that their forwards get wrapped (best effort:
# some need optional packages).
MODEL_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.mamba.mamba_model",
    "megatron.core.models.hybrid.hybrid_model",
)

# Adjusts a wrapped forward's call: (module, bound arguments, kwargs, whether the forward takes
# output_processor) -> the kwargs to call it with.
BeforeForward = Callable[[Any, Dict[str, Any], Dict[str, Any], bool], Dict[str, Any]]

_NOT_CAPTURED = object()  # no wrapped forward is in progress
_packed_seq_params: contextvars.ContextVar = contextvars.ContextVar(
    "del_megatron_packed_seq_params", default=_NOT_CAPTURED
)
_forward_labels: contextvars.ContextVar = contextvars.ContextVar(
    "del_megatron_forward_labels", default=None
)
_forward_mtp: contextvars.ContextVar = contextvars.ContextVar(
    "del_megatron_forward_mtp", default=None
)


def language_module() -> type:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return LanguageModule


def in_forward() -> bool:
    """Whether a wrapped LanguageModule.forward is in progress."""
    return _packed_seq_params.get() is not _NOT_CAPTURED


def packed_seq_params() -> Any:
    """The PackedSeqParams of the forward in progress (None: none, or no wrapped forward)."""
    params = _packed_seq_params.get()
    return None if params is _NOT_CAPTURED else params


def cu_seqlens() -> Optional[torch.Tensor]:
    """Document offsets of a packed (THD) batch in the whole sequence, else None."""
    params = packed_seq_params()
    if params is None or getattr(params, "qkv_format", None) != "thd":
        return None
    padded = getattr(params, "cu_seqlens_q_padded", None)
    return padded if padded is not None else params.cu_seqlens_q


def is_main_head(labels: torch.Tensor) -> bool:
    """Whether `labels` are those of the forward in progress (the main head's; MTP heads
    compute their losses over rolled copies)."""
    return labels is _forward_labels.get()


class MtpHeads:
    """The MTP heads of the LanguageModule.forward in progress: the loss mask as Megatron rolls
    it for the last head seen, and the heads' report entries (telemetry.mtp_entries, added by
    the hook), which the main head's record carries to the loss function."""

    def __init__(self, loss_mask: Optional[torch.Tensor]) -> None:
        self.mask, self.depth = loss_mask, 0
        self.entries: Dict[str, torch.Tensor] = {}

    def next_head(self, module: Any, labels: torch.Tensor) -> Tuple[int, torch.Tensor]:
        """(depth, loss mask [b, s]) of the next MTP head, whose labels are rolled once more
        than the last head's. Megatron rolls the forward's loss mask (all ones when it has
        none) in lockstep with the labels, with its own roll_tensor over the model's CP group
        and the forward's packed sequences: so is it rolled here, on the device (under CP one
        more exchange of a column between neighbours)."""
        mask = self.mask if self.mask is not None else torch.ones_like(labels, dtype=torch.float)
        self.mask = roll_left(mask, getattr(module, "cp_group", None), packed_seq_params())
        self.depth += 1
        return self.depth, self.mask


def roll_left(
    tensor: torch.Tensor, cp_group: Any, packed: Any, roll_tensor: Optional[Callable] = None
) -> torch.Tensor:
    """`tensor` [b, s] rolled one position left along the sequence, zero-filled, as Megatron
    rolls an MTP head's labels and loss mask (over the CP group and packed documents), with
    Megatron's own roll_tensor (by default the installed one) in either of its signatures: up to
    core 0.19 and on main, one tensor in and (rolled, sum) out; on dev (Megatron-LM #6246) a
    list of tensors in and a list out."""
    if roll_tensor is None:
        from megatron.core.transformer.multi_token_prediction import roll_tensor
    how = dict(shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed)
    if rolls_a_list(roll_tensor):
        (rolled,) = roll_tensor([tensor], **how)
        return rolled
    return roll_tensor(tensor, **how)[0]


@functools.cache
def rolls_a_list(roll_tensor: Callable) -> bool:
    """Whether Megatron's roll_tensor takes a list of tensors (dev, #6246: `tensors`)."""
    first = next(iter(inspect.signature(roll_tensor).parameters))
    return first == "tensors"


def mtp_heads() -> Optional[MtpHeads]:
    """The MTP heads of the forward in progress (a call with labels), else None."""
    return _forward_mtp.get()


@functools.cache
def takes_packed_seq_params(forward: Callable) -> bool:
    return "packed_seq_params" in inspect.signature(forward).parameters


def _capturing(forward: Callable, before: BeforeForward) -> Callable:
    """A LanguageModule forward that makes its packed_seq_params (keyword or positional),
    labels and MTP heads visible to the loss hook for the duration of the call, after
    `before` has adjusted its keyword arguments."""
    signature = inspect.signature(forward)
    takes_output_processor = "output_processor" in signature.parameters

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        try:
            arguments = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # let forward itself report the bad call
            arguments = {}
        if args:
            kwargs = before(args[0], arguments, kwargs, takes_output_processor)
        labels = arguments.get("labels")
        token = _packed_seq_params.set(arguments.get("packed_seq_params"))
        labels_token = _forward_labels.set(labels)
        mtp = None if labels is None else MtpHeads(arguments.get("loss_mask"))
        mtp_token = _forward_mtp.set(mtp)
        try:
            return forward(*args, **kwargs)
        finally:
            _forward_mtp.reset(mtp_token)
            _forward_labels.reset(labels_token)
            _packed_seq_params.reset(token)

    return wrapped


def _language_model_classes() -> list:
    """LanguageModule and its subclasses defined so far (known model modules imported first)."""
    for name in MODEL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # e.g. the hybrid/Mamba models without mamba_ssm
            pass
    found, todo = [], [language_module()]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def wrap_forwards(before: BeforeForward) -> None:
    """Wrap the forward of every LanguageModule class defined so far that takes
    packed_seq_params (once: a class already wrapped keeps its wrapper)."""
    for cls in _language_model_classes():
        forward = vars(cls).get("forward")
        if forward is None or _FORWARD_MARKER in vars(cls):
            continue
        if takes_packed_seq_params(forward):
            setattr(cls, _FORWARD_MARKER, forward)
            cls.forward = _capturing(forward, before)


def original_forward(cls: type) -> Callable:
    """cls.forward as the class defines it, before wrap_forwards."""
    return vars(cls).get(_FORWARD_MARKER, cls.forward)


def unwrap_forwards() -> None:
    for cls in _language_model_classes():
        if _FORWARD_MARKER in vars(cls):
            cls.forward = vars(cls)[_FORWARD_MARKER]
            delattr(cls, _FORWARD_MARKER)


def _forward_owner(cls: type) -> Optional[type]:
    return next((c for c in cls.__mro__ if "forward" in vars(c)), None)


def check_captured(module: Any) -> None:
    """Refuse to compute the loss of a model whose forward takes packed_seq_params when no
    wrapped forward is in progress (its class was defined after register()): its packed
    documents would silently run into each other."""
    if in_forward():
        return
    owner = _forward_owner(type(module))
    if owner is not None and takes_packed_seq_params(vars(owner)["forward"]):
        raise RuntimeError(
            f"{owner.__qualname__}.forward takes packed_seq_params but was defined after "
            "del_megatron.megatron.register() ran, so packed (THD) document boundaries would not "
            "reach the numerical loss; call register() after importing the model class"
        )
