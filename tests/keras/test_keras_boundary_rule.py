"""The end of a cycle written once per number kind, held equal across the two.

``gradient_accumulator._engine.boundary_rule`` and ``boundary_scale`` are the rule on Python
numbers (the PyTorch backend's core path calls them); ``keras/_cycle.boundary`` is its
``keras.ops`` transcription (the TensorFlow and JAX shells call it). Both run here on the cycles
of ``tests/cycle_table.py`` — each scenario's reduction, total weights (micro-batch weights,
short cycles flushed), loss scale — under every way a boundary can go: a good or a non-finite
cycle, ``on_nonfinite`` skip/raise/apply, mixed precision at and before its growth step, a
static loss-scale factor, a count of dropped cycles already kept. Every output must agree
exactly (``==``): whether the inner optimizer updates, whether the cycle is skipped, the scale,
the loss scale, the growth counter and the dropped count. The scale is compared on float32: the
tensors' number kind; the static factors are powers of two, so the Python rule's float64
divisions round to the same float32 as the tensors' float32 ones, and a float32 run of the
scalar rule (NumPy float32 numbers) is held to the tensors for any factor.
"""

from __future__ import annotations

import itertools
import os
import sys

import keras
import numpy as np
import pytest
from keras import ops

from gradient_accumulator import _engine
from gradient_accumulator._options import Options
from gradient_accumulator.keras import _cycle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cycle_table import FLUSH, RESUME, SCENARIOS  # noqa: E402

GROWTH_STEPS = 3


def _cycle_weights(s) -> list[float]:
    """The total weight of each cycle the scenario ends (full ones and flushed short ones)."""
    weights = iter(s.weights or [])
    totals, current, count = [], 0.0, 0
    for step in s.steps:
        if step == RESUME:
            continue
        if step == FLUSH:
            if count:
                totals.append(current)
            current, count = 0.0, 0
            continue
        current += float(next(weights, 1.0))
        count += 1
        if count == s.accum_steps:
            totals.append(current)
            current, count = 0.0, 0
    return totals


def _cycles() -> list[tuple[str, float, float | None]]:
    """(reduction, total weight, loss scale or None) of every cycle in the table, once each."""
    found = set()
    for s in SCENARIOS:
        for w in _cycle_weights(s):
            found.add((s.reduction, w, s.loss_scale))
    return sorted(found, key=lambda c: (c[0], c[1], c[2] or 0.0))


CYCLES = _cycles()


def _keras_end(cycle, nonfinite, growth, dropped, options, static_scale, check_result):
    reduction, total_weight, loss_scale = cycle
    state = _cycle.CycleState(
        ops.convert_to_tensor(options.accum_steps, "int32"),
        ops.convert_to_tensor(total_weight, "float32"),
        ops.convert_to_tensor(1.0 if nonfinite else 0.0, "float32"),
        ops.convert_to_tensor(loss_scale or 1.0, "float32"),
        ops.convert_to_tensor(growth, "int32"),
        ops.convert_to_tensor(dropped, "int32"),
    )
    acc = [8.0, np.nan if nonfinite else -4.0]
    accs = [ops.convert_to_tensor(np.asarray(acc, np.float32))]
    return _cycle.boundary(
        state, options, accs=accs, static_scale=static_scale, check_result=check_result
    )


def _flag(value) -> bool:
    return bool(value) if isinstance(value, bool) else bool(keras.ops.convert_to_numpy(value))


def _number(value):
    return keras.ops.convert_to_numpy(value).item()


@pytest.mark.parametrize("cycle", CYCLES, ids=lambda c: f"{c[0]}-W{c[1]:g}-ls{c[2]}")
def test_the_scalar_rule_and_its_keras_ops_transcription_agree(cycle):
    reduction, total_weight, loss_scale = cycle
    mixed = loss_scale is not None
    cases = itertools.product(
        (False, True),  # the cycle is non-finite
        ("skip", "raise", "apply"),
        (0, GROWTH_STEPS - 1) if mixed else (0,),  # the growth counter before the boundary
        (0, 3),  # cycles dropped so far
        (None, 4.0, 0.5),  # the inner optimizer's static loss-scale factor
        (False, True),  # check_result (the mixed-precision verdict from the result)
    )
    for nonfinite, on_nonfinite, growth, dropped, static, check_result in cases:
        options = Options(
            accum_steps=4,
            reduction=reduction,
            on_nonfinite=on_nonfinite,
            mixed_precision=mixed,
            dynamic_growth_steps=GROWTH_STEPS,
        )
        end = _keras_end(cycle, nonfinite, growth, dropped, options, static, check_result)
        rule = _engine.boundary_rule(
            nonfinite,
            loss_scale or 1.0,
            growth,
            dropped,
            mixed_precision=mixed,
            drops_nonfinite=_cycle.drops_nonfinite(options),
            growth_steps=GROWTH_STEPS,
        )
        scale = _engine.boundary_scale(
            reduction,
            total_weight,
            loss_scale or 1.0,
            mixed_precision=mixed,
            static_scale=static,
        )
        case = (nonfinite, on_nonfinite, growth, dropped, static, check_result)
        assert _flag(end.do_update) == rule.do_update, case
        assert _flag(end.skipped) == rule.skipped, case
        assert np.float32(_number(end.scale)) == np.float32(scale), case
        assert _number(end.state.loss_scale) == rule.loss_scale, case
        assert _number(end.state.growth) == rule.growth, case
        assert _number(end.state.skipped) == rule.dropped, case


@pytest.mark.parametrize("static", [None, 3.0, 0.1])
@pytest.mark.parametrize("cycle", CYCLES, ids=lambda c: f"{c[0]}-W{c[1]:g}-ls{c[2]}")
def test_the_scale_on_float32_numbers_is_the_tensors_bit_for_bit(cycle, static):
    reduction, total_weight, loss_scale = cycle
    mixed = loss_scale is not None
    options = Options(accum_steps=4, reduction=reduction, mixed_precision=mixed)
    end = _keras_end(cycle, False, 0, 0, options, static, False)
    scale = _engine.boundary_scale(
        reduction,
        np.float32(total_weight),
        np.float32(loss_scale or 1.0),
        mixed_precision=mixed,
        static_scale=static,
    )
    # Float32 wherever a float32 number enters (1.0 alone stays a Python float: exact).
    assert np.float32(_number(end.scale)) == np.float32(scale)


def test_the_table_gives_the_rule_something_to_tell_apart():
    # Mean cycles of several weights (micro-batch weights, short cycles), sums, running means
    # and loss-scaled ones: the comparison above is not over one kind of cycle.
    reductions = {c[0] for c in CYCLES}
    assert reductions == {"mean", "sum", "running_mean"}
    assert len({c[1] for c in CYCLES if c[0] == "mean"}) >= 4
    assert any(c[2] is not None for c in CYCLES)


def test_one_end_of_cycle_predicate_per_number_kind():
    # The micro-step counter at, before and past the cycle's length (accum_steps lowered).
    for accum_steps in (1, 2, 4, 7):
        for micro_step in range(0, 10):
            want = _engine.ends_cycle(micro_step, accum_steps)
            got = _cycle.ends_cycle(ops.convert_to_tensor(micro_step, "int32"), accum_steps)
            assert _flag(got) == want, (micro_step, accum_steps)
            assert want == (micro_step >= accum_steps)
