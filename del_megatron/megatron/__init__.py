"""Megatron glue: the loss hook, Megatron-LM arguments, telemetry, Bridge and NeMo adapters.

Importing this package needs megatron-core; the rest of del_megatron needs only torch.
"""

from .accounting import DigitAccounting
from .args import add_arguments, chain_extra_args, config_from_args, digit_vocab_from_args
from .hook import config_fields, is_registered, register, unregister
from .telemetry import make_loss_func, numerical_loss_func

__all__ = [
    "DigitAccounting",
    "add_arguments",
    "chain_extra_args",
    "config_fields",
    "config_from_args",
    "digit_vocab_from_args",
    "is_registered",
    "make_loss_func",
    "numerical_loss_func",
    "register",
    "unregister",
]
