"""Megatron glue: the loss hook, Megatron-LM arguments, telemetry, Bridge and NeMo adapters.

Importing it needs only torch; megatron-core is imported when a hook is registered or a model
is trained. register() sets up all the state the glue keeps and unregister() removes it.
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
