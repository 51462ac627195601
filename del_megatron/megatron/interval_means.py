"""Megatron-LM's console means of the digit entries, taken over digit targets.

Megatron-LM's train_step turns each report entry into the step's sum / count, and its
training_log prints the mean of those per-step values over the log interval: a step without
digit targets would count as a 0 in the mean of `digit acc`. install() wraps the module-level
training_log (core_v0.16.1 to core_v0.19.0 alike) so that, for each entry whose count is the
step's digit targets, the interval's mean is weighted by each step's digit targets (read from
`digit tokens` x the step's micro-batches x DP): steps without any weigh nothing. On the iterations
where this rank writes TensorBoard or W&B, a step without digit targets writes none of these
entries (instead of a 0). Other entries (lm loss, ce loss, digit share, ...) keep Megatron's
mean over iterations. Nothing is read on the host but on those writing iterations, where
Megatron-LM reads every entry itself.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Tuple

import torch

from . import seams, state

MODULE = "megatron.training.training"
FUNCTION = "training_log"
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
    """Whether this rank's training_log writes TensorBoard (or W&B) events at `iteration`."""
    from megatron.training.global_vars import get_args, get_tensorboard_writer

    interval = getattr(get_args(), "tensorboard_log_interval", 1) or 1
    return get_tensorboard_writer() is not None and iteration % interval == 0


def _wrap(training_log: Callable, means: IntervalMeans) -> Callable:
    import inspect

    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def logged(*args: Any, **kwargs: Any):
        registration = state.current()
        cfg = registration.cfg if registration is not None else None
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


def install() -> None:
    """Wrap Megatron-LM's training_log (a no-op without Megatron-LM). Idempotent."""
    seams.wrap(MODULE, FUNCTION, lambda training_log, _: _wrap(training_log, IntervalMeans()))


def uninstall() -> None:
    """Restore Megatron-LM's own training_log. Idempotent."""
    seams.unwrap(MODULE, FUNCTION)
