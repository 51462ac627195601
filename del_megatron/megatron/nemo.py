"""NeMo 2 adapter (tested with nemo_toolkit 2.7.0, the last release with `nemo.collections.llm`;
NeMo deprecates that collection in favour of Megatron-Bridge, which is the maintained path:
see del_megatron.megatron.bridge).

NeMo 2.7.0's `MaskedTokenLossReduction.forward(batch, forward_out)` returns
`(loss_sum, num_valid_tokens, {"loss_sum_and_ub_size": ...})` per micro-batch and its
`reduce(outputs)` turns a step's micro-batch dicts into the logged loss. The subclass made here
keeps both contracts: forward applies the "digit" reduction to the per-token losses before NeMo's
masked sum, and adds the DEL telemetry as `[sum, count]` entries to the dict; reduce returns
NeMo's own loss and sums the telemetry over micro-batches and data-parallel ranks (one
all-reduce), keeps it as `last_telemetry` and logs it through `log` (the LightningModule's
`log`, when given).

    from nemo.collections import llm
    from del_megatron.megatron.nemo import enable_numerical_loss

    model = llm.GPTModel(config, tokenizer=tokenizer)
    enable_numerical_loss(model, tokenizer, loss="del", alpha=0.1)
    llm.train(model, data, trainer)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Union

import torch

from ..config import NumericalLossConfig
from ..digits.vocab import DigitVocab
from . import registration as reg
from .digit_ids import tokenizer_vocab
from .hook import config_of_arguments, enable
from .loss_func import check_recorded, reduce_recorded
from .telemetry import report_entries

TELEMETRY_PREFIX = "del/"


def _telemetry_keys(output: Dict[str, Any]) -> list:
    return sorted(key for key in output if key.startswith(TELEMETRY_PREFIX))


def numerical_loss_reduction(reduction_cls: type) -> type:
    """Subclass of a NeMo 2 MegatronLossReduction (MaskedTokenLossReduction or a subclass)
    with the "digit" reduction and the DEL telemetry. Constructor: the base class's arguments
    plus `log=None`, a callable `log(name, value, **kwargs)` such as LightningModule.log,
    `log_prefix` (default "" for training, "val " for a validation_step reduction) and
    `numerical_loss` (the run's loss: a loss del_megatron did not compute then stops a run whose
    loss is not "ce", loss_func.check_recorded)."""

    class NumericalLossReduction(reduction_cls):
        def __init__(
            self,
            *args,
            log: Optional[Callable] = None,
            log_prefix: Optional[str] = None,
            numerical_loss: Optional[str] = None,
            **kwargs,
        ) -> None:
            super().__init__(*args, **kwargs)
            self.log_fn, self.numerical_loss = log, numerical_loss
            validation = bool(getattr(self, "validation_step", False))
            self.log_prefix = ("val " if validation else "") if log_prefix is None else log_prefix
            self.last_telemetry: Dict[str, torch.Tensor] = {}

        def forward(self, batch, forward_out):
            if isinstance(forward_out, tuple):  # a (losses, mask) pair: not the hook's
                return super().forward(batch, forward_out)
            rec = reg.find(forward_out)
            if rec is None:  # not computed by del_megatron: stops a numerical-loss run
                check_recorded(rec, self.numerical_loss)
                return super().forward(batch, forward_out)
            loss_mask = batch["loss_mask"]
            result = super().forward(batch, reduce_recorded(loss_mask, rec))
            *head, report = result  # 2.7.0: (loss_sum, num_valid_tokens, dict)
            entries = {
                TELEMETRY_PREFIX + name: pair
                for name, pair in report_entries(loss_mask, rec).items()
            }
            return (*head, {**report, **entries})

        def reduce(self, losses_reduced_per_micro_batch) -> torch.Tensor:
            loss = super().reduce(losses_reduced_per_micro_batch)
            outputs = [x for x in losses_reduced_per_micro_batch or () if _telemetry_keys(x)]
            if outputs:
                self.last_telemetry = self._reduce_telemetry(outputs)
                if self.log_fn is not None:
                    for name, value in self.last_telemetry.items():
                        self.log_fn(self.log_prefix + name, value, batch_size=1, prog_bar=False)
            return loss

        @staticmethod
        def _reduce_telemetry(outputs) -> Dict[str, torch.Tensor]:
            """sum / count of every telemetry entry over the step's micro-batches and the
            data-parallel (x context-parallel) ranks, as NeMo reduces its own loss."""
            keys = _telemetry_keys(outputs[0])
            totals = torch.stack(
                [torch.stack([x[key].float() for key in keys]) for x in outputs]
            ).sum(dim=0)  # [entries, 2]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                from megatron.core import parallel_state

                group = parallel_state.get_data_parallel_group(with_context_parallel=True)
                torch.distributed.all_reduce(totals, group=group)
            return {
                key[len(TELEMETRY_PREFIX) :]: total[0] / total[1]
                for key, total in zip(keys, totals, strict=True)
            }

    NumericalLossReduction.__name__ = f"Numerical{reduction_cls.__name__}"
    NumericalLossReduction.__qualname__ = NumericalLossReduction.__name__
    return NumericalLossReduction


def enable_numerical_loss(
    model: Any,
    tokenizer: Any = None,
    *,
    vocab: Optional[DigitVocab] = None,
    allow_multi_digit_tokens: bool = False,
    logits_free: Union[bool, str] = False,
    **settings: Any,
) -> NumericalLossConfig:
    """Turn the numerical loss on for a NeMo 2 `llm.GPTModel` (or any LightningModule with a
    TransformerConfig `config` and NeMo's `training_loss_reduction` / `validation_loss_reduction`
    properties); returns the NumericalLossConfig. The settings go on `model.config` as plain
    attributes, both loss reductions become the DEL ones (logging through `model.log`), and the
    loss hook is registered.

    settings: NumericalLossConfig's keyword arguments (loss, alpha, reduction, digit_share,
    slot_logits), with its defaults. Digit ids come from `vocab`, else
    `tokenizer`, else `model.tokenizer`, as in Bridge's enable_numerical_loss, which also says
    what allow_multi_digit_tokens and logits_free do. The "digit" reduction here averages the
    term over each micro-batch's digit targets (NeMo normalises each micro-batch by its own
    token count); the step-wide accounting is Bridge's and Megatron-LM's."""
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if vocab is None and tokenizer is None:
        raise ValueError("enable_numerical_loss needs the tokenizer or vocab=DigitVocab(...)")
    inner = getattr(tokenizer, "tokenizer", None)  # NeMo's AutoTokenizer / SentencePiece
    if inner is not None and tokenizer_vocab(tokenizer, True) is None:
        tokenizer = inner  # the library tokenizer NeMo's wraps
    cfg = config_of_arguments(tokenizer, vocab, allow_multi_digit_tokens, settings)
    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

    reduction_cls = numerical_loss_reduction(MaskedTokenLossReduction)
    log = getattr(model, "log", None)
    training = reduction_cls(log=log, numerical_loss=cfg.loss)
    validation = reduction_cls(validation_step=True, log=log, numerical_loss=cfg.loss)
    enable(cfg, model_config=model.config, logits_free=logits_free)
    model._training_loss_reduction, model._validation_loss_reduction = training, validation
    return cfg
