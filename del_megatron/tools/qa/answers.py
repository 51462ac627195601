"""Which digits of a worked solution a model computes, restates or copies (GSM8K's format:
calculator annotations `<<48/2=24>>24` and a final `#### 72`), and the final answer.

The classes (docs/results.md defines them; a number's digits share its class):

- COMPUTED: a digit of an annotation's result (after the last `=` inside `<< >>`) whose value
  has not appeared as a number earlier in the question or in the answer so far;
- RESTATED: every other annotation result, the number right after an annotation's `>>` (with
  its minus sign: `<<...=-30>>-30`), and everything after `####`;
- COPIED: a number whose value appears as a number in the question;
- OTHER: the rest (results written outside annotations, "X = $26", included).

Values compare as numbers are written for people: "1,000.50" is "1000.5", ".75" is "0.75".
"""

from __future__ import annotations

import re
from typing import List, Optional

COPIED, COMPUTED, RESTATED, OTHER = "copied", "computed", "restated", "other"
CLASSES = (COPIED, COMPUTED, RESTATED, OTHER)

# A number as written: digits with thousands commas and a decimal part ("1,000.50"), or a
# decimal part alone (".75", not the fraction of "3.75").
_NUMBER = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?|(?<![\d.])\.\d+")
# A calculator annotation; its result is what follows the last "=" inside << >>.
_ANNOTATION = re.compile(r"<<([^<>]*)>>")
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _value(number: str) -> str:
    """A number's value as text: no thousands commas, no leading or trailing decimal zeros
    ("0.50" and ".5" are both ".5")."""
    text = number.replace(",", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text.lstrip("0") or "0"


def _annotation_spans(answer: str):
    """(result spans, starts of what follows each annotation): a result span is [start, end)
    of the text after the last "=" inside an annotation (none without "=")."""
    results, after = [], set()
    for match in _ANNOTATION.finditer(answer):
        body_start = match.start(1)
        equals = match.group(1).rfind("=")
        if equals >= 0:
            results.append((body_start + equals + 1, match.end(1)))
        after.add(match.end())
    return results, after


def digit_classes(question: str, answer: str) -> List[Optional[str]]:
    """Per character of `answer`: None where it is not a digit, else its number's class
    (COMPUTED, RESTATED, COPIED or OTHER; the module's docstring defines them)."""
    classes: List[Optional[str]] = [None] * len(answer)
    in_question = {_value(m.group()) for m in _NUMBER.finditer(question)}
    seen = set(in_question)  # values written so far: the question's, then the answer's
    results, after_annotation = _annotation_spans(answer)
    final = answer.rfind("####")
    for match in _NUMBER.finditer(answer):
        value, start = _value(match.group()), match.start()
        in_result = any(lo <= start < hi for lo, hi in results)
        signed = start > 0 and answer[start - 1] == "-"
        if final >= 0 and start > final:
            cls = RESTATED
        elif in_result:
            cls = RESTATED if value in seen else COMPUTED
        elif start in after_annotation or (start - 1 in after_annotation and signed):
            cls = RESTATED  # right after ">>", its minus sign too ("<<...=-30>>-30")
        else:
            cls = COPIED if value in in_question else OTHER
        seen.add(value)
        for i in range(start, match.end()):
            if answer[i].isdigit():
                classes[i] = cls
    return classes


def final_answer(text: str) -> Optional[str]:
    """The value after the first `####` in `text` (commas and trailing decimal zeros dropped,
    the sign kept), or None."""
    match = _FINAL.search(text)
    if match is None:
        return None
    number = match.group(1)
    sign = "-" if number.startswith("-") else ""
    value = _value(number.lstrip("-"))
    return sign + ("0" + value if value.startswith(".") else value)
