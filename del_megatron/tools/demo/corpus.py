"""A seeded number-rich corpus: arithmetic and word problems with integers and decimals, from
one of two distributions: the base one a model is pretrained on, and a continued one, half of
it shifted to longer operands and more decimal places (what `compare --continue-from-base`
continues on, and scores on)."""

from __future__ import annotations

import json
import random
from typing import Callable, Dict, Iterator, List, NamedTuple, Tuple

NAMES = ["Ana", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "stamps", "marbles", "cards"]


def _fmt(value: float, decimals: int) -> str:
    return f"{value:.{decimals}f}" if decimals else str(int(round(value)))


class Ranges(NamedTuple):
    """What a distribution's problems draw their numbers from (inclusive integer bounds)."""

    operands: Tuple[int, int]  # of addition and subtraction
    factors: Tuple[Tuple[int, int], Tuple[int, int]]
    places: Tuple[int, ...]  # decimal places of the decimal problems
    decimal_max: float  # their operands are uniform in [0, decimal_max]
    items: Tuple[int, int]  # of the word problems


# The base distribution's, and the shifted one's: longer operands (three digits, two-digit
# factors), decimals of two and three places up to 100, more items.
BASE_RANGES = Ranges((0, 99), ((0, 12), (0, 9)), (1, 2), 10.0, (1, 50))
SHIFTED_RANGES = Ranges((100, 999), ((10, 99), (2, 9)), (2, 3), 100.0, (10, 500))


def _draw(rng: random.Random, ranges: Ranges) -> Dict[str, str]:
    """One problem with numbers from `ranges`: {"prompt": ..., "answer": ...}; the text is
    prompt + answer."""
    kind = rng.choice(["add", "sub", "mul", "dec_add", "dec_sub", "word"])
    if kind in ("add", "sub"):
        a, b = rng.randint(*ranges.operands), rng.randint(*ranges.operands)
        if kind == "sub":
            a, b = max(a, b), min(a, b)
            return {"prompt": f"Q: {a} - {b} = ", "answer": str(a - b)}
        return {"prompt": f"Q: {a} + {b} = ", "answer": str(a + b)}
    if kind == "mul":
        a, b = (rng.randint(*bounds) for bounds in ranges.factors)
        return {"prompt": f"Q: {a} * {b} = ", "answer": str(a * b)}
    if kind in ("dec_add", "dec_sub"):
        d = rng.choice(ranges.places)
        a = round(rng.uniform(0, ranges.decimal_max), d)
        b = round(rng.uniform(0, ranges.decimal_max), d)
        if kind == "dec_sub":
            a, b = max(a, b), min(a, b)
            return {"prompt": f"Q: {_fmt(a, d)} - {_fmt(b, d)} = ", "answer": _fmt(a - b, d)}
        return {"prompt": f"Q: {_fmt(a, d)} + {_fmt(b, d)} = ", "answer": _fmt(a + b, d)}
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(*ranges.items), rng.randint(*ranges.items)
    return {
        "prompt": f"Q: {name} has {a} {item} and gets {b} more. How many {item}? A: ",
        "answer": str(a + b),
    }


def problem(rng: random.Random) -> Dict[str, str]:
    """One problem of the base distribution."""
    return _draw(rng, BASE_RANGES)


def shifted_problem(rng: random.Random) -> Dict[str, str]:
    """One problem of the shifted distribution."""
    return _draw(rng, SHIFTED_RANGES)


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
