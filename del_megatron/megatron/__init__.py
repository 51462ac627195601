"""Megatron glue: the loss hook, Megatron-LM's flags, Megatron-Bridge and NeMo.

Importing it needs only torch; megatron-core is imported when a hook is registered or a model
is trained. register() sets up all the state the glue keeps and unregister() removes it.

Modules, by concept: registration (what register() keeps; where a model's settings are read),
flags (Megatron-LM's), digit_ids (the run's digit ids), hook (the loss method on the model;
register, enable), capture (the forward in progress), groups (process groups), loss_func (the
loss function and the weight a step puts on the term), accounting (a step's digit targets),
telemetry (report entries), refusals (what is refused, and how), logits_free, resume (a --load
of other settings), and one module per framework: lm (Megatron-LM), bridge, nemo, with
entry (Megatron-LM's pretrain scripts run with the losses: one mechanism) and the drop-in
scripts pretrain_gpt_del, pretrain_hybrid_del and pretrain_mamba_del.
`python -m tests.test_imports` prints the graph.
"""

from .accounting import DigitAccounting
from .flags import add_arguments, chain_extra_args, config_from_args, digit_vocab_from_args
from .hook import is_registered, register, unregister
from .loss_func import make_loss_func, numerical_loss_func
from .registration import config_fields

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
