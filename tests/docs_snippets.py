"""The code a user copies from README.md and docs/api.md: its Python blocks and its command
lines, read from the files as they are (tests/test_docs_snippets.py runs them)."""

from __future__ import annotations

import os
import re
import shlex
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "docs/api.md")
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)


def read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
        return fh.read()


def python_blocks(doc: str) -> List[str]:
    """Every ```python block of `doc`, dedented."""
    out = []
    for indent, body in FENCE.findall(read(doc)):
        out.append("\n".join(line[len(indent) :] for line in body.splitlines()) + "\n")
    return out


def command_lines(doc: str) -> List[List[str]]:
    """Every command of `doc`'s indented (4-space) code blocks, continuation lines joined,
    split as the shell splits it, comments dropped."""
    commands, current = [], ""
    in_fence = False
    for line in read(doc).splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or not line.startswith("    ") or not line.strip():
            if current:
                commands.append(current)
                current = ""
            continue
        text = line.strip()
        current += " " + text[:-1] if text.endswith("\\") else " " + text
        if not text.endswith("\\"):
            commands.append(current)
            current = ""
    return [shlex.split(c, comments=True) for c in commands if c.strip()]


def substitute(argv: List[str], paths: Dict[str, str]) -> List[str]:
    """argv with the docs' example paths replaced by files the tests have."""
    return [paths.get(a, a) for a in argv]
