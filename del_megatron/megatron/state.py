"""What register() sets up and unregister() takes down: one Registration, no other state.

The loss hook's settings, the per-micro-batch records the loss function reads, the "digit"
reduction's step accounting (made on the first training step, when the process groups exist)
and the counted data iterators all live on the current Registration, so unregister() leaves
nothing behind.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, Optional, Set, Tuple, Union

import torch.distributed as dist

from ..loss import NumericalLossConfig

logger = logging.getLogger(__name__)

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
    counted: each data iterator lm.counted has wrapped (by id) -> (it, its counted iterator);
    produced: those counted iterators (by id), which lm.counted passes through unchanged.
    accounting_groups: the process groups the accounting was made with; counted_models: the
    models lm.counted has seen (by id); checked_models: the models whose configuration the loss
    hook has checked (by id). cp_balancing: how the data pipeline cuts a packed batch over the
    context-parallel ranks when no micro-batch says otherwise (hook.register). share_watch: a
    share_watch.ShareWatch, the token reduction's given digit share checked against the measured
    one.
    loss_func_required: the framework's loss function must be ours (the "digit" reduction is
    applied there); one_line_refusals: the model checks refuse as one line on rank 0 and an exit
    (Megatron-LM's command line, refusal.py); unreduced: the last training micro-batch's
    main-head loss it has not seen yet (reduction.expect_reduction)."""

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
    _current["registration"] = registration


def end() -> None:
    _current.pop("registration", None)


def is_rank_zero() -> bool:
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
