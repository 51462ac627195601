"""Per-step DEL telemetry: the report entries the loss function adds to Megatron's log.

From the parts behind each micro-batch's loss (registration.record, with the entries of the MTP
heads that the same forward computed first) and its loss mask, the entries are `[sum, count]` pairs,
which Megatron-LM sums over micro-batches and data-parallel x context-parallel ranks into each
step's sum / count: the value TensorBoard and W&B get for the step, and whose mean over the log
interval the console line prints (docs/megatron-lm.md, "What the log shows").

Counts carry a tiny COUNT_EPS, so a step without digit targets reports 0 for the digit entries
instead of 0/0 = NaN (which would hide them for the whole interval); it is lost in float32 next
to any count >= 1, so real steps are exact. Megatron-LM up to core 0.17 also drops an entry
whose interval mean is exactly 0; there, an exact 0 shows as ZERO_SHOWN_AS.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict

import torch

from ..config import NumericalLossConfig
from ..digit_stats import digit_stats
from ..loss import LossParts
from .registration import Record

COUNT_EPS = 1e-8
ZERO_SHOWN_AS = 1e-20


@functools.lru_cache(maxsize=1)
def _zero_floor() -> float:
    """ZERO_SHOWN_AS where Megatron-LM's training log drops entries whose mean is 0 (core up to
    0.17: `if avg > 0.0`), else 0."""
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return 0.0
    major, minor = (int(part) for part in __version__.split(".")[:2])
    return ZERO_SHOWN_AS if (major, minor) < (0, 18) else 0.0


def _pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A Megatron-LM report entry [sum, count] (float32 [2]): COUNT_EPS keeps an empty count
    from 0/0, and ZERO_SHOWN_AS x count shows an exact 0 on cores that print only means > 0."""
    count = count.detach().float() + COUNT_EPS
    return torch.stack([total.detach().float() + _zero_floor() * count, count])


def mtp_entries(
    depth: int, mask: torch.Tensor, parts: LossParts, cp_size: int = 1
) -> Dict[str, torch.Tensor]:
    """The report entries of MTP head `depth` (1-based, as Megatron-LM's `mtp_1 loss`): its
    digit accuracy and entropy over its digit targets under `mask` [b, s], the loss mask
    Megatron rolls for that depth."""
    stats = digit_stats(mask.reshape(parts.ce.shape).float(), parts)
    entries = {
        f"mtp_{depth} digit acc": _pair(stats.correct, stats.n_digits),
        f"mtp_{depth} digit entropy": _pair(stats.entropy, stats.n_digits),
    }
    if torch.is_grad_enabled():  # training: the console's interval means weigh by it
        entries[f"mtp_{depth} digit tokens"] = _pair(
            stats.n_digits, torch.full_like(stats.n_digits, 1.0 / cp_size)
        )
    return entries


def report_entries(loss_mask: torch.Tensor, rec: Record) -> dict:
    """Telemetry as Megatron-LM `[sum, count]` report entries (float32 [2] each), the forward's
    MTP heads' entries last; the same names under every loss, "ce" (the A/B's control arm)
    included, which has no term and no weight to report. `digit tokens` counts 1 / cp_size a
    rank, so that its sum over the context-parallel ranks of a micro-batch (Megatron-LM sums
    over DP x CP) is one micro-batch. Evaluation (no grad) reports neither `digit tokens` nor
    the weight: a validation pass has no step and no weight (and Megatron-LM would print their
    exp() as a PPL)."""
    mask = loss_mask.reshape(rec.output.shape).float()
    stats = digit_stats(mask, rec.parts)
    n_digits, n_tokens = stats.n_digits, mask.sum()
    loss, training = rec.cfg.loss, torch.is_grad_enabled()
    entries = {"ce loss": _pair((rec.parts.ce.float() * mask).sum(), n_tokens)}
    if loss != "ce":
        entries[f"{loss} term"] = _pair((rec.parts.term.float() * mask).sum(), n_digits)
        if training:
            entries[f"{loss} weight"] = effective_weight(rec.cfg, n_digits, n_tokens, _pair)
    entries["digit acc"] = _pair(stats.correct, n_digits)
    entries["digit entropy"] = _pair(stats.entropy, n_digits)
    entries["digit target prob"] = _pair(stats.target_prob, n_digits)
    entries["digit distance"] = _pair(stats.distance, n_digits)
    if training:
        entries["digit tokens"] = _pair(n_digits, torch.full_like(n_digits, 1.0 / rec.cp_size))
    entries["digit share"] = _pair(n_digits, n_tokens)
    return {**entries, **(rec.mtp or {})}


def effective_weight(
    cfg: NumericalLossConfig, n_digits: torch.Tensor, n_tokens: torch.Tensor, pair: Callable
) -> torch.Tensor:
    """The report entry of the weight the loss puts on the mean term over digit targets: alpha
    for the "digit" reduction; for the "token" one alpha / digit_share x the measured share,
    summed as Megatron-LM sums entries (micro-batches, data-parallel ranks), so that the logged
    sum / count is token_weight x (the step's digit targets / its loss tokens)."""
    if cfg.reduction == "token":
        return pair(cfg.token_weight * n_digits, n_tokens)
    return pair(cfg.token_weight * n_digits, n_digits)
