"""Per-step DEL telemetry: the report entries the loss function adds to Megatron's log.

From the parts behind each micro-batch's loss (records.py, with the entries of the MTP heads
that the same forward computed first) and its loss mask, the entries are `[sum, count]` pairs,
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

from ..loss import LossParts, NumericalLossConfig
from ..numbers import held_slots
from .records import Record

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


def digit_stats(mask: torch.Tensor, parts: LossParts) -> tuple:
    """(n_digits, correct, entropy) [] float32, summed over the digit targets under `mask`
    [b, s] (float): one per digit target, a chunking vocab's held [b, s, 3] slots, else [b, s].
    correct counts the targets whose digit is the argmax of the ten digit logits; entropy sums,
    in nats, the entropy of the softmax over them (the logits DEL uses, slot logits included).
    Tensors only: nothing is read on the host."""
    digit, logits = parts.digit, parts.digit_logits.detach()
    if digit.dim() == mask.dim():
        digit, logits = digit.unsqueeze(-1), logits.unsqueeze(-2)
    held = held_slots(parts.digit_count, digit.size(-1)) & (mask.unsqueeze(-1) != 0)
    # Slots that hold no target digit may hold inf (slot logits): they never reach a sum.
    logits = torch.where(held.unsqueeze(-1), logits.float(), 0.0)
    entropy = torch.special.entr(torch.softmax(logits, dim=-1)).sum(dim=-1)  # -sum p ln p
    correct = logits.argmax(dim=-1) == digit
    digit_mask = held.float() * mask.unsqueeze(-1)
    return digit_mask.sum(), (correct * digit_mask).sum(), (entropy * digit_mask).sum()


def mtp_entries(depth: int, mask: torch.Tensor, parts: LossParts) -> Dict[str, torch.Tensor]:
    """The report entries of MTP head `depth` (1-based, as Megatron-LM's `mtp_1 loss`): its
    digit accuracy and entropy over its digit targets under `mask` [b, s], the loss mask
    Megatron rolls for that depth."""
    n_digits, correct, entropy = digit_stats(mask.reshape(parts.ce.shape).float(), parts)
    return {
        f"mtp_{depth} digit acc": _pair(correct, n_digits),
        f"mtp_{depth} digit entropy": _pair(entropy, n_digits),
    }


def report_entries(loss_mask: torch.Tensor, rec: Record) -> dict:
    """Telemetry as Megatron-LM `[sum, count]` report entries (float32 [2] each), the forward's
    MTP heads' entries last. `digit tokens` counts 1 / cp_size a rank, so that its sum over the
    context-parallel ranks of a micro-batch (Megatron-LM sums over DP x CP) is one micro-batch."""
    mask = loss_mask.reshape(rec.output.shape).float()
    n_digits, correct, entropy = digit_stats(mask, rec.parts)
    n_tokens = mask.sum()
    return {
        "ce loss": _pair((rec.parts.ce.float() * mask).sum(), n_tokens),
        f"{rec.cfg.loss} term": _pair((rec.parts.term.float() * mask).sum(), n_digits),
        f"{rec.cfg.loss} weight": effective_weight(rec.cfg, n_digits, n_tokens, _pair),
        "digit acc": _pair(correct, n_digits),
        "digit entropy": _pair(entropy, n_digits),
        "digit tokens": _pair(n_digits, torch.full_like(n_digits, 1.0 / rec.cp_size)),
        "digit share": _pair(n_digits, n_tokens),
        **(rec.mtp or {}),
    }


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
