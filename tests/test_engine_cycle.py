"""The engine's Cycle owns its state: read-only from outside, changed through its methods.

The arithmetic of a cycle is tested through the adapters (tests/torch, tests/keras, the cycle
table); here: the methods that replaced direct writes, the sum-of-squares invariant, and a walk
over the package's source that finds no write to a Cycle field outside ``_engine.py``.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from gradient_accumulator._engine import Cycle

ROOT = Path(__file__).resolve().parents[1] / "gradient_accumulator"


def _cycle(reduction: str = "mean", steps: int = 2) -> tuple[Cycle, list[torch.Tensor]]:
    accs = [torch.zeros(3), torch.zeros(2)]
    return Cycle(accs, steps, reduction), accs


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, generator=g), torch.randn(2, generator=g)]


def _read_outs() -> set[str]:
    return {n for n, v in vars(Cycle).items() if isinstance(v, property)}


def test_fields_are_read_only():
    cycle, _ = _cycle()
    for name in _read_outs():
        with pytest.raises(AttributeError):
            setattr(cycle, name, getattr(cycle, name))


def test_sumsq_belongs_to_the_current_accumulators():
    """A boundary fold's Σacc² is dropped by any later change of the accumulators: a fold
    during a backward (fold_one) must not leave the norm of the accumulators before it."""
    cycle, accs = _cycle(steps=2)
    g0, g1 = _grads(0), _grads(1)
    cycle.fold(g0, 1.0, norm=True)
    assert cycle.sumsq == pytest.approx(sum(float(g.double().square().sum()) for g in g0))
    cycle.fold_one(0, g1[0], 1.0)
    expected = math.sqrt(sum(float(a.double().square().sum()) for a in accs))
    assert cycle.result_norm(cycle.seen_index(), 1.0) == pytest.approx(expected, rel=1e-6)


def test_sumsq_is_used_by_one_boundary():
    cycle, accs = _cycle(steps=1)
    cycle.fold(_grads(2), 1.0, norm=True)
    first = cycle.result_norm(cycle.seen_index(), 1.0)
    assert cycle.sumsq is None
    with torch.no_grad():
        accs[0].mul_(2.0)  # an owner writing the accumulators itself (a reduction over ranks)
    expected = math.sqrt(sum(float(a.double().square().sum()) for a in accs))
    assert cycle.result_norm(cycle.seen_index(), 1.0) == pytest.approx(expected, rel=1e-6)
    assert expected != pytest.approx(first)


def test_merge_reduction_takes_the_ranks_totals():
    cycle, _ = _cycle(steps=3)
    cycle.fold([_grads(3)[0], None], 2.0, norm=True)
    cycle.merge_reduction(5.0, False, [True, True])
    assert (cycle.total_weight, cycle.nonfinite, cycle.seen) == (5.0, False, [True, True])
    assert cycle.sumsq is None
    cycle.merge_reduction(float("inf"), False, [True, False])
    assert cycle.nonfinite and cycle.seen == [True, False]
    with pytest.raises(ValueError, match="seen has 1 flags for 2 accumulators"):
        cycle.merge_reduction(1.0, False, [True])


def test_named_weight_lasts_until_the_fold_that_counts_it():
    cycle, _ = _cycle(steps=3)
    cycle.name_weight(2.0)
    assert cycle.hook_weight() == 2.0
    weight = cycle.micro_weight(1.0)
    assert weight == 2.0
    cycle.fold(_grads(4), weight, norm=False)
    assert cycle.named_weight is None and cycle.total_weight == 2.0


def test_settings_change_through_methods():
    cycle, _ = _cycle(steps=2)
    cycle.set_accum_steps(4)
    assert cycle.accum_steps == 4 and not cycle.boundary_next
    with pytest.raises(ValueError, match="accum_steps"):
        cycle.set_accum_steps(0)
    cycle.set_reduction("sum")
    cycle.fold(_grads(5), 1.0, norm=False)
    with pytest.raises(ValueError, match="between cycles only .*'sum'"):
        cycle.set_reduction("mean")
    cycle.set_reduction("sum")  # the same one is fine
    with pytest.raises(ValueError, match="reduction must be one of"):
        cycle.set_reduction("bogus")
    assert cycle.reduction == "sum"
    cycle.reset()
    cycle.set_reduction("running_mean")
    assert cycle.reduction == "running_mean"


# ---- no module writes a Cycle's fields ----


def _cycle_fields() -> set[str]:
    names = _read_outs()
    tree = ast.parse((ROOT / "_engine.py").read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
        ):
            names.add(node.attr)
    return names


def _cycle_writes(source: str, fields: set[str]) -> list[str]:
    """Writes ``x.field = …`` (also augmented, annotated, deleted, setattr) to an object
    reached through a name or attribute called ``cycle`` (or a local bound to one)."""
    tree = ast.parse(source)
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        aliases = {"cycle"}

        def is_cycle(expr: ast.expr, aliases: set[str] = aliases) -> bool:
            if isinstance(expr, ast.Name):
                return expr.id in aliases
            return isinstance(expr, ast.Attribute) and expr.attr == "cycle"

        for node in ast.walk(func):  # c = self.cycle; s, c = self.state, self.cycle
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    pairs = [(t, node.value)]
                    if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = list(zip(t.elts, node.value.elts))
                    for target, value in pairs:
                        if isinstance(target, ast.Name) and is_cycle(value):
                            aliases.add(target.id)

        for node in ast.walk(func):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                if node.attr in fields and is_cycle(node.value):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
                and node.args
                and is_cycle(node.args[0])
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def test_the_write_finder_finds_writes():
    fields = _cycle_fields()
    assert {"micro_step", "_micro_step", "sumsq", "_sumsq", "seen"} <= fields
    bad = (
        "def f(self):\n"
        "    s, c = self.state, self.cycle\n"
        "    c.total_weight = 1.0\n"
        "    self.cycle.sumsq = None\n"
        "    cycle.nonfinite |= True\n"
        "    setattr(cycle, 'seen', [])\n"
        "    self.micro_step = 0\n"
    )
    assert len(_cycle_writes(bad, fields)) == 4


def test_no_module_writes_a_cycle_field():
    fields = _cycle_fields()
    writes = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "_engine.py":
            continue
        found = _cycle_writes(path.read_text(), fields)
        if found:
            writes[str(path.relative_to(ROOT))] = found
    assert not writes, f"Cycle fields written outside _engine.py (use its methods): {writes}"
