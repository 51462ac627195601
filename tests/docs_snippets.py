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


PACKAGE = os.path.join(ROOT, "del_megatron")
# The first word of a docstring example that is a command line (the others are Python).
COMMANDS = ("torchrun", "python", "del-megatron", "cd", "bash")


def docstring_examples() -> List[tuple]:
    """(where, kind, text) of every example in a docstring of the package: a block indented
    four spaces under the docstring's text that is command lines (kind "command", first word in
    COMMANDS) or Python that parses and calls or imports something (kind "python"); formulas
    and argument lists indented the same way are neither."""
    import ast

    out = []
    for folder, _, files in sorted(os.walk(PACKAGE)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            tree = ast.parse(read(os.path.relpath(path, ROOT)))
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                    continue
                where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'name', 'module')}"
                for block in _indented_blocks(ast.get_docstring(node) or ""):
                    first = block.split()[0]
                    if first in COMMANDS:
                        out.append((where, "command", block))
                    elif _calls_or_imports(block):
                        out.append((where, "python", block))
    return out


def _indented_blocks(doc: str) -> List[str]:
    """Runs of lines indented four spaces, blank lines inside a run kept."""
    blocks, current = [], []
    for line in doc.splitlines() + ["end"]:
        if line.startswith("    ") or (current and not line.strip()):
            current.append(line[4:])
        elif current:
            blocks.append("\n".join(current).strip("\n"))
            current = []
    return blocks


def _calls_or_imports(block: str) -> bool:
    import ast

    try:
        tree = ast.parse(block)
    except SyntaxError:
        return False
    return any(isinstance(n, (ast.Call, ast.Import, ast.ImportFrom)) for n in ast.walk(tree))


def example_commands(block: str) -> List[List[str]]:
    """The command lines of a docstring example, continuation lines joined, with its
    placeholders dropped: `...`, `<...>` phrases, `[...]` options and ALL_CAPS words."""
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        line = re.sub(r"<[^>]*>|\[[^\]]*\]", " ", line)
        words = [w for w in shlex.split(line, comments=True) if w != "..."]
        words = [w for w in words if not re.fullmatch(r"[A-Z][A-Z_]+(\.\w+)?", w)]
        if words:
            commands.append(words)
    return commands
