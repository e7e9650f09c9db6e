"""The package's import graph has no circle.

Every ``import`` of a package module by another — at module level or inside a function (a lazy
import only hides a circle until the day someone moves it up) — is an edge; imports under
``if TYPE_CHECKING:`` are not. A circle makes the import order of the package matter and ties
two modules into one: the test names it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "gradient_accumulator"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module → the package modules it imports (a package's ``__init__`` by the package)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports pkg (its __init__) and then the module.
                targets = [base]
                targets += [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # A module's own package is imported before it anyway: not an edge of its own.
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "gradient_accumulator.torch.optimizer" in graph
    # Edges the package certainly has (module level, lazy, relative-free `from pkg import mod`).
    assert "gradient_accumulator.torch._loop" in graph["gradient_accumulator.torch.optimizer"]
    assert "gradient_accumulator._engine" in graph["gradient_accumulator.torch._loop"]
    assert "gradient_accumulator.core" in graph["gradient_accumulator._engine"]


def test_find_circle_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    circle = find_circle(import_graph())
    assert circle is None, "import circle in the package: " + " -> ".join(circle or [])
