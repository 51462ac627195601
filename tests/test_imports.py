"""The package's import graph: no cycle, counting every import wherever it stands (module
level, inside a function, under `if TYPE_CHECKING:`), the math never imports the framework glue,
and every module of the Megatron glue is on its package docstring's map.

`python -m tests.test_imports` prints the graph (module-level imports; `~>` marks imports made
inside a function, at call time; `?>` imports under TYPE_CHECKING)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "del_megatron"
ROOT = "del_megatron"
# The math and the vocab-parallel primitive: torch only, no Megatron glue, demo or CLI.
MATH = (
    "config",
    "number_tokens",
    "vocab",
    "sequence",
    "kernels",
    "numbers",
    "heads",
    "reference",
    "tokenizers",
    "loss",
)
GLUE = ("megatron", "automodel", "cpu", "demo", "cli", "preflight")


def _modules(package: Path = PACKAGE) -> Dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
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


Edges = Dict[str, Set[str]]


def import_graph(package: Path = PACKAGE) -> Tuple[Edges, Edges, Edges]:
    """(module-level, call-time, TYPE_CHECKING-only) edges between del_megatron's modules."""
    modules = _modules(package)
    known = set(modules)
    top: Edges = {m: set() for m in modules}
    lazy: Edges = {m: set() for m in modules}
    typing_only: Edges = {m: set() for m in modules}
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
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(module, is_package, node, known)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in known]
            else:
                continue
            edges = (
                typing_only if id(node) in skipped else top if id(node) in module_level else lazy
            )
            edges[module] |= {t for t in targets if t != module}
    return top, lazy, typing_only


def every_import(package: Path = PACKAGE) -> Edges:
    """All edges, however the import is made."""
    top, lazy, typing_only = import_graph(package)
    return {m: top[m] | lazy[m] | typing_only[m] for m in top}


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


def test_no_import_cycle_counting_call_time_and_type_checking_imports():
    assert find_cycle(every_import()) == []


def test_a_cycle_hidden_in_a_function_or_under_type_checking_is_found(tmp_path):
    package = tmp_path / ROOT
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from . import high\n")
    (package / "high.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .other import X\n"
        "from . import low\n"
    )
    (package / "other.py").write_text("from .high import low\nX = 1\n")
    top, lazy, typing_only = import_graph(package)
    assert find_cycle(top) == []
    assert lazy[f"{ROOT}.low"] == {f"{ROOT}.high"}
    assert typing_only[f"{ROOT}.high"] == {f"{ROOT}.other"}
    assert find_cycle(every_import(package)) == [f"{ROOT}.high", f"{ROOT}.low", f"{ROOT}.high"]


def test_math_imports_no_glue():
    for module, targets in every_import().items():
        if _top(module) in MATH:
            for target in targets:
                assert _top(target) not in GLUE, f"{module} imports {target}"


def test_each_megatron_glue_module_is_named_in_the_package_docstring():
    """megatron/__init__'s docstring is the map a newcomer reads: every module is on it."""
    import del_megatron.megatron as glue

    prefix = f"{ROOT}.megatron."
    names = sorted(m.removeprefix(prefix) for m in import_graph()[0] if m.startswith(prefix))
    missing = [name for name in names if name not in glue.__doc__.replace(",", " ").split()]
    assert len(names) >= 10 and not missing, f"not in megatron/__init__'s docstring: {missing}"


def test_tokenizers_import_nothing_of_the_vocab():
    edges = every_import()
    assert f"{ROOT}.tokenizers" in edges[f"{ROOT}.vocab"]
    assert not edges[f"{ROOT}.tokenizers"] & {f"{ROOT}.vocab"}


def test_importing_the_package_loads_no_glue():
    code = (
        "import sys, del_megatron; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' "
        "or m.startswith(('del_megatron.megatron', 'del_megatron.demo', 'del_megatron.cli'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def main() -> None:
    top, lazy, typing_only = import_graph()
    for module in sorted(top):
        down = ", ".join(sorted(_short(t) for t in top[module]))
        later = ", ".join(sorted(_short(t) for t in lazy[module] - top[module]))
        typed = ", ".join(sorted(_short(t) for t in typing_only[module]))
        line = f"{_short(module)} -> {down or '-'}"
        print(line + (f"   ~> {later}" if later else "") + (f"   ?> {typed}" if typed else ""))
    cycle = find_cycle(every_import())
    print("cycle: " + (" -> ".join(map(_short, cycle)) if cycle else "none"))


if __name__ == "__main__":
    main()
