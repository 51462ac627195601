"""Plug del_megatron into Megatron-LM's pretrain_gpt.py (the patches and the drop-in script).

- `add_arguments(parser)`: the DEL flags, refused as soon as they are parsed where they alone
  decide it.
- `register_from_args(args, tokenizer)`: the parsed flags and the run's tokenizer -> the loss,
  registered before training starts (a tokenizer without single-digit tokens stops the run
  there; a refusal is one line on rank 0, refusals.py), and Megatron-LM's console means of the
  digit entries taken over digit targets (the interval means below). With --del-reduction digit it
  also registers how to make the step accounting, which happens on the first training step,
  once the process groups exist.
- `counted(data_iterator, model)`: forward_step's iterator, counted a step at a time for the
  step-wide "digit" reduction (unchanged otherwise).
- `wrap_model_provider` (core <= 0.17's pretrain(extra_args_provider=...)): registers from the
  flags once Megatron has built the tokenizer, and checks each model config it builds.
- `install(pretrain_gpt)` (the drop-in): wraps the module's loss_func and forward_step, once
  (also over a pretrain_gpt.py our patch already wrapped).
- `help_with_flags(extra)`: `--help` lists the DEL flags (inprocess_restart parses first).
- `destroy_process_groups()`: after pretrain() returns, so that the process exits cleanly.

The console's means (IntervalMeans): Megatron-LM's training_log prints the mean of each entry's
per-step values over the log interval, where a step without digit targets would count as a 0 in
`digit acc`. install_interval_means() wraps it (core_v0.16.1 to core_v0.19.0 alike) so that each
entry over digit targets is weighted by each step's digit targets (`digit tokens` x the step's
micro-batches x DP), and, on iterations where this rank writes TensorBoard or W&B, a step
without digit targets writes none of them (instead of a 0). Other entries keep Megatron's mean
over iterations. Nothing is read on the host but on those writing iterations, where Megatron-LM
reads every entry itself.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import NumericalLossConfig
from . import accounting, flags, refusals, resume
from . import registration as reg
from .accounting import DigitAccounting, ShareWatch, counted
from .flags import chain_extra_args
from .groups import process_groups, unwrapped_model
from .hook import enable
from .logits_free import weight_gradient_of
from .loss_func import WRAPPED, make_loss_func

# What the patched pretrain_gpt.py uses (one import: `from del_megatron.megatron import lm`).
__all__ = [
    "add_arguments",
    "chain_extra_args",
    "counted",
    "destroy_process_groups",
    "eval_num_microbatches",
    "help_with_flags",
    "install",
    "make_loss_func",
    "process_groups",
    "register_from_args",
    "step_accounting",
    "unwrapped_model",
    "wrap_model_provider",
]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's extra-args provider: the DEL flags (flags.add_arguments), checked as soon as
    the parser has parsed them (flags.check_flags): a refusal is one line on rank 0 before
    Megatron-LM validates and prints its arguments."""
    flags.add_arguments(parser)
    refusals.check_when_parsed(parser, flags.check_flags)
    return parser


def eval_num_microbatches(args: Any) -> int:
    """Micro-batches a Megatron-LM evaluation step runs (training.evaluate): the eval global
    batch over eval micro-batch x DP (x GTP weight remat, core 0.19). Core 0.16 has no eval
    sizes: the training ones at their final value, not ramp-up's."""
    batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    micro = getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
    remat = getattr(args, "gtp_weight_remat_size", None) or 1
    return batch // (micro * args.data_parallel_size * remat)


