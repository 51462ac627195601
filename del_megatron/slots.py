"""Slot logits of a chunking vocabulary (docs/DEL.md, "Tokenizers that put up to three digits in a
token"): from the raw logits of its 1,110 number tokens to one ten-way logit vector per digit of
the label.

z^(j)_k = logsumexp of the logits of every number token with at least j digits whose first j - 1
digits are the label's and whose j-th digit is k. Slot 1 sums 111 tokens a digit, slot 2 sums
11 and slot 3 is one token's logit. Plain torch (gather and logsumexp, autograd gives the
gradient); the index tables are made once per device, and nothing is read on the host.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .device import int_tensor, on_device
from .vocab import NUM_DIGITS

# Places of the number tokens in DigitVocab.number_tokens() order: digit d at d, two-digit
# value v at TWO + v, three-digit value v at THREE + v (leading zeros kept: "07" is TWO + 7).
TWO, THREE = NUM_DIGITS, NUM_DIGITS + 100


def _tables() -> Tuple[List[int], List[int], List[int]]:
    """Flattened candidate tables: slot 1 [10 digits, 111], slot 2 [10 prefixes, 10, 11],
    slot 3 [100 prefixes, 10] (places in number_tokens() order)."""
    first = []
    for k in range(NUM_DIGITS):
        first += [k] + [TWO + 10 * k + x for x in range(10)]
        first += [THREE + 100 * k + y for y in range(100)]
    second = []
    for p in range(NUM_DIGITS):
        for k in range(NUM_DIGITS):
            second += [TWO + 10 * p + k] + [THREE + 100 * p + 10 * k + x for x in range(10)]
    third = [THREE + 10 * q + k for q in range(100) for k in range(NUM_DIGITS)]
    return first, second, third


def _on(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    first, second, third = _tables()
    return (
        on_device(("slot_table", 1), device, int_tensor(tuple(first))),
        on_device(("slot_table", 2), device, int_tensor(tuple(second))).view(10, 110),
        on_device(("slot_table", 3), device, int_tensor(tuple(third))).view(100, 10),
    )


def slot_logits(number_logits: torch.Tensor, digit: torch.Tensor) -> torch.Tensor:
    """[..., 3, 10] slot logits from number_logits [..., 1110] (the raw logits of a chunking
    vocab's number tokens, in number_tokens() order) and the label's digits digit [..., 3]
    (int64 0..9 per slot, as NumberLayout.digit; a slot past the label's last digit may hold
    anything 0..9: its logits are then of no use). In the logits' dtype."""
    first, second, third = _on(number_logits.device)
    lead = number_logits.shape[:-1]
    z1 = number_logits.index_select(-1, first).view(*lead, NUM_DIGITS, 111).logsumexp(-1)
    candidates = second[digit[..., 0]].view(*lead, 110)
    z2 = number_logits.gather(-1, candidates).view(*lead, NUM_DIGITS, 11).logsumexp(-1)
    z3 = number_logits.gather(-1, third[digit[..., 0] * 10 + digit[..., 1]])
    return torch.stack([z1, z2, z3], dim=-2)
