"""JAX: the accumulators of small variables share one flat variable, and nothing else changes.

Keras's JAX step costs host time per state array, so on JAX the wrapper keeps every accumulator
of at most ``FLAT_MAX_ELEMENTS`` elements as a slice of one flat float32 variable, and folds
their gradients into it in one pass; larger ones keep a variable each. Training with that layout
must give, bit for bit, what one variable per accumulator gives: weights, the inner optimizer's
state and every accumulator, through cycles, a short last batch (the epoch-end flush) and
eager and compiled steps.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND

from gradient_accumulator.keras import GradientAccumulateOptimizer, _packed

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="the flat accumulators are JAX's")


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    # Kernels of 5,120 (alone), 800 and 10 elements, biases of 80, 10 and 1 (shared).
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(80, activation="tanh"),
            keras.layers.Dense(10, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _train(flat_max: int, run_eagerly: bool, settings: dict, monkeypatch) -> tuple:
    monkeypatch.setattr(_packed, "FLAT_MAX_ELEMENTS", flat_max)
    model = _model(0)
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(1e-2), accum_steps=3, **settings)
    model.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(88, 64)).astype("float32")  # 11 batches of 8: the last cycle short
    y = rng.normal(size=(88, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    # Two more micro-batches, pending in the accumulators (no epoch end flushes them).
    for i in range(2):
        model.train_on_batch(x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
    own = opt.variables[: len(opt.variables) - len(opt.optimizer.variables)]
    return (
        [v.numpy() for v in model.trainable_variables],
        [np.asarray(v.value) for v in opt.optimizer.variables],
        [np.asarray(a) for a in opt.accumulators],
        [tuple(v.shape) for v in own],
        int(opt.counter("micro_step")),
    )


CASES = {
    "mean": (False, {}),
    "mean-eager": (True, {}),
    "sum": (False, {"reduction": "SUM"}),
    "running-mean": (False, {"reduction": "RUNNING_MEAN"}),
    "mixed-precision": (False, {"mixed_precision": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shared_flat_variable_trains_bit_for_bit_like_one_variable_each(case, monkeypatch):
    run_eagerly, settings = CASES[case]
    flat = _train(_packed.FLAT_MAX_ELEMENTS, run_eagerly, settings, monkeypatch)
    each = _train(-1, run_eagerly, settings, monkeypatch)
    # The layouts (the counters: five, with the epoch clock's two): the 64x80 kernel alone,
    # the five small accumulators in one vector of 901.
    assert flat[3] == [(), (5,), (10,), (901,), (64, 80)]
    assert each[3] == [(), (5,), (10,), (64, 80), (80,), (80, 10), (10,), (10, 1), (1,)]
    for got, want in zip(flat[:3], each[:3]):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert flat[4] == each[4] == 2
    # Something was accumulated and updated (a test that cannot fail on zeros).
    assert max(float(np.max(np.abs(a))) for a in flat[2]) > 0.0
    assert float(np.max(np.abs(flat[1][2]))) > 0.0  # Adam's first moment of the kernel


def test_no_flat_variable_for_fewer_than_two_small_accumulators(monkeypatch):
    monkeypatch.setattr(_packed, "FLAT_MAX_ELEMENTS", 10)
    model = _model(0)  # the second bias, the last kernel and the last bias are that small
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    opt.build(model.trainable_variables)
    shared = [a for a in opt.accumulators if hasattr(a, "packed")]
    assert [a.shape for a in shared] == [(10,), (10, 1), (1,)]
    assert tuple(opt._acc_flat.shape) == (21,)
    monkeypatch.setattr(_packed, "FLAT_MAX_ELEMENTS", 5)
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    opt.build(model.trainable_variables)
    assert not any(hasattr(a, "packed") for a in opt.accumulators)
    assert opt._acc_flat is None


def test_a_shared_accumulator_is_used_like_a_variable():
    """A shared accumulator's view: its variable's shape, dtype and a path of its own; a value
    of another shape is refused, as ``keras.Variable.assign`` refuses it, and nothing moves."""
    model = _model(0)
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    opt.build(model.trainable_variables)
    acc = opt.accumulators[2]  # the 80 x 10 kernel's
    assert acc.shape == (80, 10)
    assert keras.backend.standardize_dtype(acc.dtype) == "float32"
    assert acc.path.endswith("_accumulator") and acc.path != opt.accumulators[1].path
    acc.assign(np.full((80, 10), 2.0, "float32"))
    before = np.asarray(opt._acc_flat.value).copy()
    with pytest.raises(ValueError, match=r"shape \(1,\)"):
        acc.assign(np.ones((1,), "float32"))
    with pytest.raises(ValueError, match="shape"):
        acc.assign(np.ones((10, 80), "float32"))
    np.testing.assert_array_equal(np.asarray(opt._acc_flat.value), before)
    np.testing.assert_array_equal(acc.numpy(), np.full((80, 10), 2.0, "float32"))
    assert opt.counter("micro_step").shape == ()
    assert opt._seen.shape == (6,)
