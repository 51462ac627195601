"""Scoring a Hugging Face model on held-out problems, as trained (data.Problem.text):

- teacher-forced, at every digit target of the answers: accuracy (the model's top token over
  the whole vocabulary is the target digit), by class (answers.digit_classes: copied from the
  question, computed, other), the share whose top token is no digit at all and the mean
  probability of the ten digits together (digit_mass), and the shape of the distribution over
  the ten digits (demo.digit_shape: entropy, p(target), expected distance, calibration error);
- greedy decoding from the prompt: the final answer (`#### N`) exact-match accuracy.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from ...digits.vocab import digit_vocab_from_tokenizer
from ..demo.digit_shape import problem_rows, summarize, sums
from .answers import CLASSES, digit_classes, final_answer
from .data import SEPARATOR, Problem

MAX_NEW_TOKENS = 320
STOP_STRINGS = ("\nQuestion:", "\n\n")


def load(hf_model: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_model)
    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32).eval()
    return model, tokenizer


def _digit_targets(problem: Problem, tokenizer, digit_of: Dict[int, int]):
    """(token ids [T], [(position, digit, class)]) of the answer's single-digit targets: the
    token at `position` + 1 is the digit, predicted from `position`."""
    encoded = tokenizer(problem.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    start = len(problem.prompt) + len(SEPARATOR)
    classes = digit_classes(problem.question, problem.answer)
    targets = []
    for position in range(1, len(ids)):
        digit = digit_of.get(ids[position])
        first = offsets[position][0]
        if digit is None or first < start:
            continue
        # a digit token may carry a leading space in its offsets: its digit's character
        last = offsets[position][1] - 1
        targets.append((position - 1, digit, classes[last - start]))
    return torch.tensor(ids), targets


@torch.no_grad()
def teacher_forced(model, tokenizer, problems: Sequence[Problem], batch: int = 8) -> dict:
    """Digit accuracy (all and per class) and the shape metrics over the answers' digit
    targets of `problems`; per-problem sums under "problems" (for intervals over problems)."""
    vocab = digit_vocab_from_tokenizer(tokenizer)
    digit_ids = torch.tensor(vocab.digit_ids)
    digit_of = {token: digit for digit, token in enumerate(vocab.digit_ids)}
    rows: List[dict] = []
    for first in range(0, len(problems), batch):
        chunk = problems[first : first + batch]
        encoded = [_digit_targets(p, tokenizer, digit_of) for p in chunk]
        length = max(len(ids) for ids, _ in encoded)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        tokens = torch.full((len(chunk), length), pad)
        mask = torch.zeros((len(chunk), length), dtype=torch.long)
        for i, (ids, _) in enumerate(encoded):
            tokens[i, : len(ids)], mask[i, : len(ids)] = ids, 1
        logits = model(input_ids=tokens, attention_mask=mask).logits.float()
        for i, (_, targets) in enumerate(encoded):
            row = {f"{c}_{k}": 0.0 for c in ("all",) + CLASSES for k in ("count", "correct")}
            position = torch.tensor([t[0] for t in targets], dtype=torch.long)
            digit = torch.tensor([t[1] for t in targets], dtype=torch.long)
            at = logits[i, position]  # [N, V]
            top = at.argmax(-1)
            correct = top == digit_ids[digit]
            row["top_not_digit"] = float((~torch.isin(top, digit_ids)).sum())
            digit_logits = at[:, digit_ids].double()  # [N, 10]
            in_digits = digit_logits.logsumexp(-1) - at.double().logsumexp(-1)
            row["digit_mass"] = float(in_digits.exp().sum())
            for (_, _, cls), ok in zip(targets, correct.tolist(), strict=True):
                for name in ("all", cls):
                    row[f"{name}_count"] += 1
                    row[f"{name}_correct"] += float(ok)
            log_probs = torch.log_softmax(digit_logits, -1)
            shape = problem_rows(sums(log_probs, digit, torch.zeros_like(digit), 1))[0]
            rows.append({**row, **shape})
    out = {f"digit_acc_{c}": _ratio(rows, c) for c in ("all",) + CLASSES}
    out.update(
        {f"digit_targets_{c}": sum(r[f"{c}_count"] for r in rows) for c in ("all",) + CLASSES}
    )
    count = max(sum(r["all_count"] for r in rows), 1.0)
    out["top_not_digit"] = sum(r["top_not_digit"] for r in rows) / count
    out["digit_mass"] = sum(r["digit_mass"] for r in rows) / count
    shape = summarize(rows)
    for key in ("digit_entropy", "target_probability", "expected_distance", "calibration_error"):
        out[key] = shape[key]
    out["distance_profile"] = shape["distance_profile"]
    out["calibration_bins"] = shape["calibration_bins"]
    out["problems"] = rows
    return out


def _ratio(rows: Sequence[dict], name: str) -> float:
    count = sum(r[f"{name}_count"] for r in rows)
    return sum(r[f"{name}_correct"] for r in rows) / count if count else float("nan")


@torch.no_grad()
def greedy(model, tokenizer, problems: Sequence[Problem], batch: int = 16) -> dict:
    """Greedy decoding from each prompt (up to MAX_NEW_TOKENS, stopping at STOP_STRINGS or the
    end-of-text token); final-answer exact match against the `#### N` of the answer."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:  # left padding is masked out: any token will do
        tokenizer.pad_token = tokenizer.eos_token
    pad = tokenizer.pad_token_id
    correct: List[bool] = []
    for first in range(0, len(problems), batch):
        chunk = problems[first : first + batch]
        encoded = tokenizer(
            [p.prompt for p in chunk], add_special_tokens=False, return_tensors="pt", padding=True
        )
        generated = model.generate(
            **encoded,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            stop_strings=list(STOP_STRINGS),
            tokenizer=tokenizer,
            pad_token_id=pad,
        )
        texts = tokenizer.batch_decode(
            generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
        )
        for p, text in zip(chunk, texts, strict=True):
            wanted = final_answer(p.answer)
            correct.append(wanted is not None and final_answer(text) == wanted)
    return {
        "final_answer_acc": sum(correct) / len(correct) if correct else float("nan"),
        "final_answer_n": len(correct),
        "final_answer_correct": correct,
    }


def score(hf_model: str, problems: Sequence[Problem], greedy_problems: int) -> dict:
    """teacher_forced over `problems` and greedy over the first `greedy_problems` of them (the
    threads: torch's choice, or OMP_NUM_THREADS, which compare-qa's --threads sets)."""
    model, tokenizer = load(hf_model)
    out = teacher_forced(model, tokenizer, problems)
    out.update(greedy(model, tokenizer, problems[:greedy_problems]))
    return out
