"""``on_nonfinite`` on the Keras wrappers: a cycle whose gradient holds NaN or Inf is dropped
and reported (default), raised, or applied — on every backend and every code path.

Eight samples, one per micro-batch, ``accum_steps=2``: four cycles. Sample 2 (the first
micro-batch of the second cycle) is NaN, so that whole cycle's gradient is NaN. Dropping it must
give exactly the run that never saw samples 2 and 3 (same initial weights, Adam, so the inner
optimizer's moments and step count are checked through the weights they produce).
"""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND

from gradient_accumulator.keras import (
    FlushAccumulation,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)
from gradient_accumulator.nonfinite import NonFiniteGradientError, NonFiniteGradientWarning

ACCUM = 2
TOL = 1e-6  # max|Δw| against the run without the bad cycle: same float32 arithmetic
PATHS = [{}] + ([{"use_core": False}] if BACKEND == "torch" else [])


def _data(bad: bool = True):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    if bad:
        x[2, 0] = np.nan
    return x, y


def _model(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs))
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def _weights(model):
    return [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]


def _max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def _reference(samples, **path):
    """The same accumulation, on ``samples`` only (the bad cycle never seen)."""
    x, y = _data(bad=False)
    model = _model()
    model.compile(
        GradientAccumulateOptimizer(keras.optimizers.Adam(0.05), ACCUM, **path), loss="mse"
    )
    model.fit(x[samples], y[samples], batch_size=1, shuffle=False, verbose=0)
    return model


def _fit(model, x, y, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0, **kwargs)
    return [w for w in caught if issubclass(w.category, NonFiniteGradientWarning)]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "core" if not p else "ops")
def test_skip_drops_the_cycle_and_warns_in_fit(path):
    x, y = _data()
    model = _model(GradientAccumulateModel, accum_steps=ACCUM)
    model.compile(
        GradientAccumulateOptimizer(keras.optimizers.Adam(0.05), ACCUM, **path), loss="mse"
    )
    caught = _fit(model, x, y)
    opt = model.optimizer
    assert len(caught) == 1 and "1 cycle skipped" in str(caught[0].message)
    assert caught[0].filename == __file__  # the user's fit() call, not a line of Keras
    assert opt.nonfinite_skipped == 1
    assert int(opt.iterations) == 3  # the inner optimizer stepped for the three clean cycles
    assert int(opt.optimizer.iterations) == 3
    ref = _reference([0, 1, 4, 5, 6, 7], **path)
    assert all(np.isfinite(w).all() for w in _weights(model))
    assert _max_diff(_weights(model), _weights(ref)) <= TOL


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "core" if not p else "ops")
def test_skip_with_a_plain_model_and_the_callback(path):
    x, y = _data()
    model = _model()
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.05), ACCUM, **path)
    model.compile(opt, loss="mse")
    caught = _fit(model, x, y, callbacks=[FlushAccumulation()])
    assert len(caught) == 1 and opt.nonfinite_skipped == 1
    assert _max_diff(_weights(model), _weights(_reference([0, 1, 4, 5, 6, 7], **path))) <= TOL


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "core" if not p else "ops")
def test_raise_stops_fit_with_the_weights_of_the_last_good_cycle(path):
    x, y = _data()
    model = _model(GradientAccumulateModel, accum_steps=ACCUM, on_nonfinite="raise")
    model.compile(keras.optimizers.Adam(0.05), loss="mse") if not path else model.compile(
        GradientAccumulateOptimizer(
            keras.optimizers.Adam(0.05), ACCUM, on_nonfinite="raise", **path
        ),
        loss="mse",
    )
    with pytest.raises(NonFiniteGradientError, match="on_nonfinite='raise'"):
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    if BACKEND == "jax":
        model.jax_state_sync()
    assert int(model.optimizer.iterations) == 1
    assert _max_diff(_weights(model), _weights(_reference([0, 1], **path))) <= TOL


def test_apply_writes_the_nonfinite_update():
    x, y = _data()
    model = _model(GradientAccumulateModel, accum_steps=ACCUM, on_nonfinite="apply")
    model.compile(keras.optimizers.Adam(0.05), loss="mse")
    assert _fit(model, x, y) == []
    assert model.optimizer.nonfinite_skipped == 0
    assert int(model.optimizer.iterations) == 4
    assert any(np.isnan(w).any() for w in _weights(model))


def _eager_opt(model, **kwargs):
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), ACCUM, reduction="SUM", **kwargs)
    opt.build(model.trainable_variables)
    return opt


def _grads(model, value):
    return [keras.ops.full(v.shape, value, "float32") for v in model.trainable_variables]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "core" if not p else "ops")
