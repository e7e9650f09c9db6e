"""The Keras adapter's shape: a small optimizer class, short functions, one cycle boundary, the
backend chosen in one place.

Read from the source with ``ast`` (as tests/test_import_graph.py reads the imports): the wrapper
class keeps Keras's optimizer interface, build, flush, config and its settings, while the paths
live in shells that ``build()`` chooses once (``_shells.py``); a function too long to review, a
second place that ends a cycle, or a backend or strategy test outside ``_compat.py`` and the shell
factory, is named here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

KERAS = Path(__file__).resolve().parents[2] / "gradient_accumulator" / "keras"
# The public loss-scale and non-finite API is the class's own (it was a mixin's before the
# shells): 600, not the 500 of the mixin days.
MAX_OPTIMIZER_LINES = 600
MAX_FUNCTION_LINES = 80
# A cycle's end puts the micro-step counter back to zero: ``zeros_like`` of it (the stateful
# shell's variable or the stateless shell's value).
_RESETS_MICRO_STEP = re.compile(r"zeros_like\([^)]*micro_step")


# Where the backend (and the tf.distribute strategy) may be asked: the backend facts and the
# shell factory. Elsewhere at most MAX_BACKEND_TESTS.
BACKEND_MODULES = ("_compat", "_shells")
MAX_BACKEND_TESTS = 3
_STRATEGY_CALLS = ("tf_strategy", "_strategy", "has_strategy", "get_strategy")


def _backend_tests(tree: ast.AST) -> list[int]:
    """Lines of the backend comparisons (``keras.backend.backend() == ...``, ``_BACKEND``) and
    strategy tests (``tf.distribute.has_strategy()`` and the like, ``strategy is None``)."""

    def backendish(node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            return name == "backend"
        return getattr(node, "id", getattr(node, "attr", "")) in ("_BACKEND", "strategy")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            backendish(x) for x in [node.left, *node.comparators]
        ):
            found.append(node.lineno)
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in _STRATEGY_CALLS:
                found.append(node.lineno)
    return found


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


def test_the_backend_rule_sees_the_tests():
    def count(source: str) -> int:
        return len(_backend_tests(ast.parse(source)))

    assert count('keras.backend.backend() == "jax"') == 1
    assert count('_BACKEND != "torch"') == 1
    assert count("tf_strategy() is None or strategy is not None") == 2
    assert count("tf.distribute.has_strategy()") == 1
    assert count("self.strategy.num_replicas_in_sync") == 0


def test_the_backend_is_asked_in_one_place():
    tests = [
        f"{path.stem}.py:{line}"
        for path in sorted(KERAS.glob("*.py"))
        if path.stem not in BACKEND_MODULES
        for line in _backend_tests(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert len(tests) <= MAX_BACKEND_TESTS, (
        f"backend or strategy tests outside {BACKEND_MODULES}: {tests} (limit "
        f"{MAX_BACKEND_TESTS}): ask the shell, or a named fact of _compat"
    )


def test_the_optimizer_is_no_mixin_web():
    # The wrapper's class bases are Keras's optimizer only: its per-backend behaviour is a shell
    # object it holds, not a private class in its MRO (help() lists none).
    from gradient_accumulator.keras import GradientAccumulateOptimizer

    private = [
        c.__qualname__
        for c in GradientAccumulateOptimizer.__mro__
        if c.__module__.startswith("gradient_accumulator.keras._")
    ]
    assert private == [], f"private classes in the wrapper's MRO: {private}"
    own = [c for c in GradientAccumulateOptimizer.__mro__ if c.__module__.startswith("gradient_")]
    assert own == [GradientAccumulateOptimizer]
