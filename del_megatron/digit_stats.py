"""What the model's digit distribution says at each digit target, summed over a batch: accuracy,
entropy, the target's probability and the expected distance from it, from the softmax over the
ten digit logits DEL uses. Every framework's report (Megatron-LM, Bridge, NeMo, AutoModel) reads
these sums."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .digits.numbers import held_slots
from .loss import LossParts


class DigitStats(NamedTuple):
    """Sums over the digit targets of a micro-batch ([] float32 each, on the device)."""

    n_digits: torch.Tensor  # digit targets
    correct: torch.Tensor  # those whose digit is the argmax of the ten digit logits
    entropy: torch.Tensor  # nats: entropy of the softmax over the ten digit logits
    target_prob: torch.Tensor  # that softmax's probability of the target digit
    distance: torch.Tensor  # its expected |digit - target digit|


def digit_stats(mask: torch.Tensor, parts: LossParts) -> DigitStats:
    """DigitStats summed over the digit targets under `mask` [b, s] (float): one per digit
    target, a chunking vocab's held [b, s, 3] slots, else [b, s]. Every statistic reads the
    softmax over the ten digit logits DEL uses (slot logits included), whatever the loss.
    Tensors only: nothing is read on the host."""
    digit, logits = parts.digit, parts.digit_logits.detach()
    if digit.dim() == mask.dim():
        digit, logits = digit.unsqueeze(-1), logits.unsqueeze(-2)
    held = held_slots(parts.digit_count, digit.size(-1)) & (mask.unsqueeze(-1) != 0)
    # Slots that hold no target digit may hold inf (slot logits): they never reach a sum.
    logits = torch.where(held.unsqueeze(-1), logits.float(), 0.0)
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.special.entr(probs).sum(dim=-1)  # -sum p ln p
    correct = logits.argmax(dim=-1) == digit
    target = digit.clamp(0, 9).unsqueeze(-1)
    target_prob = probs.gather(-1, target).squeeze(-1)
    digits = torch.arange(10, device=probs.device)  # made on the device: no host copy
    distance = (probs * (digits - target).abs()).sum(dim=-1)
    digit_mask = held.float() * mask.unsqueeze(-1)
    return DigitStats(
        digit_mask.sum(),
        (correct * digit_mask).sum(),
        (entropy * digit_mask).sum(),
        (target_prob * digit_mask).sum(),
        (distance * digit_mask).sum(),
    )