def test_eager_apply_warns_on_the_1st_2nd_4th_skip(path):
    model = _model()
    opt = _eager_opt(model, **path)
    before = _weights(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):  # five cycles, each with one NaN micro-batch
            opt.apply(_grads(model, np.nan), model.trainable_variables)
            opt.apply(_grads(model, 1.0), model.trainable_variables)
    counts = [
        re.search(r"\((\d+) cycles? skipped so far\)", str(w.message)).group(1)
        for w in caught
        if issubclass(w.category, NonFiniteGradientWarning)
    ]
    assert counts == ["1", "2", "4"]
    assert {w.filename for w in caught if issubclass(w.category, NonFiniteGradientWarning)} == {
        __file__
    }
    assert opt.nonfinite_skipped == 5 and int(opt.iterations) == 0
    assert _max_diff(_weights(model), before) == 0.0
    # The next clean cycle updates normally: w ← w − 0.1·(1 + 1).
    opt.apply(_grads(model, 1.0), model.trainable_variables)
    opt.apply(_grads(model, 1.0), model.trainable_variables)
    assert int(opt.iterations) == 1
    assert _max_diff(_weights(model), [w - 0.2 for w in before]) <= TOL


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "core" if not p else "ops")
def test_finite_gradients_whose_sum_overflows_are_dropped(path):
    model = _model()
    opt = _eager_opt(model, on_nonfinite="raise", **path)
    before = _weights(model)
    opt.apply(_grads(model, 3e38), model.trainable_variables)  # finite
    with pytest.raises(NonFiniteGradientError):
        opt.apply(_grads(model, 3e38), model.trainable_variables)  # 6e38 > float32 max
    assert opt.nonfinite_skipped == 1 and int(opt.iterations) == 0
    assert _max_diff(_weights(model), before) == 0.0


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "core" if not p else "ops")
def test_finite_cycle_whose_total_overflows_is_applied(path):
    """Every element of the cycle's gradient is finite (2e38) though their total is not: the
    cycle updates (on TensorFlow the check first sums each tensor, and a non-finite total
    falls back to the elementwise check)."""
    model = _model()
    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(1e-37), ACCUM, reduction="SUM", on_nonfinite="raise", **path
    )
    opt.build(model.trainable_variables)
    before = _weights(model)
    for _ in range(ACCUM):
        opt.apply(_grads(model, 1e38), model.trainable_variables)
    assert opt.nonfinite_skipped == 0 and int(opt.iterations) == 1
    # w ← w − 1e-37·2e38 = w − 20, to float32 rounding.
    assert _max_diff(_weights(model), [w - 20.0 for w in before]) <= 1e-5 * 20


_F32_MAX = float(np.finfo("float32").max)
ALL_FINITE_CASES = {
    "finite": ([[1.0, -2.0], [3.0]], "float32", True),
    "nan": ([[1.0, np.nan], [3.0]], "float32", False),
    "inf": ([[np.inf], [1.0]], "float32", False),
    "-inf": ([[1.0], [-np.inf, 2.0]], "float32", False),
    "inf minus inf": ([[np.inf], [-np.inf]], "float32", False),
    "total overflows": ([[_F32_MAX, _F32_MAX], [_F32_MAX]], "float32", True),
    "total overflows, then inf": ([[_F32_MAX, _F32_MAX, np.inf]], "float32", False),
    "empty tensor": ([[-3e38, -3e38], []], "float32", True),
    "float16 total overflows": ([[60000.0, 60000.0]], "float16", True),
    "float16 inf": ([[1.0, np.inf]], "float16", False),
    "bfloat16 total overflows": ([[3e38, 3e38]], "bfloat16", True),
    "bfloat16 nan": ([[np.nan, 3e38]], "bfloat16", False),
}


@pytest.mark.parametrize("case", ALL_FINITE_CASES, ids=str)
def test_all_finite_is_the_elementwise_verdict(case):
    """The boundary's check gives what ``np.isfinite(...).all()`` gives, on every backend
    (TensorFlow's sums each tensor first: a finite total proves every element finite, a total
    that overflows is decided element by element), eagerly and, on TensorFlow, traced."""
    from gradient_accumulator.keras import _cycle

    values, dtype, expected = ALL_FINITE_CASES[case]
    assert all(np.isfinite(np.asarray(v, "float64")).all() for v in values) == expected
    tensors = [keras.ops.convert_to_tensor(np.asarray(v, "float32"), dtype) for v in values]
    assert bool(keras.ops.convert_to_numpy(_cycle.all_finite(tensors))) is expected
    if BACKEND == "tensorflow":
        import tensorflow as tf

        traced = tf.function(lambda ts: _cycle.all_finite(ts))
        assert bool(traced(tensors).numpy()) is expected


def test_loss_scaling_skips_silently_whatever_on_nonfinite_says():
    model = _model()
    opt = _eager_opt(model, mixed_precision=True, on_nonfinite="raise")
    before, scale = _weights(model), float(keras.ops.convert_to_numpy(opt.loss_scale))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteGradientWarning)
        opt.apply(_grads(model, np.inf), model.trainable_variables)
        opt.apply(_grads(model, 1.0), model.trainable_variables)
    assert float(keras.ops.convert_to_numpy(opt.loss_scale)) == scale / 2
    assert opt.nonfinite_skipped == 0
    assert _max_diff(_weights(model), before) == 0.0


@pytest.mark.parametrize("cls", ["optimizer", "model"])
@pytest.mark.parametrize(
    ("value", "error"),
    [("never", ValueError), (None, TypeError), (1, TypeError), ("SKIP", ValueError)],
)
def test_bad_on_nonfinite_is_refused_by_name(cls, value, error):
    with pytest.raises(error, match="on_nonfinite"):
        if cls == "optimizer":
            GradientAccumulateOptimizer("SGD", 2, on_nonfinite=value)
        else:
            _model(GradientAccumulateModel, accum_steps=2, on_nonfinite=value)


def test_on_nonfinite_survives_the_config_round_trip():
    opt = GradientAccumulateOptimizer("SGD", 2, on_nonfinite="raise")
    assert GradientAccumulateOptimizer.from_config(opt.get_config()).on_nonfinite == "raise"
    model = _model(GradientAccumulateModel, accum_steps=2, on_nonfinite="apply")
    assert model.get_config()["on_nonfinite"] == "apply"