def step_accounting(cfg: NumericalLossConfig, args: Any, model: Any = None) -> DigitAccounting:
    """The "digit" reduction over Megatron-LM's whole step. Its data iterators yield whole
    sequences on tensor-parallel rank 0 of each DP rank, so the other tensor-parallel ranks
    receive the counts by broadcast (accounting.for_model). Evaluation steps run
    eval_num_microbatches(args)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return accounting.for_model(
        cfg,
        model,
        get_num_microbatches,
        per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
        share_over_tp=True,
        eval_microbatches=functools.partial(eval_num_microbatches, args),
    )


@refusals.one_line
def register_from_args(args: Any, tokenizer: Any) -> Optional[NumericalLossConfig]:
    """Build the config from parsed flags and the run's tokenizer and register the loss hook
    (None, and nothing registered, without --numerical-loss and --del-logits-free: stock
    Megatron-LM). --numerical-loss ce registers the control arm: cross-entropy and the digit
    entries. Flags del_megatron cannot train with are refused here, before any model exists
    (refusals.py), in one line on rank 0 and an exit."""
    resume.install()  # a --load of other numerical-loss settings is announced (resume.py)
    flags.checked(args)  # a forgotten --numerical-loss is refused before stock CE trains
    flags.say_unused_weight_flags(args)
    logits_free = getattr(args, "del_logits_free", False)
    if args.numerical_loss is None and not logits_free:
        return None
    refusals.check_megatron_settings(args, weight_gradient_of(logits_free))
    cfg = flags.config_from_args(args, tokenizer)
    install_interval_means()  # the console's digit entries: means over digit targets
    numerical = cfg.loss != "ce"
    digit_steps = numerical and cfg.reduction == "digit"
    registration = enable(
        cfg,
        logits_free=logits_free,
        step_accounting=functools.partial(step_accounting, cfg, args) if digit_steps else None,
        cp_balancing=cp_balancing_of(args),
        loss_func_required=digit_steps,
        share_watch=share_watch(cfg, args) if numerical and cfg.reduction == "token" else None,
    )
    registration.one_line_refusals = True  # the model checks at its first forward, too
    return cfg


def share_watch(cfg: NumericalLossConfig, args: Any) -> ShareWatch:
    """The check of --del-digit-share against the share measured over each of Megatron-LM's
    log intervals (--log-interval steps), warned on the first tensor- and data-parallel rank
    of the last pipeline stage (where the loss is computed)."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    def reports() -> bool:
        return (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        )

    interval = int(getattr(args, "log_interval", None) or 100)
    return ShareWatch(
        cfg.digit_share, cfg.alpha, lambda: interval * get_num_microbatches(), reports
    )


def cp_balancing_of(args: Any) -> str:
    """How Megatron-LM's get_batch cuts a packed batch over context-parallel ranks: the whole
    sequence ("sequence") under --dataloader-inter-document-masking without --sft (core >= 0.19,
    pretrain_gpt.py's use_per_sequence_balancing), else per document."""
    per_sequence = getattr(args, "dataloader_inter_document_masking", False)
    return "sequence" if per_sequence and not getattr(args, "sft", False) else "document"


