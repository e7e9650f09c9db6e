"""Settings assigned after construction: checked and normalised like the constructor's
arguments, read the same way by every path, and not lost in a step compiled before the change.

Each setting is a property backed by one frozen options record (``gradient_accumulator._options``):
a bad value is refused with the PyTorch wrapper's message and leaves the record as it was; a
good one in any letter case means what the constructor's would. A change of a value that a
compiled ``fit`` step holds as a constant makes the next ``fit`` trace its step again.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from gradient_accumulator.keras import GradientAccumulateOptimizer

BACKEND = keras.backend.backend()
# The torch backend has two eager paths: the C++ core and backend ops.
USE_CORE = [None, False] if BACKEND == "torch" else [None]


def _setup(**kwargs):
    v = keras.Variable(np.zeros(2, "float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), **kwargs)
    opt.build([v])
    return opt, v


@pytest.mark.parametrize("use_core", USE_CORE)
@pytest.mark.parametrize("spelling", ["mean", "Mean", "MEAN"])
def test_reduction_assigned_in_any_case_averages(use_core, spelling):
    """SUM at construction, then ``reduction = "mean"``: two micro-batches of gradient 1 give
    one SGD(1.0) step of their mean, w = -1.0 (the sum would give -2.0)."""
    opt, v = _setup(accum_steps=2, reduction="SUM", use_core=use_core)
    opt.reduction = spelling
    assert opt.reduction == "MEAN"
    for _ in range(2):
        opt.apply([ops.ones((2,))], [v])
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-1.0, -1.0], rtol=0, atol=1e-7)


@pytest.mark.parametrize("use_core", USE_CORE)
def test_reduction_assigned_sum_sums(use_core):
    opt, v = _setup(accum_steps=2, use_core=use_core)
    opt.reduction = "sum"
    assert opt.reduction == "SUM"
    for g in (1.0, 3.0):
        opt.apply([ops.full((2,), g)], [v])
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-4.0, -4.0], rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("reduction", "bogus", ValueError, "reduction must be one of"),
        ("reduction", 1, TypeError, "reduction must be a string"),
        ("accum_steps", 0, ValueError, "accum_steps must be >= 1"),
        ("accum_steps", 2.5, TypeError, "accum_steps must be an int"),
        ("accum_steps", True, TypeError, "accum_steps must be an int"),
        ("clip_factor", -1.0, ValueError, "clip_factor must be finite and > 0"),
        ("clip_factor", float("nan"), ValueError, "clip_factor must be finite and > 0"),
        ("eps", -1e-3, ValueError, "eps must be finite and >= 0"),
        ("use_agc", "yes", TypeError, "use_agc must be a bool"),
        ("leftover", "keep", ValueError, "leftover must be one of"),
        ("on_nonfinite", "ignore", ValueError, "on_nonfinite"),
    ],
)
def test_bad_assignment_refused_state_intact(name, value, error, message):
    opt, v = _setup(accum_steps=2, use_agc=True, clip_factor=0.5, agc_exclude=None)
    before = {k: getattr(opt, k) for k in ("reduction", "accum_steps", "clip_factor", "eps")}
    before.update(use_agc=opt.use_agc, leftover=opt.leftover, on_nonfinite=opt.on_nonfinite)
    with pytest.raises(error, match=message):
        setattr(opt, name, value)
    after = {k: getattr(opt, k) for k in before}
    assert after == before


def test_refused_assignment_then_training_unchanged():
    """A refused ``accum_steps = 0`` leaves the cycle length at 2: the 2nd micro-batch
    updates, with the mean of the two gradients."""
    opt, v = _setup(accum_steps=2)
    with pytest.raises(ValueError, match="accum_steps"):
        opt.accum_steps = 0
    for g in (1.0, 3.0):
        opt.apply([ops.full((2,), g)], [v])
    np.testing.assert_allclose(ops.convert_to_numpy(v), [-2.0, -2.0], rtol=0, atol=1e-7)
    assert int(opt.iterations) == 1


def test_use_agc_refused_beside_global_clipnorm_is_not_a_rule():
    """AGC and Keras's clipnorm/global_clipnorm may be combined (only the PyTorch wrapper's
    max_grad_norm is exclusive with AGC): switching AGC on is accepted."""
    opt, _ = _setup(accum_steps=2, global_clipnorm=1.0)
    opt.use_agc = True
    assert opt.use_agc is True


def test_settings_round_trip_through_config():
    opt, _ = _setup(accum_steps=2)
    opt.reduction = "running_mean"
    opt.accum_steps = 3
    opt.leftover = "Carry"
    config = opt.get_config()
    assert (config["reduction"], config["accum_steps"], config["leftover"]) == (
        "RUNNING_MEAN",
        3,
        "carry",
    )
    clone = GradientAccumulateOptimizer.from_config(config)
    assert (clone.reduction, clone.accum_steps, clone.leftover) == ("RUNNING_MEAN", 3, "carry")


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    return model


@pytest.mark.parametrize("jit_compile", [False, "auto"])
def test_accum_steps_changed_between_fits(jit_compile):
    """8 micro-batches with accum_steps=4 make 2 updates; after ``accum_steps = 2`` the next
    fit's 8 micro-batches make 4 more, and the weights are those of a model trained the same
    way by hand (mean gradient of each cycle, SGD, float64)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    model = _model()
    w0 = [ops.convert_to_numpy(w).astype("float64") for w in model.weights]
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 2
    opt.accum_steps = 2
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 6

    # The reference: Dense(2) under MSE, gradients by hand in float64.
    kernel, bias = w0
    for steps in (4, 2):
        for start in range(0, 8, steps):
            gk, gb = np.zeros_like(kernel), np.zeros_like(bias)
            for b in range(start, start + steps):
                xb, yb = x[2 * b : 2 * b + 2].astype("float64"), y[2 * b : 2 * b + 2]
                d = 2.0 * (xb @ kernel + bias - yb) / yb.size
                gk += xb.T @ d
                gb += d.sum(0)
            kernel = kernel - 0.1 * gk / steps
            bias = bias - 0.1 * gb / steps
    got = [ops.convert_to_numpy(w) for w in model.weights]
    np.testing.assert_allclose(got[0], kernel, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[1], bias, rtol=0, atol=1e-5)


def test_reduction_changed_between_fits():
    """SUM for one fit, then ``reduction = "mean"``: the second fit averages (its update equals
    that of a fresh MEAN optimizer from the same weights)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    model = _model()
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=4, reduction="SUM")
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    start = [ops.convert_to_numpy(w).copy() for w in model.weights]
    opt.reduction = "mean"
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)

    ref = _model()
    ref.set_weights(start)
    ref.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=4),
        loss="mse",
    )
    ref.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    for got, want in zip(model.weights, ref.weights):
        np.testing.assert_allclose(
            ops.convert_to_numpy(got), ops.convert_to_numpy(want), rtol=0, atol=1e-6
        )
