"""Scoring a demo model on held-out problems: per problem, then summarized over the first n
(the learning curve's fixed subset) or all of them (the end of a run)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

import del_megatron as dm

from . import digit_shape
from .stats import ratio_standard_error, standard_error
from .text_tokenizer import TextTokenizer

EVAL_BATCH = 64  # sequences an evaluation forward
ANSWER_TOKENS = 12  # the most tokens greedy decoding writes for an answer
SAMPLES = 8  # answers kept in metrics.json to read
# metrics.json keys of the held-out metrics
METRIC_KEYS = ("digit_accuracy", "exact_accuracy", "mean_abs_log10_error")
# ... and of those scored at the end of a run only (not on the learning curve)
END_KEYS = (
    "length_accuracy",
    "digit_entropy",
    "target_probability",
    "expected_distance",
    "calibration_error",
    "distance_profile",
)


@dataclass
class Scores:
    """Per held-out problem, in the order given: answer digits predicted right (teacher-forced,
    digit_hits) and answer digits, exact greedy answer (0/1), |log10 error| of the greedy answer;
    teacher-forced, the answer's number tokens whose prediction among the number tokens has the
    label's number of digits, and the digit distributions' digit_shape.sums
    (digit_distributions)."""

    digits_correct: List[int] = field(default_factory=list)
    digits_total: List[int] = field(default_factory=list)
    exact: List[int] = field(default_factory=list)
    log_error: List[float] = field(default_factory=list)
    outputs: List[str] = field(default_factory=list)
    length_correct: List[int] = field(default_factory=list)
    number_tokens: List[int] = field(default_factory=list)
    shape: List[Dict[str, object]] = field(default_factory=list)


def _full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, V] whole-vocab logits (all-gathered over TP) of [b, s] tokens."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    local = model(tokens, positions, None)  # [b, s, V/tp]
    return gather_from_tensor_model_parallel_region(local)


def _parse_number(text: str) -> Optional[float]:
    match = re.match(r"\s*(-?\d+(?:\.\d+)?)", text)
    return float(match.group(1)) if match else None


def log10_error(output: str, answer: str) -> float:
    """|log10(1 + |predicted|) - log10(1 + |true|)|; an answer that does not parse counts as 0."""
    value, truth = _parse_number(output), float(answer)
    guess = 0.0 if value is None else value
    return abs(math.log10(1 + abs(guess)) - math.log10(1 + abs(truth)))


def _right_padded(rows: List[List[int]], pad: int, width: int) -> torch.Tensor:
    """[len(rows), width] tokens, each row's ids first and `pad` after them. Causal attention
    keeps a row's real positions blind to the padding after them, so their logits are the
    unpadded sequence's."""
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def digit_hits(targets: List[int], guesses: List[int], texts: Dict[int, str]) -> Tuple[int, int]:
    """(digits guessed right, digits) of an answer's number tokens, teacher-forced: the k-th
    digit of a target number token is right when the token predicted there is a number token
    whose k-th digit it is (`texts`: the number tokens' text by id). With one digit a token,
    a digit is right when its token is."""
    correct = total = 0
    for target, guess in zip(targets, guesses, strict=True):
        want = texts.get(target)
        if want is None:
            continue
        got = texts.get(guess, "")
        total += len(want)
        correct += sum(a == b for a, b in zip(want, got, strict=False))
    return correct, total


