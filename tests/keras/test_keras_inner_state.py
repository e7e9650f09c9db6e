"""Every built-in Keras optimizer keeps its whole state inside GradientAccumulateOptimizer.

With ``accum_steps=1`` the wrapper must be the plain optimizer, bit for bit, over several
steps (state beyond moments, e.g. Nadam's ``_u_product``, included), and a ``.keras`` save and
load must restore every variable of the inner optimizer.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
from keras_helpers import BACKEND

from gradient_accumulator.keras import GradientAccumulateOptimizer

# Not plain optimizers: a wrapper (taken over by mixed_precision, tested elsewhere), a
# container of several optimizers, and the abstract base.
_NOT_PLAIN = {"Optimizer", "LossScaleOptimizer", "MultiOptimizer"}
NAMES = sorted(
    name
    for name, obj in vars(keras.optimizers).items()
    if inspect.isclass(obj)
    and issubclass(obj, keras.optimizers.Optimizer)
    and name not in _NOT_PLAIN
)


def _inner(name):
    cls = getattr(keras.optimizers, name)
    kwargs = {"learning_rate": 0.05}
    if name == "SGD":
        kwargs["momentum"] = 0.9
    if name == "Ftrl":
        kwargs.update(l1_regularization_strength=1e-3, l2_regularization_strength=1e-3)
    return cls(**kwargs)


def _variables():
    rng = np.random.default_rng(1)
    return [
        keras.Variable(rng.normal(size=(5, 4)).astype("float32"), name="kernel"),
        keras.Variable(rng.normal(size=(4,)).astype("float32"), name="bias"),
    ]


def _grads(step):
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(4,)).astype("float32")]


def _same(actual, desired, what):
    """Bit for bit; on JAX to a few float32 ulps (1e-6): the wrapper's update is compiled in a
    ``lax.cond`` (XLA fuses and reorders) while the plain optimizer's runs op by op."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    if BACKEND == "jax":
        np.testing.assert_allclose(actual, desired, rtol=1e-6, atol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, desired, err_msg=what)


def test_the_list_covers_the_optimizers_with_extra_state():
    assert {"SGD", "Adam", "AdamW", "Nadam", "Ftrl", "Adafactor", "Lion", "Lamb"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_accum_steps_1_is_the_plain_optimizer_bit_for_bit(name):
    plain_vars, wrapped_vars = _variables(), _variables()
    plain = _inner(name)
    # The torch backend's fused C++ update is exact to float32 rounding, not bit for bit with
    # Keras's formula: compare the generic path, which hands the gradient to the inner optimizer.
    wrapper = GradientAccumulateOptimizer(
        _inner(name), accum_steps=1, use_core=False if BACKEND == "torch" else None
    )
    for step in range(4):
        grads = _grads(step)
        plain.apply([keras.ops.convert_to_tensor(g) for g in grads], plain_vars)
        wrapper.apply([keras.ops.convert_to_tensor(g) for g in grads], wrapped_vars)
    for a, b in zip(plain_vars, wrapped_vars):
        _same(b, a, a.name)
    inner = wrapper.inner_optimizer
    # Same state, variable for variable (number, shapes and values; unnamed variables such as
    # Nadam's get numbered names that differ).
    assert [v.shape for v in inner.variables] == [v.shape for v in plain.variables]
    for a, b in zip(plain.variables, inner.variables):
        _same(b, a, a.name)
    assert all(any(v is w for w in wrapper.variables) for v in inner.variables)


def test_nadam_u_product_is_tracked_and_updated():
    """Nadam's running product of momentum factors lived outside the tracked variables."""
    variables = _variables()
    wrapper = GradientAccumulateOptimizer(keras.optimizers.Nadam(0.05), accum_steps=2)
    for step in range(4):
        wrapper.apply([keras.ops.convert_to_tensor(g) for g in _grads(step)], variables)
    inner = wrapper.inner_optimizer
    assert any(v is inner._u_product for v in inner.variables)
    beta_1 = 0.9
    expected = np.prod([beta_1 * (1 - 0.5 * 0.96**t) for t in (1, 2)])  # two updates
    np.testing.assert_allclose(float(np.asarray(inner._u_product)), expected, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_keras_round_trip_keeps_every_inner_variable(name, tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.compile(GradientAccumulateOptimizer(_inner(name), accum_steps=2), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 2)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    before = model.optimizer.inner_optimizer.variables
    after = loaded.optimizer.inner_optimizer.variables
    # Paths and names differ by the loaded model's layer names only: compare in order.
    assert [v.shape for v in after] == [v.shape for v in before]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=a.path)
    assert int(np.asarray(loaded.optimizer.iterations)) == 3
