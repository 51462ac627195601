"""Per-token numerical terms on the ten digit logits ("heads"; the formulas are docs/DEL.md).

Every head maps digit logits z [N, 10] (raw LM logits at the digit ids, fp32 or fp64), target
digits g [N] (int64, 0..9) and place weights w [N] to a per-token term [N]. Rows that are not digit
targets must carry w = 0 and any valid g; their term is 0 and so is their gradient. Plain torch:
autograd gives the gradients, and no head reads a value on the host (F.one_hot would, to check
its classes, off CUDA).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F

from .digits.vocab import NUM_DIGITS

HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _digit_values(z: torch.Tensor) -> torch.Tensor:
    return torch.arange(NUM_DIGITS, device=z.device, dtype=z.dtype)


def del_term(z: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """DEL: w * (1/10) * sum_k softmax(z)_k * BCE(sigmoid(z_k), [k == g])."""
    p_hat = torch.softmax(z, dim=-1)
    is_target = g.unsqueeze(-1) == torch.arange(NUM_DIGITS, device=g.device)
    # BCE of sigmoid(z) against 1 is softplus(-z), against 0 softplus(z): finite for |z| ~ 1e4.
    bce = F.softplus(torch.where(is_target, -z, z))
    return w * (p_hat * bce).sum(dim=-1) / NUM_DIGITS


def ntl_was_term(z: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """NTL-WAS: sum_k |k - g| * softmax(z)_k on digit targets (w only masks: 1 on digits)."""
    distance = (_digit_values(z)[None, :] - g[:, None].to(z.dtype)).abs()
    return w * (torch.softmax(z, dim=-1) * distance).sum(dim=-1)


def ntl_mse_term(z: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """NTL-MSE: (sum_k k * softmax(z)_k - g)^2 on digit targets (w only masks: 1 on digits)."""
    expected = (torch.softmax(z, dim=-1) * _digit_values(z)[None, :]).sum(dim=-1)
    return w * (expected - g.to(z.dtype)).square()


def dist2_term(z: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """DIST2Loss: w * KL(q || softmax(z)) with soft target q = softmax(-(k - g)^2)."""
    distance_sq = (_digit_values(z)[None, :] - g[:, None].to(z.dtype)).square()
    log_q = torch.log_softmax(-distance_sq, dim=-1)
    log_p = torch.log_softmax(z, dim=-1)
    return w * (log_q.exp() * (log_q - log_p)).sum(dim=-1)


HEADS: Dict[str, HeadFn] = {
    "del": del_term,
    "ntl_was": ntl_was_term,
    "ntl_mse": ntl_mse_term,
    "dist2": dist2_term,
}
