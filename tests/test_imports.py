"""The package's import graph and its maps: no cycle, counting every import wherever it stands
(module level, inside a function, under `if TYPE_CHECKING:`); each folder's imports within its
rules (digits import digits; the loss imports no glue and no tools; the glue no tools); and every
module on its folder's map, the folder's `__init__` docstring, and on docs/internals.md's.

`python -m tests.test_imports` prints the graph (module-level imports; `~>` marks imports made
inside a function, at call time; `?>` imports under TYPE_CHECKING)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "del_megatron"
ROOT = "del_megatron"
INTERNALS = PACKAGE.parent / "docs" / "internals.md"
# A module's concept is its folder's; the top level (and kernels/) is the loss.
GLUE = ("megatron", "automodel", "cpu")
# What each concept may import, wherever the import stands; `device` (checks on the device) is
# the one module of the loss that digits use.
ALLOWED = {
    "digits": {"digits", "device"},
    "loss": {"loss", "digits", "device"},
    "glue": {"glue", "loss", "digits", "device"},
    "tools": {"tools", "glue", "loss", "digits", "device"},
}


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


def concept(module: str) -> str:
    """digits, loss, glue, tools, or device, of a module's dotted name."""
    first = _short(module).split(".")[0]
    if first in ("digits", "tools", "device"):
        return first
    if first == "__main__":
        return "tools"
    return "glue" if first in GLUE else "loss"


def rule_breaks(edges: Edges) -> List[str]:
    """'module -> target' for every import outside its concept's ALLOWED."""
    return [
        f"{_short(m)} -> {_short(t)}"
        for m, targets in sorted(edges.items())
        for t in sorted(targets)
        if concept(t) not in ALLOWED.get(concept(m), {concept(m)})
    ]


def test_each_folder_imports_within_its_rules():
    assert rule_breaks(every_import()) == []


def test_an_import_against_the_rules_is_found_wherever_it_stands(tmp_path):
    package = tmp_path / ROOT
    for folder in ("digits", "megatron", "tools"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "loss.py").write_text("def f():\n    from .megatron import hook\n")
    (package / "megatron" / "hook.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..tools import cli\n"
    )
    (package / "tools" / "cli.py").write_text("from ..loss import f\n")
    (package / "digits" / "vocab.py").write_text("from .. import loss\n")
    assert rule_breaks(every_import(package)) == [
        "digits.vocab -> loss",
        "loss -> megatron.hook",
        "megatron.hook -> tools.cli",
    ]


def folders(package: Path = PACKAGE) -> Dict[str, List[str]]:
    """{folder (a package, relative, '' for the top): the names its map must hold, its modules
    and sub-folders}."""
    out: Dict[str, List[str]] = {}
    for init in sorted(package.rglob("__init__.py")):
        folder = init.parent
        names = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
        names += [p.name + "/" for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"]
        out[folder.relative_to(package).as_posix().replace(".", "")] = sorted(names)
    return out


def off_the_docstring_maps(package: Path = PACKAGE) -> List[str]:
    """'folder: name' for every module or sub-folder its folder's __init__ docstring leaves out."""
    missing = []
    for folder, names in folders(package).items():
        init = package / folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        words = set(re.findall(r"[A-Za-z_]\w*/?", doc))
        missing += [
            f"{folder or ROOT}: {n}" for n in names if n not in words and n.rstrip("/") not in words
        ]
    return missing


def internals_map(text: str) -> Dict[str, List[str]]:
    """{folder: the backticked names of its entry} of docs/internals.md's map: entries
    "- `del_megatron/`: ..." or "- `kernels/`: ...", each with its indented lines; what a module
    does, in parentheses, is not a name."""
    entries: Dict[str, str] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"- `([\w/]+/)`: (.*)", line)
        if head:
            current = "" if head.group(1) == f"{ROOT}/" else head.group(1).rstrip("/")
            entries[current] = head.group(2)
        elif current is not None and line.startswith("  "):
            entries[current] += " " + line.strip()
        else:
            current = None
    out = {}
    for folder, body in entries.items():
        while True:  # innermost parentheses first
            stripped = re.sub(r"\([^()]*\)", "", body)
            if stripped == body:
                break
            body = stripped
        out[folder] = re.findall(r"`(\w+/?)`", body)
    return out


def test_every_module_is_on_its_folders_map_and_on_the_internals_map():
    assert off_the_docstring_maps() == []
    documented = internals_map(INTERNALS.read_text())
    for folder, names in folders().items():
        assert sorted(documented.get(folder, [])) == names, folder or ROOT


def test_a_module_missing_from_a_map_is_found(tmp_path):
    package = tmp_path / ROOT
    (package / "digits").mkdir(parents=True)
    (package / "__init__.py").write_text('"""Folders: digits/."""\n')
    (package / "digits" / "__init__.py").write_text('"""Modules: vocab."""\n')
    (package / "digits" / "vocab.py").write_text("")
    (package / "digits" / "slots.py").write_text("")
    assert off_the_docstring_maps(package) == ["digits: slots"]
    text = "- `del_megatron/`: `digits/`.\n- `digits/`: `vocab` (the ids).\n"
    assert internals_map(text) == {"": ["digits/"], "digits": ["vocab"]}
    assert folders(package)["digits"] != internals_map(text)["digits"]


def test_tokenizers_import_nothing_of_the_vocab():
    edges = every_import()
    assert f"{ROOT}.digits.tokenizers" in edges[f"{ROOT}.digits.vocab"]
    assert not edges[f"{ROOT}.digits.tokenizers"] & {f"{ROOT}.digits.vocab"}


def test_importing_the_package_loads_no_glue():
    code = (
        "import sys, del_megatron; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' "
        "or m.startswith(('del_megatron.megatron', 'del_megatron.tools'))))"
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


def test_bridge_and_nemo_glue_import_nothing_of_megatron_lms():
    """Megatron-Bridge's and NeMo's glue reach the step accounting through accounting.py, not
    through the Megatron-LM module (lm.py), at any depth."""
    edges = every_import()
    for framework in ("bridge", "nemo"):
        seen, todo = set(), [f"{ROOT}.megatron.{framework}"]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(edges.get(module, ()))
        assert f"{ROOT}.megatron.lm" not in seen, framework


if __name__ == "__main__":
    main()
