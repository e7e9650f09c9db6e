"""AccumBatchNormalization in a GradientAccumulateModel follows the optimizer's cycle.

Compiling the model wrapper registers its AccumBatchNormalization layers with the accumulating
optimizer: they take ``accum_steps`` from it, and ``reinit_grad_accum()`` resets both. Each
scenario counts updates and checks the moving statistics against an fp64 reference that merges
exactly the batches of each optimizer cycle (momentum 0.5, so every merge and its grouping
shows), eagerly and compiled.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradient_accumulator.keras import AccumBatchNormalization, GradientAccumulateModel

C, B, MOMENTUM = 3, 4, 0.5
TOL = 1e-5  # float32 moving statistics against the fp64 reference, relative to max|ref|


def _data(n):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, C)) * 2.0 + np.array([3.0, -2.0, 10.0])
    return x.astype("float32"), np.zeros((n, 1), "float32")


def _model(accum_steps, layer_steps, run_eagerly, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((C,))
    # Batch norm first: its inputs are the data, so the reference needs no forward.
    x = AccumBatchNormalization(accum_steps=layer_steps, momentum=MOMENTUM)(inputs)
    outputs = keras.layers.Dense(1)(x)
    model = GradientAccumulateModel(
        accum_steps=accum_steps, inputs=inputs, outputs=outputs, **kwargs
    )
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse", run_eagerly=run_eagerly)
    return model, model.layers[1]


def _reference(x, groups):
    """Moving mean and (biased) variance after one Keras update per group of rows."""
    mean, var = np.zeros(C), np.ones(C)
    for lo, hi in groups:
        rows = x[lo:hi].astype("float64")
        mean = mean * MOMENTUM + rows.mean(axis=0) * (1 - MOMENTUM)
        var = var * MOMENTUM + rows.var(axis=0) * (1 - MOMENTUM)
    return mean, var


def _check(layer, x, groups):
    mean, var = _reference(x, groups)
    for got, want in ((layer.moving_mean, mean), (layer.moving_variance, var)):
        got = keras.ops.convert_to_numpy(got).astype("float64")
        assert np.abs(got - want).max() <= TOL * np.abs(want).max(), (got, want)
    assert int(keras.ops.convert_to_numpy(layer.accum_step)) == 0


@pytest.mark.parametrize("run_eagerly", [True, False], ids=["eager", "compiled"])
def test_accum_steps_changed_between_cycles_keeps_batchnorm_in_phase(run_eagerly):
    """2 cycles of 2 batches, then accum_steps=4 on the optimizer: 2 cycles of 4. Four updates
    and four merges, each of one cycle's batches (the layer was built with 2)."""
    x, y = _data(12 * B)
    model, layer = _model(2, 2, run_eagerly)
    model.fit(x[: 4 * B], y[: 4 * B], batch_size=B, shuffle=False, verbose=0)
    model.optimizer.accum_steps = 4
    model.make_train_function(force=True)  # the step was traced with the old cycle length
    model.fit(x[4 * B :], y[4 * B :], batch_size=B, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 4
    _check(layer, x, [(0, 2 * B), (2 * B, 4 * B), (4 * B, 8 * B), (8 * B, 12 * B)])
    assert layer.accum_steps == 4 and layer.registered_optimizer() is model.optimizer


@pytest.mark.parametrize("run_eagerly", [True, False], ids=["eager", "compiled"])
def test_reinit_grad_accum_resets_batchnorm_with_the_optimizer(run_eagerly):
    """A carried partial cycle discarded by reinit_grad_accum() is discarded by batch norm too:
    the next cycle's merge holds only its own batches."""
    x, y = _data(7 * B)
    model, layer = _model(2, 2, run_eagerly, leftover="carry")
    model.fit(x[: 3 * B], y[: 3 * B], batch_size=B, shuffle=False, verbose=0)
    assert model.optimizer.pending() == 1
    model.reinit_grad_accum()
    assert int(keras.ops.convert_to_numpy(layer.accum_step)) == 0
    model.fit(x[3 * B : 5 * B], y[3 * B : 5 * B], batch_size=B, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2
    _check(layer, x, [(0, 2 * B), (3 * B, 5 * B)])


def test_unregistered_layer_keeps_its_own_accum_steps():
    """Outside a compiled model wrapper the layer counts its own cycle, as before."""
    layer = AccumBatchNormalization(accum_steps=3, momentum=MOMENTUM)
    x, _ = _data(6 * B)
    for j in range(6):
        layer(x[j * B : (j + 1) * B], training=True)
    assert layer.registered_optimizer() is None and layer.accum_steps == 3
    _check(layer, x, [(0, 3 * B), (3 * B, 6 * B)])
    assert layer.get_config()["accum_steps"] == 3


def test_accum_steps_set_on_a_registered_layer_warns_and_is_ignored():
    model, layer = _model(2, 5, True)
    assert layer.accum_steps == 2
    with pytest.warns(UserWarning, match="follows the optimizer's accum_steps"):
        layer.accum_steps = 6
    assert layer.accum_steps == 2 and layer.get_config()["accum_steps"] == 2
    with pytest.raises(ValueError, match="accum_steps"):
        layer.accum_steps = 0


def test_saved_model_is_registered_again_when_loaded(tmp_path):
    """A .keras file of a registered model mid-cycle: the optimizer's state is saved once, where
    Keras puts it, and the loaded layer follows the loaded optimizer from where both were."""
    x, y = _data(3 * B)
    model, layer = _model(2, 2, False, leftover="carry")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    bn = loaded.layers[1]
    assert bn.registered_optimizer() is loaded.optimizer and bn.accum_steps == 2
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == 1
    assert loaded.optimizer.pending() == 1
    assert int(keras.ops.convert_to_numpy(bn.accum_step)) == 1
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