def destroy_process_groups() -> None:
    """Destroy torch.distributed's process groups (all of them; a no-op if none exist). Call it
    once pretrain() has returned: Megatron-LM's pretrain_gpt.py leaves the groups to interpreter
    exit, where gloo's worker threads can abort a finished run with SIGABRT ("terminate called
    without an active exception", pytorch/pytorch#190489). Megatron-Bridge destroys its own."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model_provider(
    model_provider: Callable,
    get_args: Callable,
    get_tokenizer: Callable,
    check_args: Optional[Callable[[Any], None]] = None,
):
    """model_provider(*a, **kw) that first configures and registers the numerical loss (the
    tokenizer exists by then; `check_args(args)` before it) and then checks the model config
    (refusals.check_model_config)."""

    @functools.wraps(model_provider)
    def provider(*args, **kwargs):
        cfg = reg.run_config()
        if cfg is None:  # once per run (virtual pipeline stages call the provider per chunk)
            if check_args is not None:
                check_args(get_args())
            cfg = register_from_args(get_args(), get_tokenizer())
        model = model_provider(*args, **kwargs)
        if cfg is not None:
            registration = reg.current()
            route = weight_gradient_of(registration.logits_free) if registration else None
            refusals.one_line(refusals.check_model_config)(model.config, route, model)
        return model

    return provider


def install(pretrain_gpt: Any) -> None:
    """Wrap `pretrain_gpt.loss_func` in place (forward_step looks it up there) and
    `pretrain_gpt.forward_step` so that its data iterator is counted. Idempotent, and harmless
    on a pretrain_gpt.py that our patch already wrapped: its loss_func is left as it is (a
    second wrapper would not find the loss the first one reduced), and its forward_step's own
    counted() passes the iterator counted here through."""
    pretrain_gpt.loss_func = make_loss_func(pretrain_gpt.loss_func)
    if not getattr(pretrain_gpt.forward_step, WRAPPED, False):
        forward_step = pretrain_gpt.forward_step

        @functools.wraps(forward_step)
        def counted_forward_step(data_iterator, model, *args, **kwargs):
            return forward_step(counted(data_iterator, model), model, *args, **kwargs)

        setattr(counted_forward_step, WRAPPED, True)
        pretrain_gpt.forward_step = counted_forward_step


# "%%" and "%(default)s" are argparse's; a lone "%" is a typo that breaks --help.
_BARE_PERCENT = re.compile(r"%%|%\(\w+\)[a-z]|%")


def help_with_flags(extra_args_provider: Callable, argv: Optional[list] = None) -> None:
    """With -h/--help on the command line, print Megatron-LM's help including the DEL flags and
    exit (Megatron-LM's inprocess_restart parses the arguments without them first). Help
    strings with a bare '%' are printed as written: Megatron-LM core_v0.19.0's own
    --moe-paged-stash-buffer-size-factor-cuda has one, which makes argparse's --help fail."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" not in argv and "--help" not in argv:
        return
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    parser = extra_args_provider(parser) or parser
    for action in parser._actions:
        if action.help:
            action.help = _BARE_PERCENT.sub(lambda m: m[0] if len(m[0]) > 1 else "%%", action.help)
    parser.print_help()
    sys.exit(0)


TRAINING_MODULE = "megatron.training.training"
TRAINING_LOG = "training_log"
ADVANCED = "advanced iterations"
DIGIT_TOKENS = "digit tokens"
# Entries averaged over the digit targets of the main head (their count is `digit tokens`).
DIGIT_ENTRIES = ("digit acc", "digit entropy", "digit target prob", "digit distance")


def weighted_entries(keys, loss: str, reduction: str) -> List[Tuple[str, str]]:
    """(entry, the entry counting its weight) for each of `keys` averaged over digit targets:
    the main head's over `digit tokens`, MTP head k's over `mtp_k digit tokens`."""
    main = set(DIGIT_ENTRIES) | {f"{loss} term"}
    if reduction == "digit":
        main.add(f"{loss} weight")
    pairs = []
    for key in keys:
        if key in main:
            pairs.append((key, DIGIT_TOKENS))
        elif key.startswith("mtp_") and key.endswith((" digit acc", " digit entropy")):
            pairs.append((key, key.split(" ")[0] + " " + DIGIT_TOKENS))
    return [(key, weight) for key, weight in pairs if weight in keys]


class IntervalMeans:
    """Running sums over a log interval: entry -> (sum of value x digit targets, of targets)."""

    def __init__(self) -> None:
        self.sums: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, key: str, value: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Add one step's value (its mean over `weight` digit targets); the interval's mean."""
        total, count = self.sums.get(key, (0.0, 0.0))
        total, count = total + value.float() * weight, count + weight
        self.sums[key] = (total, count)
        return torch.where(count > 0, total / torch.clamp(count, min=1e-30), 0.0)

    def clear(self) -> None:
        self.sums.clear()


def _microbatches_over_dp() -> int:
    """The count Megatron-LM's `digit tokens` has for a step: one for each micro-batch of each
    data-parallel rank (its CP ranks count 1 / cp each), so value x this = the digit targets."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return get_num_microbatches() * parallel_state.get_data_parallel_world_size()


def _writes_events(iteration: int) -> bool:
    from megatron.training.global_vars import get_args, get_tensorboard_writer

    interval = getattr(get_args(), "tensorboard_log_interval", 1) or 1
    return get_tensorboard_writer() is not None and iteration % interval == 0


def _wrap(training_log: Callable, means: IntervalMeans) -> Callable:
    import inspect

    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def logged(*args: Any, **kwargs: Any):
        cfg = reg.run_config()
        if cfg is None or cfg.vocab is None:
            return training_log(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        loss_dict = bound.arguments["loss_dict"]
        totals = bound.arguments["total_loss_dict"]
        pairs = weighted_entries(list(loss_dict), cfg.loss, cfg.reduction)
        if pairs and not bound.arguments.get("skipped_iter"):
            per_step = _microbatches_over_dp()
            advanced = totals.get(ADVANCED, 0) + 1
            for key in loss_dict:  # the console line keeps the report's order
                if key not in totals:
                    totals[key] = torch.zeros_like(loss_dict[key], dtype=torch.float)
            empty = set()  # counts without digit targets, read where events are written
            if _writes_events(bound.arguments["iteration"]):
                empty = {w for _, w in pairs if float(loss_dict[w]) * per_step < 0.5}
            for key, weight_key in pairs:
                mean = means.add(key, loss_dict[key], loss_dict[weight_key] * per_step)
                # training_log prints total / advanced, having added the step's value to the
                # total, unless the entry is gone from the step's report (then no event either)
                if weight_key in empty:
                    del loss_dict[key]
                    totals[key] = mean * advanced
                else:
                    totals[key] = mean * advanced - loss_dict[key]
        result = training_log(*bound.args, **bound.kwargs)
        if not totals.get(ADVANCED, 0):  # training_log printed and reset its totals
            means.clear()
        return result

    return logged


def install_interval_means() -> None:
    """Wrap Megatron-LM's training_log until unregister() (a no-op without Megatron-LM).
    Idempotent."""
    reg.wrap_in_place(TRAINING_MODULE, TRAINING_LOG, lambda log, _: _wrap(log, IntervalMeans()))
