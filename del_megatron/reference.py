"""Slow, obvious single-device versions of every loss: the oracles the tests compare against.

Written apart from the fast path: Python-level grouping of numbers, full-vocab log-softmax in
float64, per-token formulas taken straight from docs/DEL.md. Not for training.
"""

from __future__ import annotations

import math
from typing import List, Set

import torch
import torch.nn.functional as F

from .vocab import NUM_DIGITS, DigitVocab

SCHEMES = ("del", "dist2")


def _runs(row: List[int], numeric: Set[int], ignore_index: int, join_across_ignored: bool):
    """Lists of positions, one per maximal run of labels in `numeric`."""
    runs, current = [], []
    for pos, label in enumerate(row):
        if label == ignore_index and join_across_ignored:
            continue  # the public DEL code drops ignored positions before grouping
        if label in numeric and label != ignore_index:
            current.append(pos)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def reference_place_weights(
    labels: torch.Tensor,
    vocab: DigitVocab,
    ignore_index: int = -100,
    join_across_ignored: bool = False,
    scheme: str = "del",
) -> torch.Tensor:
    """Place weights float64 [b, s].

    scheme "del" (docs/DEL.md): a number is a run of digits and decimal points; 2k for the k-th
    integer place, 1.02^-(d+1) for the d-th fractional digit. scheme "dist2" (its authors'
    code): a run of digits only, k for the k-th digit from the run's end. join_across_ignored
    reproduces the public DEL code, which lets a number continue across ignored positions.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    digits, points = set(vocab.digit_ids), set(vocab.decimal_point_ids)
    out = torch.zeros(labels.shape, dtype=torch.float64)
    for r, row in enumerate(labels.tolist()):
        if scheme == "dist2":
            for run in _runs(row, digits, ignore_index, join_across_ignored):
                for i, pos in enumerate(run):
                    out[r, pos] = float(len(run) - i)
            continue
        for run in _runs(row, digits | points, ignore_index, join_across_ignored):
            tokens = [row[p] for p in run]
            split = len(run)
            if tokens[0] not in points:
                for i, tok in enumerate(tokens):
                    if tok in points:
                        split = i
                        break
            for i, (pos, tok) in enumerate(zip(run, tokens, strict=True)):
                if tok in points:
                    continue
                if i < split:
                    out[r, pos] = 2.0 * (split - i)
                else:
                    out[r, pos] = 1.02 ** -(i - split + 1)
    return out


def reference_del_token(z: torch.Tensor, g: int) -> torch.Tensor:
    """DEL l_t for one token: z [10] raw digit logits, g the target digit."""
    p_hat = torch.softmax(z, dim=0)
    target = torch.zeros_like(z)
    target[g] = 1.0
    bce = F.binary_cross_entropy_with_logits(z, target, reduction="none")
    return (p_hat * bce).sum() / NUM_DIGITS


def reference_ntl_was_token(z: torch.Tensor, g: int) -> torch.Tensor:
    p = torch.softmax(z, dim=0)
    return sum(abs(k - g) * p[k] for k in range(NUM_DIGITS))


def reference_ntl_mse_token(z: torch.Tensor, g: int) -> torch.Tensor:
    p = torch.softmax(z, dim=0)
    return (sum(k * p[k] for k in range(NUM_DIGITS)) - g) ** 2


def reference_dist2_token(z: torch.Tensor, g: int) -> torch.Tensor:
    q = torch.tensor([math.exp(-((k - g) ** 2)) for k in range(NUM_DIGITS)], dtype=z.dtype)
    q = q / q.sum()
    return F.kl_div(torch.log_softmax(z, dim=0), q, reduction="sum")


TOKEN_TERMS = {
    "del": reference_del_token,
    "ntl_was": reference_ntl_was_token,
    "ntl_mse": reference_ntl_mse_token,
    "dist2": reference_dist2_token,
}


def reference_lm_loss(
    labels: torch.Tensor,
    full_logits: torch.Tensor,
    vocab: DigitVocab,
    loss: str = "del",
    alpha: float = 0.01,
    ignore_index: int = -100,
    join_across_ignored: bool = False,
):
    """(ce, term) float64 [b, s] from labels [b, s] and whole-vocab logits [s, b, V].

    Differentiable with respect to full_logits. Total per-token loss = ce + alpha * term.
    """
    logits = full_logits.to(torch.float64).transpose(0, 1)  # [b, s, V]
    b, s, _ = logits.shape
    log_probs = torch.log_softmax(logits, dim=-1)
    scheme = "dist2" if loss == "dist2" else "del"
    weights = reference_place_weights(labels, vocab, ignore_index, join_across_ignored, scheme)
    digit_of = {tok: k for k, tok in enumerate(vocab.digit_ids)}
    ce_rows, term_rows = [], []
    for i in range(b):
        ce_row, term_row = [], []
        for j in range(s):
            label = int(labels[i, j])
            zero = logits[i, j, 0] * 0.0
            ce_row.append(zero if label == ignore_index else -log_probs[i, j, label])
            if loss == "ce" or label not in digit_of:
                term_row.append(zero)
                continue
            z = logits[i, j, list(vocab.digit_ids)]
            w = weights[i, j] if loss in ("del", "dist2") else 1.0
            term_row.append(w * TOKEN_TERMS[loss](z, digit_of[label]))
        ce_rows.append(torch.stack(ce_row))
        term_rows.append(torch.stack(term_row))
    return torch.stack(ce_rows), torch.stack(term_rows)
