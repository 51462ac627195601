"""A seeded number-rich corpus: arithmetic and word problems with integers and decimals, from
one of two distributions: the base one a model is pretrained on, and a continued one, half of
it shifted to longer operands and more decimal places (what `compare --continue-from-base`
continues on, and scores on)."""

from __future__ import annotations

import json
import random
from typing import Callable, Dict, Iterator, List, Tuple

NAMES = ["Ana", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "stamps", "marbles", "cards"]


def _fmt(value: float, decimals: int) -> str:
    return f"{value:.{decimals}f}" if decimals else str(int(round(value)))


def problem(rng: random.Random) -> Dict[str, str]:
    """One problem: {"prompt": ..., "answer": ...}; the text is prompt + answer."""
    kind = rng.choice(["add", "sub", "mul", "dec_add", "dec_sub", "word"])
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"prompt": f"Q: {a} + {b} = ", "answer": str(a + b)}
    if kind == "sub":
        a, b = sorted((rng.randint(0, 99), rng.randint(0, 99)), reverse=True)
        return {"prompt": f"Q: {a} - {b} = ", "answer": str(a - b)}
    if kind == "mul":
        a, b = rng.randint(0, 12), rng.randint(0, 9)
        return {"prompt": f"Q: {a} * {b} = ", "answer": str(a * b)}
    if kind in ("dec_add", "dec_sub"):
        d = rng.choice([1, 2])
        a, b = round(rng.uniform(0, 10), d), round(rng.uniform(0, 10), d)
        if kind == "dec_sub":
            a, b = max(a, b), min(a, b)
            return {"prompt": f"Q: {_fmt(a, d)} - {_fmt(b, d)} = ", "answer": _fmt(a - b, d)}
        return {"prompt": f"Q: {_fmt(a, d)} + {_fmt(b, d)} = ", "answer": _fmt(a + b, d)}
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    return {
        "prompt": f"Q: {name} has {a} {item} and gets {b} more. How many {item}? A: ",
        "answer": str(a + b),
    }


def shifted_problem(rng: random.Random) -> Dict[str, str]:
    """One problem of the shifted distribution: the base's templates with longer operands
    (three digits, two-digit factors) and decimals of two and three places up to 100."""
    kind = rng.choice(["add", "sub", "mul", "dec_add", "dec_sub", "word"])
    if kind in ("add", "sub"):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if kind == "sub":
            a, b = max(a, b), min(a, b)
            return {"prompt": f"Q: {a} - {b} = ", "answer": str(a - b)}
        return {"prompt": f"Q: {a} + {b} = ", "answer": str(a + b)}
    if kind == "mul":
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        return {"prompt": f"Q: {a} * {b} = ", "answer": str(a * b)}
    if kind in ("dec_add", "dec_sub"):
        d = rng.choice([2, 3])
        a, b = round(rng.uniform(0, 100), d), round(rng.uniform(0, 100), d)
        if kind == "dec_sub":
            a, b = max(a, b), min(a, b)
            return {"prompt": f"Q: {_fmt(a, d)} - {_fmt(b, d)} = ", "answer": _fmt(a - b, d)}
        return {"prompt": f"Q: {_fmt(a, d)} + {_fmt(b, d)} = ", "answer": _fmt(a + b, d)}
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(10, 500), rng.randint(10, 500)
    return {
        "prompt": f"Q: {name} has {a} {item} and gets {b} more. How many {item}? A: ",
        "answer": str(a + b),
    }


def continued_problem(rng: random.Random) -> Dict[str, str]:
    """One document of the continued corpus: a shifted problem, or (half the time) a base one,
    as continued-pretraining recipes replay the original data."""
    return shifted_problem(rng) if rng.random() < 0.5 else problem(rng)


# The corpus distributions by name: pretraining's, and continued pretraining's; each as (the
# training documents, the held-out problems). Continued pretraining is scored on the shifted
# problems only.
BASE, CONTINUED = "base", "continued"
Draw = Callable[[random.Random], Dict[str, str]]
DISTRIBUTIONS: Dict[str, Tuple[Draw, Draw]] = {
    BASE: (problem, problem),
    CONTINUED: (continued_problem, shifted_problem),
}


def synthetic(
    n: int, seed: int, distribution: str = BASE, held_out: bool = False
) -> List[Dict[str, str]]:
    """n problems of `distribution` (DISTRIBUTIONS): its training documents, or its held-out
    problems; the same for the same seed."""
    rng = random.Random(seed)
    draw = DISTRIBUTIONS[distribution][held_out]
    return [draw(rng) for _ in range(n)]


def read_jsonl(path: str) -> Iterator[str]:
    """Texts of a JSONL corpus: each line an object with a "text" string."""
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text:
                raise ValueError(f'{path}:{line_no}: no "text" string in this JSONL line')
            yield text
