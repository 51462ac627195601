"""Which digits of a worked solution a model copies and which it computes (GSM8K's format:
calculator annotations `<<48/2=24>>24` and a final `#### 72`), and the final answer."""

from __future__ import annotations

import re
from typing import List, Optional

COPIED, COMPUTED, OTHER = "copied", "computed", "other"
CLASSES = (COPIED, COMPUTED, OTHER)

# A number as written: digits with thousands commas and a decimal part ("1,000.50").
_NUMBER = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?")
# The result of a calculator annotation: after the last "=" inside << >>.
_ANNOTATION_RESULT = re.compile(r"<<[^<>]*=([^<>=]*)>>")
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _value(number: str) -> str:
    """A number's value as text: no thousands commas, no trailing decimal zeros."""
    text = number.replace(",", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text.lstrip("0") or "0"


def digit_classes(question: str, answer: str) -> List[Optional[str]]:
    """Per character of `answer`: None where it is not a digit, else COMPUTED (a digit of an
    annotation's result after `=`, or of the final `#### N`), COPIED (a digit of a number whose
    value appears as a number in `question`), or OTHER."""
    classes: List[Optional[str]] = [None] * len(answer)
    computed = [False] * len(answer)
    for match in _ANNOTATION_RESULT.finditer(answer):
        for i in range(match.start(1), match.end(1)):
            computed[i] = True
    final = answer.rfind("####")
    if final >= 0:
        for i in range(final, len(answer)):
            computed[i] = True
    in_question = {_value(m.group()) for m in _NUMBER.finditer(question)}
    for match in _NUMBER.finditer(answer):
        copied = _value(match.group()) in in_question
        for i in range(match.start(), match.end()):
            if answer[i].isdigit():
                classes[i] = COMPUTED if computed[i] else COPIED if copied else OTHER
    return classes


def final_answer(text: str) -> Optional[str]:
    """The value after the first `####` in `text` (commas and trailing decimal zeros dropped,
    the sign kept), or None."""
    match = _FINAL.search(text)
    if match is None:
        return None
    number = match.group(1)
    sign = "-" if number.startswith("-") else ""
    return sign + _value(number.lstrip("-"))
