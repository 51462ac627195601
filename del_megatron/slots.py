"""Slot logits of a chunking vocabulary (docs/DEL.md, "Tokenizers that put up to three digits in a
token"): from the raw logits of its 1,110 number tokens to one ten-way logit vector per digit of
the label.

z^(j)_k = logsumexp of the logits of every number token with at least j digits whose first j - 1
digits are the label's and whose j-th digit is k. Slot 1 sums 111 tokens a digit, slot 2 sums
11 and slot 3 is one token's logit. Plain torch (gather and logsumexp, autograd gives the
gradient); the index tables are made once per device, and nothing is read on the host.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .device import on_device
from .vocab import NUM_DIGITS

# Places of the number tokens in DigitVocab.number_tokens() order: digit d at d, two-digit
# value v at TWO + v, three-digit value v at THREE + v (leading zeros kept: "07" is TWO + 7).
TWO, THREE = NUM_DIGITS, NUM_DIGITS + 100


def _first(device: torch.device) -> torch.Tensor:
    """Slot 1's candidates [10 digits * 111]: digit k, then "k0".."k9", then "k00".."k99"."""
    k = torch.arange(NUM_DIGITS, device=device).view(-1, 1)
    ten, hundred = torch.arange(10, device=device), torch.arange(100, device=device)
    return torch.cat([k, TWO + 10 * k + ten, THREE + 100 * k + hundred], dim=-1).reshape(-1)


def _second(device: torch.device) -> torch.Tensor:
    """Slot 2's candidates [10 prefixes p, 10 digits k * 11]: "pk", then "pk0".."pk9"."""
    p = torch.arange(NUM_DIGITS, device=device).view(-1, 1, 1)
    k = p.view(1, -1, 1)
    ten = torch.arange(10, device=device)
    tokens = torch.cat([TWO + 10 * p + k, THREE + 100 * p + 10 * k + ten], dim=-1)
    return tokens.reshape(NUM_DIGITS, -1)


def _third(device: torch.device) -> torch.Tensor:
    """Slot 3's candidates [100 prefixes q, 10 digits k]: the one token "qk"."""
    ten = torch.arange(10, device=device)
    return THREE + 10 * torch.arange(100, device=device).view(-1, 1) + ten


TABLES = (_first, _second, _third)


def _on(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three candidate tables on `device` (places in number_tokens() order), made by
    arithmetic there once and kept."""
    return tuple(on_device(("slot_table", make.__name__), device, make) for make in TABLES)


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
