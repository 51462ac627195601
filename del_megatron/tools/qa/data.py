"""Question/answer JSONL in, Megatron-Bridge's fine-tuning layout out.

A problem is one JSON line with a question and an answer field ("question" and "answer", as in
GSM8K). A model sees `PROMPT` followed by a space and the answer; the loss is on the answer's
tokens only (Bridge's GPTSFTDataset, answer_only_loss), as the DEL paper trains on responses."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any, List, Sequence

PROMPT = "Question: {question}\nAnswer:"
SEPARATOR = " "  # between the prompt and the answer (Bridge's prompt/completion separator)
TRAINING, VALIDATION = "training.jsonl", "validation.jsonl"


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str

    @property
    def prompt(self) -> str:
        return PROMPT.format(question=self.question)

    @property
    def text(self) -> str:
        """What the model is trained and teacher-forced on."""
        return self.prompt + SEPARATOR + self.answer


def read_problems(
    path: str, question_key: str = "question", answer_key: str = "answer"
) -> List[Problem]:
    """The problems of a JSONL file, in file order; ValueError naming the line that lacks a
    field."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in (question_key, answer_key) if not isinstance(row.get(k), str)]
            if missing:
                raise ValueError(
                    f"{path}:{number} has no text field {missing[0]!r}: each line needs "
                    f"{question_key!r} and {answer_key!r} (--question-key/--answer-key rename them)"
                )
            problems.append(Problem(row[question_key], row[answer_key]))
    if not problems:
        raise ValueError(f"{path} holds no problems")
    return problems


def fitting(problems: Sequence[Problem], tokenizer: Any, seq_length: int) -> List[Problem]:
    """The problems whose prompt and answer (and the end-of-text token) fit `seq_length`."""
    lengths = [len(tokenizer(p.text, add_special_tokens=False)["input_ids"]) for p in problems]
    return [p for p, n in zip(problems, lengths, strict=True) if n + 1 <= seq_length]


def training_order(train: Sequence[Problem], seed: int) -> List[Problem]:
    """`train` shuffled with `seed`: a run's data order."""
    order = list(train)
    random.Random(seed).shuffle(order)
    return order


def write_finetuning_root(
    root: str, train: Sequence[Problem], validation: Sequence[Problem], seed: int
) -> str:
    """Bridge's local fine-tuning folder ({"input", "output"} lines): `train` in the seed's
    training_order and `validation` as given. Returns `root`."""
    order = training_order(train, seed)
    os.makedirs(root, exist_ok=True)
    for name, problems in ((TRAINING, order), (VALIDATION, validation)):
        partial = os.path.join(root, f"{name}.{os.getpid()}")
        with open(partial, "w", encoding="utf-8") as f:
            for p in problems:
                f.write(json.dumps({"input": p.prompt, "output": p.answer}) + "\n")
        os.replace(partial, os.path.join(root, name))
    return root
