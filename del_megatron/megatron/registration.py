"""What register() sets up and unregister() takes down, and where the run's settings are read.

One Registration holds all of it: the settings, the parts behind each loss the hook returned
(records, which the loss function finds by the tensor), the "digit" reduction's step accounting,
the counted data iterators. The settings are read in two places only: `run_config`, the run's
own (Megatron-LM's, registered before any model exists), and `of_model`, a model's (the run's,
else its config's fields: Bridge, NeMo), which the loss hook, the model checks and the loss
function use. Megatron-LM functions wrapped in place (`wrap_in_place`) are restored by `end()`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, NamedTuple, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from ..config import NumericalLossConfig
from ..loss import LossParts

logger = logging.getLogger("del_megatron")

# A micro-batch's loss function runs right after its forward (MTP calls the hook once per MTP
# layer first), so a few records suffice.
RECORDS_KEPT = 16


@dataclass
class Registration:
    """cfg: the loss for every model (None: each model's config fields say).
    make_accounting: model -> accounting.DigitAccounting for a step-wide "digit" reduction, called
    on the first training step (None: the "digit" reduction is per micro-batch, or not used);
    accounting: the one it made, or the one a `with DigitAccounting(...)` block entered.
    logits_free: GPTModel computes the loss from the output layer's input (logits_free.py):
    True, or the weight gradient's route ("auto", "forward", "backward").
    counted: each data iterator accounting.counted has wrapped (by id) -> (it, its counted
    iterator); produced: those counted iterators (by id), which accounting.counted passes
    through unchanged. accounting_groups: the process groups the accounting was made with;
    counted_models: the models accounting.counted has seen (by id); checked_models: the models
    whose configuration the loss hook has checked (by id). cp_balancing: how the data pipeline
    cuts a packed batch over the context-parallel ranks when no micro-batch says otherwise
    (hook.register). share_watch: an accounting.ShareWatch, the token reduction's given digit
    share checked against the measured one.
    loss_func_required: the framework's loss function must be ours (the "digit" reduction is
    applied there); one_line_refusals: the model checks refuse as one line on rank 0 and an exit
    (Megatron-LM's command line, refusals.one_line); unreduced: the last training micro-batch's
    main-head loss it has not seen yet (loss_func.expect_reduction)."""

    cfg: Optional[NumericalLossConfig] = None
    make_accounting: Optional[Callable[[Any], Any]] = None
    logits_free: Union[bool, str] = False
    accounting: Optional[Any] = None
    records: Deque = field(default_factory=lambda: deque(maxlen=RECORDS_KEPT))
    counted: Dict[int, Tuple[Iterator, Iterator]] = field(default_factory=dict)
    produced: Dict[int, Iterator] = field(default_factory=dict)
    logged: Set[str] = field(default_factory=set)
    accounting_groups: Tuple[Any, ...] = ()
    counted_models: Dict[int, Any] = field(default_factory=dict)
    checked_models: Dict[int, Any] = field(default_factory=dict)
    cp_balancing: str = "document"
    share_watch: Optional[Any] = None
    loss_func_required: bool = False
    one_line_refusals: bool = False
    unreduced: Optional[Any] = None


_current: Dict[str, Registration] = {}


def current() -> Optional[Registration]:
    """The Registration of the last register(), or None after unregister()."""
    return _current.get("registration")


def begin(registration: Registration) -> None:
    """Make `registration` the current one (register() does), forgetting the previous one's."""
    _current["registration"] = registration


def end() -> None:
    """Forget the registration and restore every function wrap_in_place replaced."""
    _current.pop("registration", None)
    for module_name, function in list(_wrapped):
        _unwrap(module_name, function)


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 (RANK before torch.distributed is initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"  # before Megatron initialises distributed


def log_once(key: str, message: str, *args) -> None:
    """Log `message` at INFO on rank 0, once per registration (`key` names the message)."""
    registration = current()
    if registration is not None:
        if key in registration.logged:
            return
        registration.logged.add(key)
    if is_rank_zero():
        logger.info(message, *args)


class Record(NamedTuple):
    """output: the [b, s] loss the hook returned; parts: the pieces behind it; cfg: the
    settings it was computed with (of_model); cp_size: the
    context-parallel ranks its sequences are split over; mtp: report entries of the MTP heads
    of the same forward (telemetry.mtp_entries)."""

    output: torch.Tensor
    parts: LossParts
    cfg: NumericalLossConfig
    cp_size: int = 1
    mtp: Optional[Dict[str, torch.Tensor]] = None


def record(
    output: torch.Tensor,
    parts: LossParts,
    cfg: NumericalLossConfig,
    cp_size: int = 1,
    mtp: Optional[Dict[str, torch.Tensor]] = None,
) -> None:
    """Keep the parts behind `output` for the loss function (nothing when not registered).
    cp_size: the context-parallel ranks that hold a share of each of its sequences; mtp: report
    entries of the forward's MTP heads, reported beside the main head's."""
    registration = current()
    if registration is not None:
        registration.records.append(Record(output, parts, cfg, cp_size, mtp))


def find(output: torch.Tensor) -> Optional[Record]:
    """The record of the [b, s] loss `output` the hook returned (by identity), None if none."""
    registration = current()
    for rec in reversed(registration.records if registration is not None else ()):
        if rec.output is output:
            return rec
    return None


def run_config() -> Optional[NumericalLossConfig]:
    """The run's own settings, registered before any model exists (Megatron-LM's flags), or
    None (nothing registered, or each model's config says: Bridge, NeMo)."""
    registration = current()
    return None if registration is None else registration.cfg


def of_model(model: Any) -> Optional[NumericalLossConfig]:
    """The settings the loss of `model` (a LanguageModule, not a DDP / Float16Module wrapper)
    is computed with: the run's (run_config: Megatron-LM), else the one its config's fields
    describe (Bridge, NeMo: NumericalLossConfig.from_fields, built once a config); None when
    neither names a loss (a distillation teacher keeps Megatron's own)."""
    cfg = run_config()
    if cfg is not None:
        return cfg
    return NumericalLossConfig.from_fields(getattr(model, "config", None))


def config_fields(cfg: NumericalLossConfig) -> Dict[str, Any]:
    """The model-config fields that carry `cfg` (NumericalLossConfig.to_fields)."""
    return cfg.to_fields()


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


# Megatron-LM's own code calls its module-level functions by their global name, so a wrapper
# (resume.py's check_checkpoint_args, lm.py's training_log) replaces that name until end().
Wrapper = Callable[[Callable, Any], Callable]  # (the original, its module) -> the wrapper
_wrapped: Set[Tuple[str, str]] = set()


def _marker(function: str) -> str:
    return f"_del_megatron_original_{function}"


def wrap_in_place(module_name: str, function: str, make_wrapper: Wrapper) -> None:
    """Replace `module_name.function` by make_wrapper(the original, the module) until end()
    (a no-op when the module does not import, i.e. without Megatron-LM). Idempotent."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    marker = _marker(function)
    if hasattr(module, marker):
        return
    setattr(module, marker, getattr(module, function))
    setattr(module, function, make_wrapper(getattr(module, marker), module))
    _wrapped.add((module_name, function))


def _unwrap(module_name: str, function: str) -> None:
    module = sys.modules.get(module_name)
    marker = _marker(function)
    if module is not None and hasattr(module, marker):
        setattr(module, function, getattr(module, marker))
        delattr(module, marker)
    _wrapped.discard((module_name, function))
