"""Megatron glue: the loss hook, Megatron-LM arguments, telemetry, Bridge and NeMo adapters.

Importing it needs only torch; megatron-core is imported when a hook is registered or a model
is trained. register() sets up all the state the glue keeps and unregister() removes it.

Modules, each importing only those before it: state (the registration), settings (the settings
on the model config, read in one place), given_ids, support | records (the parts behind each
loss), telemetry (report entries), capture (the forward in progress), logits_free,
share_watch, seams (a Megatron-LM function wrapped in place), resume, interval_means (the
console's means over digit targets), refusal (one line, not a traceback) | groups (process
groups), accounting (a step's counts), reduction (token and digit) | loss_func, model_checks,
hook (the loss method, register) | enable (the one way on) | args, lm (Megatron-LM), bridge,
nemo, pretrain_gpt_del.
"""

from .accounting import DigitAccounting
from .args import add_arguments, chain_extra_args, config_from_args, digit_vocab_from_args
from .hook import is_registered, register, unregister
from .loss_func import make_loss_func, numerical_loss_func
from .settings import config_fields

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
