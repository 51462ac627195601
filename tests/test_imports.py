"""The package's import graph: no cycle, and the math never imports the framework glue.

`python -m tests.test_imports` prints the graph (module-level imports; `~>` marks imports made
inside a function, at call time)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "del_megatron"
ROOT = "del_megatron"
# The math and the vocab-parallel primitive: torch only, no Megatron glue, demo or CLI.
MATH = ("vocab", "sequence", "kernels", "numbers", "heads", "reference", "tokenizers", "loss")
GLUE = ("megatron", "cpu", "demo", "cli", "preflight")
# The one import that points up, made at call time: DigitVocab.from_tokenizer (public API).
LAZY_UP = {("vocab", "tokenizers")}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([ROOT, *parts])] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom, known: Set[str]) -> List[str]:
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    targets = []
    for alias in node.names:
        full = f"{prefix}.{alias.name}"
        targets.append(full if full in known else prefix)
    return [t for t in targets if t in known]


def _type_checking_only(stmt: ast.stmt) -> bool:
    test = getattr(stmt, "test", None)
    return isinstance(stmt, ast.If) and ast.unparse(test).endswith("TYPE_CHECKING")


def import_graph() -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]:
    """(module-level edges, call-time edges) between del_megatron's modules."""
    modules = _modules()
    known = set(modules)
    top: Dict[str, Set[str]] = {m: set() for m in modules}
    lazy: Dict[str, Set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        skipped: Set[int] = set()
        module_level = {id(n) for n in tree.body}
        for stmt in tree.body:  # try/if blocks at module level run at import time too
            if isinstance(stmt, (ast.Try, ast.If)) and not _type_checking_only(stmt):
                module_level |= {id(n) for n in ast.walk(stmt)}
            elif isinstance(stmt, ast.If):  # `if TYPE_CHECKING:` never runs
                skipped |= {id(n) for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(module, is_package, node, known)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in known]
            else:
                continue
            edges = top if id(node) in module_level else lazy
            edges[module] |= {t for t in targets if t != module}
    return top, lazy


def find_cycle(edges: Dict[str, Set[str]]) -> List[str]:
    """A cycle of module-level imports (empty if none)."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def _short(module: str) -> str:
    return module.removeprefix(ROOT + ".") if module != ROOT else ROOT


def _top(module: str) -> str:
    return _short(module).split(".")[0]


def test_no_import_cycle():
    top, _ = import_graph()
    assert find_cycle(top) == []


def test_math_imports_no_glue_and_points_down():
    top, lazy = import_graph()
    for edges, kind in ((top, "module-level"), (lazy, "call-time")):
        for module, targets in edges.items():
            if _top(module) not in MATH:
                continue
            for target in targets:
                pair = (_top(module), _top(target))
                assert pair[1] not in GLUE, f"{module} imports {target} ({kind})"
                if kind == "call-time" and pair[0] != pair[1]:
                    assert pair in LAZY_UP, f"{module} imports {target} at call time"


def test_module_level_imports_of_vocab_and_tokenizers_point_one_way():
    top, _ = import_graph()
    assert f"{ROOT}.vocab" in top[f"{ROOT}.tokenizers"]
    assert not top[f"{ROOT}.vocab"] & {f"{ROOT}.tokenizers"}


def test_importing_the_package_loads_no_glue():
    code = (
        "import sys, del_megatron; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' "
        "or m.startswith(('del_megatron.megatron', 'del_megatron.demo', 'del_megatron.cli'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def main() -> None:
    top, lazy = import_graph()
    for module in sorted(top):
        down = ", ".join(sorted(_short(t) for t in top[module]))
        later = ", ".join(sorted(_short(t) for t in lazy[module] - top[module]))
        line = f"{_short(module)} -> {down or '-'}"
        print(line + (f"   ~> {later}" if later else ""))
    cycle = find_cycle(top)
    print("cycle: " + (" -> ".join(map(_short, cycle)) if cycle else "none"))


if __name__ == "__main__":
    main()