def digit_distributions(
    logits: torch.Tensor, labels: torch.Tensor, vocab: dm.DigitVocab
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Per row of labels [b, s] (-100 but where scored; logits [b, s, V] predict them): number
    tokens whose argmax among the number tokens has the label's number of digits, number
    tokens, and digit_shape.sums over their digits of softmax(z^(j)), the "length" rule's slot
    logits (docs/DEL.md; one digit a token: the ten digit logits)."""
    ids = torch.tensor([i for i, _ in vocab.number_tokens()])
    digits = torch.tensor([len(text) for _, text in vocab.number_tokens()])
    length_of = torch.zeros(logits.size(-1), dtype=torch.long)
    length_of[ids] = digits
    target = labels.clamp(min=0)
    is_number = (labels >= 0) & (length_of[target] > 0)
    guess = digits[logits[..., ids].argmax(-1)]
    length_hits = (is_number & (guess == length_of[target])).sum(-1)
    cfg = dm.NumericalLossConfig(loss="ce", vocab=vocab, slot_logits="length")
    parts = dm.loss_parts(labels, logits.transpose(0, 1).float(), cfg, validate=False)
    z, digit = parts.digit_logits, parts.digit
    if not vocab.chunked:  # one slot a position
        z, digit = z.unsqueeze(-2), digit.unsqueeze(-1)
    held = torch.arange(z.size(-2)) < parts.digit_count.unsqueeze(-1)  # [b, s, S]
    row = torch.arange(labels.size(0)).view(-1, 1, 1).expand_as(held)
    log_p = torch.log_softmax(z[held].double(), dim=-1)  # [N, 10]
    shape = digit_shape.sums(log_p, digit[held], row[held], labels.size(0))
    return length_hits, is_number.sum(-1), shape


def text_ce(model, tok: TextTokenizer, texts: List[str]) -> Tuple[float, float]:
    """(mean next-token CE in nats over every token of `texts` but each one's first, its
    standard error with texts as the units): how well the model still models a distribution."""
    rows = [tok.encode(text) + [tok.eod] for text in texts]
    sums, counts = [], []
    for start in range(0, len(rows), EVAL_BATCH):
        batch = rows[start : start + EVAL_BATCH]
        full = _right_padded(batch, tok.eod, max(map(len, batch)))
        logits = _full_logits(model, full).double()  # [b, s, V]
        labels = torch.full_like(full, -100)
        for i, ids in enumerate(batch):
            labels[i, : len(ids) - 1] = full[i, 1 : len(ids)]
        ce = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
        )
        sums += ce.sum(-1).tolist()
        counts += (labels >= 0).sum(-1).tolist()
    return sum(sums) / max(sum(counts), 1), ratio_standard_error(sums, counts)


@torch.no_grad()
def base_ce(model, tok: TextTokenizer, problems: List[dict]) -> Tuple[float, float]:
    """text_ce over the problems' whole texts (prompt and answer); leaves the model in train
    mode."""
    model.eval()
    try:
        return text_ce(model, tok, [p["prompt"] + p["answer"] for p in problems])
    finally:
        model.train()


@torch.no_grad()
def score(model, tok: TextTokenizer, problems: List[dict], vocab: dm.DigitVocab) -> Scores:
    """Teacher-forced digit hits on each answer and the greedy-decoded answer of each problem.
    Problems go in batches of similar length, right-padded; decoding drops each answer once it
    has ended. Leaves the model in train mode; draws no random numbers, so training goes on as
    it would have."""
    model.eval()
    n = len(problems)
    texts = dict(vocab.number_tokens())
    scores = Scores([0] * n, [0] * n, [0] * n, [0.0] * n, [""] * n)
    scores.length_correct, scores.number_tokens = [0] * n, [0] * n
    scores.shape = [{}] * n
    prompts = [tok.encode(p["prompt"]) for p in problems]
    answers = [tok.encode(p["answer"]) for p in problems]
    order = sorted(range(n), key=lambda i: len(prompts[i]) + len(answers[i]))
    for start in range(0, n, EVAL_BATCH):
        rows = order[start : start + EVAL_BATCH]
        seqs = [prompts[i] + answers[i] for i in rows]
        full = _right_padded(seqs, tok.eod, max(map(len, seqs)))
        logits = _full_logits(model, full)  # [b, s, V]
        predicted = logits.argmax(-1)  # [b, s]
        labels = torch.full_like(full, -100)  # the answers' tokens, where they are predicted
        for row, i in enumerate(rows):
            begin, end = len(prompts[i]), len(seqs[row])
            targets = full[row, begin:end].tolist()
            guesses = predicted[row, begin - 1 : end - 1].tolist()
            scores.digits_correct[i], scores.digits_total[i] = digit_hits(targets, guesses, texts)
            labels[row, begin - 1 : end - 1] = full[row, begin:end]
        hits, numbers, shape = digit_distributions(logits, labels, vocab)
        shape_rows = digit_shape.problem_rows(shape)
        for row, i in enumerate(rows):
            scores.length_correct[i], scores.number_tokens[i] = int(hits[row]), int(numbers[row])
            scores.shape[i] = shape_rows[row]
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    for start in range(0, n, EVAL_BATCH):
        rows = order[start : start + EVAL_BATCH]
        lengths = torch.tensor([len(prompts[i]) for i in rows])
        width = int(lengths.max()) + ANSWER_TOKENS
        tokens = _right_padded([prompts[i] for i in rows], tok.eod, width)
        active = torch.arange(len(rows))  # answers not ended yet
        for _ in range(ANSWER_TOKENS):
            upto = int(lengths[active].max())
            logits = _full_logits(model, tokens[active, :upto])  # [a, upto, V]
            next_ids = logits[torch.arange(len(active)), lengths[active] - 1].argmax(-1)
            tokens[active, lengths[active]] = next_ids
            lengths[active] += 1
            active = active[next_ids != tok.eod]
            if len(active) == 0:
                break
        for row, i in enumerate(rows):
            generated = tokens[row, len(prompts[i]) : int(lengths[row])].tolist()
            text = tok.decode([t for t in generated if t != tok.eod])
            scores.outputs[i] = text
            scores.exact[i] = int(text.strip() == problems[i]["answer"])
            scores.log_error[i] = log10_error(text, problems[i]["answer"])
    model.train()
    return scores


def summarize(scores: Scores, problems: List[dict], first: Optional[int] = None) -> Dict:
    """The held-out metrics over the first `first` problems (all when None), each with its
    standard error over the problems (digit accuracy with problems as the units: the digits of
    one answer are not independent), and a few answers to read."""
    k = len(scores.exact) if first is None else min(first, len(scores.exact))
    correct, total = scores.digits_correct[:k], scores.digits_total[:k]
    exact, log_error = scores.exact[:k], scores.log_error[:k]
    end: Dict[str, float] = {}
    standard_errors: Dict[str, float] = {}
    if scores.number_tokens:
        lengths, numbers = scores.length_correct[:k], scores.number_tokens[:k]
        end["length_accuracy"] = sum(lengths) / max(sum(numbers), 1)
        standard_errors["length_accuracy"] = ratio_standard_error(lengths, numbers)
        end.update(digit_shape.summarize(scores.shape[:k]))
        standard_errors.update(end.pop("standard_errors"))
    return {
        "digit_accuracy": sum(correct) / max(sum(total), 1),
        "exact_accuracy": sum(exact) / max(k, 1),
        "mean_abs_log10_error": sum(log_error) / max(k, 1),
        "eval_problems": k,
        "standard_errors": {
            "digit_accuracy": ratio_standard_error(correct, total),
            "exact_accuracy": standard_error(exact),
            "mean_abs_log10_error": standard_error(log_error),
            **standard_errors,
        },
        **end,
        "samples": [
            {"prompt": p["prompt"], "answer": p["answer"], "output": out}
            for p, out in zip(problems[:SAMPLES], scores.outputs[:SAMPLES], strict=False)
        ],
    }


def curve_point(step: int, summary: Dict, train_ce: float) -> Dict:
    """One point of a run's learning curve: the held-out metrics of `summary` at `step`, and the
    mean training CE since the previous point."""
    point = {"step": step, "problems": summary["eval_problems"], "train_ce": train_ce}
    point.update({key: summary[key] for key in METRIC_KEYS})
    return point


def curve_steps(steps: int, points: int) -> List[int]:
    """The steps at which a run of `steps` steps scores its curve: `points` evenly spaced steps,
    the last one `steps` (fewer when steps < points; none when points is 0)."""
    if points <= 0:
        return []
    return sorted({max(1, round(steps * k / points)) for k in range(1, points + 1)})
