"""Slow, obvious single-device versions of every loss: the oracles the tests compare against.

Written apart from the fast path: Python-level grouping of numbers, full-vocab log-softmax in
float64, per-token formulas taken straight from docs/DEL.md. Not for training.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict, List, Set, Tuple

import torch
import torch.nn.functional as F

from .digits.vocab import NUM_DIGITS, DigitVocab

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


def _number_texts(vocab: DigitVocab) -> Dict[int, str]:
    """id -> digits of every number token ('7', '07', '123', ...)."""
    return {i: text for i, text in vocab.number_tokens()}


def reference_place_weights(
    labels: torch.Tensor,
    vocab: DigitVocab,
    ignore_index: int = -100,
    join_across_ignored: bool = False,
    scheme: str = "del",
) -> torch.Tensor:
    """Place weights float64 [b, s] (one digit per token), or [b, s, 3] for a chunking vocab
    (the j-th digit of the token at each position; 0 past its last digit).

    scheme "del" (docs/DEL.md): a number is a run of number tokens and decimal points; 2k for
    the k-th integer place, 1.02^-(d+1) for the d-th fractional digit, places counted in digits.
    scheme "dist2" (its authors' code): a run of number tokens only, k for the k-th digit from
    the run's end. join_across_ignored reproduces the public DEL code, which lets a number
    continue across ignored positions.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    texts, points = _number_texts(vocab), set(vocab.decimal_point_ids)
    slots = vocab.max_digits
    out = torch.zeros((*labels.shape, slots), dtype=torch.float64)
    numeric = set(texts) if scheme == "dist2" else set(texts) | points
    for r, row in enumerate(labels.tolist()):
        for run in _runs(row, numeric, ignore_index, join_across_ignored):
            # The run's places in order: (position, slot) per digit, (position, None) per point.
            places = [
                (pos, j)
                for pos in run
                for j in (range(len(texts[row[pos]])) if row[pos] in texts else [None])
            ]
            if scheme == "dist2":  # a run of number tokens: no points
                for i, (pos, j) in enumerate(places):
                    out[r, pos, j] = float(len(places) - i)
                continue
            split = len(places)
            if row[run[0]] not in points:
                split = next((i for i, (_, j) in enumerate(places) if j is None), split)
            for i, (pos, j) in enumerate(places):
                if j is None:
                    continue
                if i < split:
                    out[r, pos, j] = 2.0 * (split - i)
                else:
                    out[r, pos, j] = 1.02 ** -(i - split + 1)
    return out if vocab.chunked else out[..., 0]


@lru_cache(maxsize=4096)
def _candidates(
    vocab: DigitVocab, j: int, prefix: str, length: int = 0
) -> Tuple[Tuple[int, ...], ...]:
    """For each digit k, the ids of the number tokens with at least j digits (exactly `length`
    digits when length > 0) that begin with prefix (j - 1 digits) followed by k."""
    return tuple(
        tuple(
            i
            for i, text in vocab.number_tokens()
            if (len(text) == length if length else len(text) >= j)
            and text[: j - 1] == prefix
            and text[j - 1] == str(k)
        )
        for k in range(NUM_DIGITS)
    )


def _logsumexp(logits: torch.Tensor, ids) -> torch.Tensor:
    return torch.logsumexp(logits[list(ids)], dim=0)


def slot_logits(
    logits: torch.Tensor, vocab: DigitVocab, label_text: str, rule: str = "any"
) -> List[torch.Tensor]:
    """z^(j) [10] for each digit j of the number token label_text, from one position's logits
    [V] (docs/DEL.md). rule "any": z^(j)_k = logsumexp of the logits of every number token with
    at least j digits that begins with label_text's first j - 1 digits followed by k. rule
    "length", with L = len(label_text) and s its digits:

        z^(j)_k = LSE{|t| = L, t_<j = s_<j, t_j = k} - LSE{|t| = L, t_<j = s_<j} + LSE{|t| = L}
    """
    if rule == "any":
        out = []
        for j in range(1, len(label_text) + 1):
            groups = _candidates(vocab, j, label_text[: j - 1])
            out.append(torch.stack([_logsumexp(logits, ids) for ids in groups]))
        return out
    if rule != "length":
        raise ValueError(f"rule must be 'any' or 'length', got {rule!r}")
    length = len(label_text)
    same_length = [i for i, text in vocab.number_tokens() if len(text) == length]
    level = _logsumexp(logits, same_length)
    out = []
    for j in range(1, length + 1):
        prefix = label_text[: j - 1]
        groups = _candidates(vocab, j, prefix, length)
        given = [i for ids in groups for i in ids]  # |t| = L and t_<j = s_<j
        z = torch.stack([_logsumexp(logits, ids) for ids in groups])
        if j > 1:  # at j = 1 the two sets are the same: the offsets cancel
            z = z - _logsumexp(logits, given) + level
        out.append(z)
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
    slot_rule: str = "any",
):
    """(ce, term) float64 [b, s] from labels [b, s] and whole-vocab logits [s, b, V].

    Differentiable with respect to full_logits. Total per-token loss = ce + alpha * term. A
    position's term is the sum over its label's digits of place weight x the loss's per-digit
    term on that digit's slot logits (one digit a token: the ten digit logits themselves),
    formed by slot_rule ("any" or "length", slot_logits).
    """
    logits = full_logits.to(torch.float64).transpose(0, 1)  # [b, s, V]
    b, s, _ = logits.shape
    log_probs = torch.log_softmax(logits, dim=-1)
    scheme = "dist2" if loss == "dist2" else "del"
    weights = reference_place_weights(labels, vocab, ignore_index, join_across_ignored, scheme)
    if not vocab.chunked:
        weights = weights.unsqueeze(-1)
    texts = _number_texts(vocab)
    ce_rows, term_rows = [], []
    for i in range(b):
        ce_row, term_row = [], []
        for j in range(s):
            label = int(labels[i, j])
            zero = logits[i, j, 0] * 0.0
            ce_row.append(zero if label == ignore_index else -log_probs[i, j, label])
            if loss == "ce" or label not in texts:
                term_row.append(zero)
                continue
            text = texts[label]
            if loss == "digit_ce":  # the token's cross-entropy once for each of its digits
                term_row.append(-log_probs[i, j, label] * len(text))
                continue
            term = zero
            for slot, z in enumerate(slot_logits(logits[i, j], vocab, text, slot_rule)):
                w = weights[i, j, slot] if loss in ("del", "dist2") else 1.0
                term = term + w * TOKEN_TERMS[loss](z, int(text[slot]))
            term_row.append(term)
        ce_rows.append(torch.stack(ce_row))
        term_rows.append(torch.stack(term_row))
    return torch.stack(ce_rows), torch.stack(term_rows)
