"""The weight at which a control loss adds as much gradient on the digit targets' logits as a
numerical loss does, measured on a model and the first batch of a sweep's training order
(`del-megatron matched-weight`; docs/results.md declares the one its comparison uses).

Both losses add alpha x (the sum of a term over the step's digit targets) / N_d to the mean CE
(the digit reduction). Their extra gradients on the logits are alpha / N_d x d(sum term)/dz,
non-zero at digit-target rows only; for the control `digit_ce` the term is CE itself, so its
extra gradient is CE's own there (softmax - onehot over the whole vocabulary), while DEL's
reaches the ten digit logits only. The matched weight makes the two Frobenius norms equal:

    beta = alpha x ||d(sum DEL term)/dz|| / ||d(sum digit CE)/dz||    (N_d cancels)
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from ...config import NumericalLossConfig
from ...digits.vocab import digit_vocab_from_tokenizer
from ...loss import loss_parts
from .data import SEPARATOR, Problem

IGNORE = -100


def batch_tensors(problems: Sequence[Problem], tokenizer) -> Dict[str, torch.Tensor]:
    """input_ids and attention_mask [b, T] and labels [b, T] as the run trains them: the
    prompt, the separator and the answer, then the end-of-text token; labels are the next
    token on the answer's tokens and the end-of-text token (answer-only loss), IGNORE
    elsewhere."""
    rows = []
    for p in problems:
        encoded = tokenizer(p.text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"]) + [tokenizer.eos_token_id]
        answer_start = len(p.prompt) + len(SEPARATOR)
        in_answer = [first >= answer_start for first, _ in encoded["offset_mapping"]] + [True]
        labels = [ids[t + 1] if in_answer[t + 1] else IGNORE for t in range(len(ids) - 1)]
        rows.append((ids[:-1], labels))
    length = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((len(rows), length), pad)
    labels = torch.full((len(rows), length), IGNORE)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (ids, target) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(target)
        mask[i, : len(ids)] = 1
    return {"input_ids": tokens, "attention_mask": mask, "labels": labels}


def _term_gradient_norm(labels, logits, cfg: NumericalLossConfig) -> float:
    """||d(sum of the term over the digit targets)/d logits||, logits [s, b, V] fp32."""
    z = logits.detach().requires_grad_(True)
    parts = loss_parts(labels, z, cfg)
    (grad,) = torch.autograd.grad(parts.term.sum(), z)
    return float(grad.double().norm())


def gradient_norms(
    model, tokenizer, problems: Sequence[Problem], losses: Sequence[str]
) -> Dict[str, float]:
    """Per loss: the norm of d(sum of its term over the batch's digit targets)/d logits, the
    batch being `problems` (one forward of `model`, fp32); "digit_targets" too."""
    batch = batch_tensors(problems, tokenizer)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.float()
    logits = logits.transpose(0, 1).contiguous()  # [s, b, V], as Megatron's output layer
    vocab = digit_vocab_from_tokenizer(tokenizer)
    labels = batch["labels"]
    norms = {
        loss: _term_gradient_norm(
            labels, logits, NumericalLossConfig(loss=loss, vocab=vocab, ignore_index=IGNORE)
        )
        for loss in losses
    }
    norms["digit_targets"] = float(torch.isin(labels, torch.tensor(vocab.digit_ids)).sum())
    return norms


def matched_weights(
    hf_model: str,
    orders: Dict[int, List[Problem]],
    batch: int,
    loss: str = "del",
    alpha: float = 0.1,
    control: str = "digit_ce",
) -> Dict[int, Dict[str, float]]:
    """Per seed: the gradient norms of `loss` and `control` on the first `batch` problems of
    that seed's training order, and the control's weight whose extra gradient matches
    `loss` at `alpha` in norm."""
    from .score import load

    model, tokenizer = load(hf_model)
    out = {}
    for seed, problems in orders.items():
        norms = gradient_norms(model, tokenizer, problems[:batch], (loss, control))
        out[seed] = {**norms, "matched_weight": alpha * norms[loss] / norms[control]}
    return out
