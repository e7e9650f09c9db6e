"""AccumBatchNormalization and BatchNormalization exchange weights both ways, values carried
exactly; a wrong ``axis`` is refused by name."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradient_accumulator.keras import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    restore_batchnorm_layers,
)


def _np(t):
    return np.asarray(keras.ops.convert_to_numpy(t))


def _trained_bn(center=True, scale=True, axis=-1):
    """A BatchNormalization with non-trivial gamma, beta and moving statistics."""
    rng = np.random.default_rng(0)
    bn = keras.layers.BatchNormalization(center=center, scale=scale, axis=axis, momentum=0.5)
    x = rng.normal(2.0, 3.0, size=(16, 5, 4)).astype("float32")
    bn(x, training=True)
    weights = [rng.normal(size=w.shape).astype("float32") for w in bn.weights]
    weights[-1] = np.abs(weights[-1]) + 0.5  # a variance
    bn.set_weights(weights)
    return bn, x


@pytest.mark.parametrize(("center", "scale"), [(True, True), (False, True), (False, False)])
def test_set_weights_takes_a_batchnorms_weights(center, scale):
    """set_weights refused a BatchNormalization's weights (4 given, 8 expected)."""
    bn, x = _trained_bn(center, scale)
    layer = AccumBatchNormalization(accum_steps=3, center=center, scale=scale, momentum=0.5)
    layer(x, training=False)
    layer(x, training=True)  # a pending micro-batch, which the new weights discard
    layer.set_weights(bn.get_weights())
    for ours, theirs in zip(layer.get_weights(), bn.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
    assert int(_np(layer.accum_step)) == 0
    np.testing.assert_array_equal(_np(layer(x, training=False)), _np(bn(x, training=False)))
    # Its own 8 weights still round-trip.
    own = layer.get_weights()
    assert len(own) == len(bn.get_weights()) + 4
    layer.set_weights(own)
    for a, b in zip(layer.get_weights(), own):
        np.testing.assert_array_equal(a, b)


def test_set_weights_refuses_a_wrong_list_whole():
    bn, x = _trained_bn()
    layer = AccumBatchNormalization(accum_steps=2)
    layer(x, training=False)
    before = layer.get_weights()
    with pytest.raises(ValueError, match="weights"):
        layer.set_weights(bn.get_weights()[:3])
    bad = bn.get_weights()
    bad[3] = np.ones(7, "float32")
    with pytest.raises(ValueError, match="moving_variance"):
        layer.set_weights(bad)
    for a, b in zip(layer.get_weights(), before):
        np.testing.assert_array_equal(a, b)  # nothing half-applied


@pytest.mark.parametrize("axis", [-1, 1])
def test_to_batchnorm_carries_config_and_weights(axis):
    bn, x = _trained_bn(axis=axis)
    layer = AccumBatchNormalization(accum_steps=2, axis=axis, momentum=0.5, epsilon=1e-4)
    layer(x, training=False)
    layer.set_weights(bn.get_weights())
    plain = layer.to_batchnorm()
    assert type(plain) is keras.layers.BatchNormalization
    assert (plain.axis, plain.momentum, plain.epsilon, plain.name) == (
        layer.axis,
        0.5,
        1e-4,
        layer.name,
    )
    for a, b in zip(plain.get_weights(), bn.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_np(plain(x, training=False)), _np(layer(x, training=False)))
    assert not AccumBatchNormalization(accum_steps=2).to_batchnorm().built


def test_restore_batchnorm_layers_round_trip(tmp_path):
    """A trained model with AccumBatchNormalization back to plain batch norm (the statistics
    of an unfinished cycle flushed first), saved and loaded without this package's layers."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = AccumBatchNormalization(accum_steps=2, momentum=0.5, name="bn")(
        keras.layers.Dense(6)(inputs)
    )
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=keras.layers.Dense(2)(h))
    model.compile(keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 4)).astype("float32")
    model.fit(x, x[:, :2], batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.fit(x[:4], x[:4, :2], batch_size=4, epochs=1, shuffle=False, verbose=0)
    layer = model.get_layer("bn")
    layer(model.layers[1](x[:4]), training=True)  # a micro-batch left pending
    pending_mean = _np(layer.accum_mean)
    moving = _np(layer.moving_mean)
    expected = moving * 0.5 + pending_mean * 0.5

    plain = restore_batchnorm_layers(model)
    bn = plain.get_layer("bn")
    assert type(bn) is keras.layers.BatchNormalization
    assert not any(isinstance(lay, AccumBatchNormalization) for lay in plain.layers)
    np.testing.assert_allclose(_np(bn.moving_mean), expected, rtol=1e-6)
    theirs = [w for lay in model.layers for w in lay.get_weights()[:4]]
    ours = [w for lay in plain.layers for w in lay.get_weights()]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_np(plain(x, training=False)), _np(model(x, training=False)))
    path = tmp_path / "plain.keras"
    plain.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    np.testing.assert_array_equal(_np(loaded(x, training=False)), _np(plain(x, training=False)))
    # And back again: the plain model's weights into a fresh accumulating layer.
    again = AccumBatchNormalization(accum_steps=2, momentum=0.5)
    again(np.zeros((1, 6), "float32"))
    again.set_weights(bn.get_weights())
    np.testing.assert_array_equal(_np(again.moving_mean), _np(bn.moving_mean))


@pytest.mark.parametrize(
    ("axis", "error"),
    [(2, ValueError), (-3, ValueError), (5, ValueError), ("1", TypeError), (1.0, TypeError)],
)
def test_a_wrong_axis_is_refused_by_name(axis, error):
    """An axis out of range raised IndexError from inside the build, a string or float an
    int() error; neither said which argument was wrong."""
    x = np.ones((4, 3), "float32")
    with pytest.raises(error, match="axis"):
        AccumBatchNormalization(axis=axis)(x)
