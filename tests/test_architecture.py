"""The architecture's rules, checked from the source (no import of the package, nothing run).

Issue 35 set them: no import circles in `speedtronic` (lazy imports inside functions count too: a circle
hidden in a function is still a circle), no function in `diloco/` over 60 lines, no `master: Any`-style
parameters in `diloco/`, `Master` and `Coordinator` at most 20 attributes each. A failure prints what broke
the rule, so the fix starts from the message.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "speedtronic"
DILOCO = PACKAGE / "diloco"
FUNCTION_LINES = 60
ATTRIBUTES = 20


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, here: str, is_package: bool) -> list[str]:
    """Every module named by an import anywhere in `tree`, except under `if TYPE_CHECKING:`."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.extend(f"{base}.{alias.name}" for alias in node.names)
            found.append(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            # `from pkg import mod` names the module; `from mod import name` names mod.
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    # `from pkg import mod` also adds the edge to pkg itself; keep only the most specific target.
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not any(o != t and o.startswith(t + ".") for o in targets)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return components


def test_the_package_has_no_import_circles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import circles (lazy imports count): " + "; ".join(" ⇄ ".join(c) for c in cycles)


def test_no_function_in_diloco_is_over_60_lines() -> None:
    long = []
    for path in sorted(DILOCO.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def _diloco_lines_matching(pattern: re.Pattern[str]) -> list[str]:
    """`path:line: text` of every line under diloco/ that `pattern` finds."""
    return [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(DILOCO.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_diloco_signature_hides_a_part_behind_any() -> None:
    hits = _diloco_lines_matching(re.compile(r"\b(master|coordinator|config|cfg|bus|manifest): Any\b"))
    assert not hits, "typed as Any:\n" + "\n".join(hits)


def _attributes(class_name: str) -> set[str]:
    for path in DILOCO.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                names = set()
                for sub in ast.walk(node):
                    targets = []
                    if isinstance(sub, ast.Assign):
                        targets = sub.targets
                    elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                        targets = [sub.target]
                    for target in targets:
                        for t in ast.walk(target):
                            if (
                                isinstance(t, ast.Attribute)
                                and isinstance(t.value, ast.Name)
                                and t.value.id == "self"
                            ):
                                names.add(t.attr)
                return names
    raise AssertionError(f"class {class_name} not found under {DILOCO}")


def test_master_and_coordinator_own_at_most_20_attributes() -> None:
    for class_name in ("Master", "Coordinator"):
        names = _attributes(class_name)
        assert len(names) <= ATTRIBUTES, f"{class_name} sets {len(names)} attributes: {sorted(names)}"


def test_nothing_outside_a_class_writes_the_master_or_coordinator() -> None:
    """No module writes `master.x = …` / `coordinator.x = …` on an object it does not own."""
    pattern = re.compile(r"^\s*(master|coordinator|self\.master|self\.coordinator)\.\w+\s*(=|\+=|-=)[^=]")
    hits = _diloco_lines_matching(pattern)
    assert not hits, "writes from outside:\n" + "\n".join(hits)
