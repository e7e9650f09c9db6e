"""The Keras adapter's shape: a small optimizer class, short functions, one cycle boundary.

Read from the source with ``ast`` (as tests/test_import_graph.py reads the imports): the wrapper
class keeps Keras's optimizer interface, build, flush, config and its settings, while the paths
live in private modules; a function too long to review, or a second place that ends a cycle, is
named here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

KERAS = Path(__file__).resolve().parents[2] / "gradient_accumulator" / "keras"
MAX_OPTIMIZER_LINES = 500
MAX_FUNCTION_LINES = 80
# A cycle's end puts the micro-step counter back to zero: ``zeros_like`` of it (the stateful
# shell's variable or the stateless shell's value).
_RESETS_MICRO_STEP = re.compile(r"zeros_like\([^)]*micro_step")


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    found = []
    for path in sorted(KERAS.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((path.stem, node, ast.get_source_segment(source, node) or ""))
    return found


def test_optimizer_module_is_short():
    lines = len((KERAS / "optimizer.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_OPTIMIZER_LINES, (
        f"gradient_accumulator/keras/optimizer.py has {lines} lines (limit "
        f"{MAX_OPTIMIZER_LINES}): move a path's code into a private module"
    )


def test_no_function_over_the_limit():
    long = [
        f"{module}.{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for module, node, _ in _functions()
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_counting_rule_sees_the_resets():
    # The rule below must match a reset as the shells write it, and not a mere read.
    assert _RESETS_MICRO_STEP.search('ops.zeros_like(own["micro_step"])')
    assert _RESETS_MICRO_STEP.search("ops.zeros_like(self._micro_step.value)")
    assert not _RESETS_MICRO_STEP.search("ops.greater_equal(self._micro_step, k)")


def test_one_boundary():
    enders = sorted(
        f"{module}.{node.name}"
        for module, node, source in _functions()
        if _RESETS_MICRO_STEP.search(source)
        # an enclosing function is reported through its own match; count innermost ones only
        and not any(
            isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _RESETS_MICRO_STEP.search(ast.unparse(child))
            for child in ast.walk(node)
            if child is not node
        )
    )
    assert enders == ["_cycle.boundary"], f"functions that end a cycle: {enders}"
