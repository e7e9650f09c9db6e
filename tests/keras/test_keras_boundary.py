"""``keras/_cycle.boundary``, the one end of a cycle both Keras shells call, as a pure function.

Each case hands it a cycle's state (values, no variables) and checks every field it returns
against numbers worked out by hand: powers of two, so the float32 results are exact. The shells'
control flow around it (variables, ``merge_call``, ``lax.cond``) is held by the equivalence,
non-finite, mixed-precision and cycle-table tests.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from gradient_accumulator._options import Options
from gradient_accumulator.keras import _cycle


def _state(
    micro_step=4, total_weight=8.0, nonfinite=0.0, loss_scale=1024.0, growth=0, skipped=0
) -> _cycle.CycleState:
    return _cycle.CycleState(
        ops.convert_to_tensor(micro_step, "int32"),
        ops.convert_to_tensor(total_weight, "float32"),
        ops.convert_to_tensor(nonfinite, "float32"),
        ops.convert_to_tensor(loss_scale, "float32"),
        ops.convert_to_tensor(growth, "int32"),
        ops.convert_to_tensor(skipped, "int32"),
    )


def _accs(*values) -> list:
    return [ops.convert_to_tensor(np.asarray(v, np.float32)) for v in values]


def _numbers(state: _cycle.CycleState) -> dict:
    return {k: float(keras.ops.convert_to_numpy(v)) for k, v in state._asdict().items()}


def _flag(value) -> bool:
    return bool(value) if isinstance(value, bool) else bool(keras.ops.convert_to_numpy(value))


RESET = {"micro_step": 0.0, "total_weight": 0.0, "nonfinite": 0.0}


def test_a_good_mean_cycle_updates_with_one_over_its_weight_and_restarts():
    end = _cycle.boundary(_state(), Options(), accs=_accs([8.0, -4.0]))
    assert float(ops.convert_to_numpy(end.scale)) == 1 / 8
    assert _flag(end.do_update) and not _flag(end.skipped)
    assert _numbers(end.state) == {**RESET, "loss_scale": 1024.0, "growth": 0.0, "skipped": 0.0}


def test_sum_does_not_divide_and_a_static_factor_does():
    end = _cycle.boundary(_state(), Options(reduction="sum"), accs=_accs([1.0]), static_scale=4.0)
    assert float(ops.convert_to_numpy(end.scale)) == 1 / 4


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_on_nonfinite_skip_drops_a_nonfinite_cycle_and_counts_it(bad):
    end = _cycle.boundary(_state(skipped=2), Options(), accs=_accs([1.0, bad], [2.0]))
    assert not _flag(end.do_update) and _flag(end.skipped)
    assert _numbers(end.state) == {**RESET, "loss_scale": 1024.0, "growth": 0.0, "skipped": 3.0}


def test_a_finite_sum_that_overflows_float32_once_averaged_is_dropped():
    # 2^100 / 2^-40 = 2^140 > float32's largest: the averaged gradient is Inf.
    end = _cycle.boundary(_state(total_weight=2.0**-40), Options(), accs=_accs([2.0**100, 1.0]))
    assert not _flag(end.do_update) and _flag(end.skipped)
    assert _numbers(end.state)["skipped"] == 1.0


def test_on_nonfinite_apply_updates_with_a_nan():
    end = _cycle.boundary(_state(), Options(on_nonfinite="apply"), accs=_accs([np.nan]))
    assert end.do_update is True and end.skipped is False
    assert _numbers(end.state)["skipped"] == 0.0


def test_mixed_precision_grows_the_scale_after_its_good_updates():
    options = Options(mixed_precision=True, dynamic_growth_steps=3)
    end = _cycle.boundary(_state(growth=1), options, accs=_accs([np.nan]))
    # The per-micro-step flag decides under the loss scaler (the accumulators are not read).
    assert _flag(end.do_update) and not _flag(end.skipped)
    assert float(ops.convert_to_numpy(end.scale)) == 1 / (8 * 1024)
    assert _numbers(end.state) == {**RESET, "loss_scale": 1024.0, "growth": 2.0, "skipped": 0.0}
    end = _cycle.boundary(end.state._replace(total_weight=_state().total_weight), options)
    assert _numbers(end.state)["loss_scale"] == 2048.0
    assert _numbers(end.state)["growth"] == 0.0


def test_mixed_precision_halves_the_scale_on_a_nonfinite_cycle_without_counting_a_drop():
    options = Options(mixed_precision=True, dynamic_growth_steps=3)
    end = _cycle.boundary(_state(nonfinite=1.0, growth=2), options)
    assert not _flag(end.do_update) and _flag(end.skipped)
    assert _numbers(end.state) == {**RESET, "loss_scale": 512.0, "growth": 0.0, "skipped": 0.0}


def test_check_result_catches_what_the_per_micro_step_flag_missed():
    options = Options(mixed_precision=True)
    accs = _accs([np.inf])
    assert _flag(_cycle.boundary(_state(), options, accs=accs).do_update)
    end = _cycle.boundary(_state(), options, accs=accs, check_result=True)
    assert not _flag(end.do_update)
    assert _numbers(end.state)["loss_scale"] == 512.0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_check_result_leaves_on_nonfinite_apply_applying(bad):
    """``check_result`` asks for the cycle's own verdict, which only a loss scaler or a
    dropping ``on_nonfinite`` uses: under ``"apply"`` without ``mixed_precision`` the cycle
    is applied as computed, as a plain optimizer applies a NaN or Inf gradient (the shortcut
    that uses the check as the update's condition took it as a drop)."""
    options = Options(on_nonfinite="apply")
    end = _cycle.boundary(_state(skipped=2), options, accs=_accs([1.0, bad]), check_result=True)
    assert _flag(end.do_update) and not _flag(end.skipped)
    assert float(ops.convert_to_numpy(end.scale)) == 1 / 8
    assert _numbers(end.state) == {**RESET, "loss_scale": 1024.0, "growth": 0.0, "skipped": 2.0}


def test_the_agreed_verdict_decides():
    seen = []

    def another_replica_saw_a_nan(at, verdict):
        seen.append(float(ops.convert_to_numpy(verdict)))
        return verdict + 1.0

    end = _cycle.boundary(_state(), Options(), accs=_accs([1.0]), agree=another_replica_saw_a_nan)
    assert seen == [0.0]  # the local verdict: this replica's cycle is finite
    assert not _flag(end.do_update) and _numbers(end.state)["skipped"] == 1.0


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_off_the_boundary_nothing_changes(mixed_precision):
    options = Options(mixed_precision=mixed_precision)
    state = _state(micro_step=2, total_weight=2.0, nonfinite=1.0, growth=1, skipped=5)
    end = _cycle.boundary(state, options, at=ops.convert_to_tensor(False), accs=_accs([np.nan]))
    assert not _flag(end.do_update)
    assert _numbers(end.state) == _numbers(state)
    on = _cycle.boundary(state, options, at=ops.convert_to_tensor(True), accs=_accs([np.nan]))
    assert _numbers(on.state)["micro_step"] == 0.0
    assert _numbers(on.state)["loss_scale"] == (512.0 if mixed_precision else 1024.0)
    assert _numbers(on.state)["skipped"] == (5.0 if mixed_precision else 6.0)
